"""Running out of host memory as an error rather than the kernel's kill.

On Linux a process that takes more memory than the machine has is killed by the OOM killer: exit status 137, no
message, after a minute of building tensors. Under `RLIMIT_DATA` (the data segment: the heap and the private
writable mappings where torch's CPU tensors live) the allocation that would overflow fails instead, and torch raises
`RuntimeError: ... DefaultCPUAllocator: can't allocate memory`, which the caller can turn into a message that names
the sizes to shrink.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

#: left to the rest of the machine (and to this process's stacks and libraries) when the cap is set
MARGIN_BYTES = 256 * 2**20


@contextlib.contextmanager
def capped_at_free_memory(margin_bytes: int = MARGIN_BYTES) -> Iterator[int | None]:
    """Inside, this process's data segment may grow by what the machine has available now, less `margin_bytes`; yields
    that growth in bytes (None off Linux, where the cap is not set). The previous limits come back on exit. Child
    processes started inside inherit the cap, each against its own data segment."""
    if not sys.platform.startswith("linux"):
        yield None
        return
    import resource  # Unix only: this module is imported everywhere the benchmarks are

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    growth = max(available_bytes() - margin_bytes, 0)
    cap = data_segment_bytes() + growth
    for limit in (soft, hard):
        if limit != resource.RLIM_INFINITY:
            cap = min(cap, limit)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield growth
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def available_bytes() -> int:
    """The memory the OS can give this process now (psutil's `available`: free memory and reclaimable caches)."""
    import psutil  # an accelerate dependency

    return psutil.virtual_memory().available


def data_segment_bytes() -> int:
    """This process's data segment now (`VmData` of /proc/self/status), the size `RLIMIT_DATA` limits."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmData line")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that found no memory and says nothing more: torch's CPU allocator's
    `RuntimeError`, or the interpreter's bare `MemoryError`. A `MemoryError` with a message of its own (numpy's
    "Unable to allocate ...", a check that named the sizes) already says what ran out."""
    if isinstance(error, MemoryError):
        return not error.args
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)
