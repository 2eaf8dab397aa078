"""Whether Triton can run here, asked before a Triton module is imported.

The kernel modules import Triton at their top; `occult_hf` itself never needs it (a CPU install without Triton
works), so the code that picks a Triton path first asks these two questions: does Triton import, and does its
interpreter run kernels on CPU tensors (`TRITON_INTERPRET=1`, the tests' mode)?
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


__all__ = ["interpreting", "triton_importable"]
