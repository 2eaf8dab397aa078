"""Whether Triton can run here, asked before a Triton module is imported.

The kernel modules import Triton at their top; `occult_hf` itself never needs it (a CPU install without Triton
works), so the code that picks a Triton path first asks these two questions: does Triton import, and does its
interpreter run kernels on CPU tensors (`TRITON_INTERPRET=1`, the tests' mode)? Also the launch sizes' integer
arithmetic that every Triton module's host side shares (plain Python, no Triton needed).
"""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    """Whether `TRITON_INTERPRET=1`: kernels run interpreted, on CPU tensors (read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether `import triton` works in this process (tried once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: `triton.cdiv` is a constexpr function whose call costs microseconds
    of host time, and the grids call it on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in plain Python (see `cdiv`)."""
    return 1 << (n - 1).bit_length()


__all__ = ["cdiv", "interpreting", "next_power_of_2", "triton_importable"]
