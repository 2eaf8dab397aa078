"""Whether Triton can run here, asked before a Triton module is imported, and the one way to import it.

The kernel modules import Triton at their top; `occult_hf` itself never needs it (a CPU install of torch from PyPI
brings no Triton, and the torch paths work without it), so the code that picks a Triton path first asks whether
Triton imports and whether a kernel can run on a tensor (CUDA, or any device under the interpreter,
`TRITON_INTERPRET=1`, the tests' mode), and every Triton import outside the kernel modules goes through
`require_triton`, whose error names what needed it and how to get Triton. Also the launch sizes' integer
arithmetic that every Triton module's host side shares (plain Python, no Triton needed).
"""

from __future__ import annotations

import os

import torch

#: whether `import triton` works in this process (None: not tried yet)
_IMPORTABLE: bool | None = None


def interpreting() -> bool:
    """Whether `TRITON_INTERPRET=1`: kernels run interpreted, on CPU tensors (read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch.compiler.assume_constant_result
def triton_importable() -> bool:
    """Whether `import triton` works in this process (tried once). A constant to torch.compile: traced, the first
    call's lazy answer would be a guard on the unanswered question, and every first compilation would recompile."""
    global _IMPORTABLE
    if _IMPORTABLE is None:
        try:
            import triton  # noqa: F401
            _IMPORTABLE = True
        except ImportError:
            _IMPORTABLE = False
    return _IMPORTABLE


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on `tensor`: Triton imports, and the tensor is on a GPU or the interpreter
    runs (on CPU tensors)."""
    return (tensor.is_cuda or interpreting()) and triton_importable()


def require_triton(feature: str):
    """`import triton` for `feature` (what needs it, e.g. "expert_backend='triton'"), or an ImportError that names
    the feature and how to install Triton."""
    try:
        import triton
    except ImportError as error:
        raise ImportError(
            f"{feature} needs the triton package, which does not import here ({error}): `pip install triton`, or "
            f"install a CUDA build of torch, which brings its own"
        ) from error
    return triton


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: `triton.cdiv` is a constexpr function whose call costs microseconds
    of host time, and the grids call it on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in plain Python (see `cdiv`)."""
    return 1 << (n - 1).bit_length()


__all__ = ["cdiv", "interpreting", "next_power_of_2", "require_triton", "triton_importable", "triton_runs_on"]
