"""`no_host_reads()`: every data-dependent host read of a tensor is an error inside it (the CPU stand-in for
`torch.cuda.set_sync_debug_mode("error")`: on a GPU each such read waits for the device).

Two frames may read: `expert_mlp_reference`, the CPU specification of the expert kernels, reads its segment offsets
on purpose (the GPU kernels do not); the static dispatchers' `_gather_on_host` reads the ranks' token counts and row
formats gathered over the host (gloo) group, CPU tensors that are never on a device.
"""

from __future__ import annotations

import contextlib
import sys

import torch

#: the Tensor methods that read a tensor's data on the host
HOST_READS = ("tolist", "item", "nonzero", "__bool__", "__int__", "__float__")
#: the functions whose own reads are allowed (see the module docstring)
ALLOWED_FRAMES = ("expert_mlp_reference", "_gather_on_host")


@contextlib.contextmanager
def no_host_reads(what: str):
    """Inside: a host read of a tensor (outside `ALLOWED_FRAMES`) raises `AssertionError` naming `what`."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    original_nonzero = torch.nonzero

    def forbid(name):
        def guarded(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_name not in ALLOWED_FRAMES:
                raise AssertionError(f"Tensor.{name} read a tensor on the host in {what}")
            return originals[name](self, *args, **kwargs)

        return guarded

    def nonzero(*args, **kwargs):
        raise AssertionError(f"torch.nonzero read a tensor on the host in {what}")

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, forbid(name))
        torch.nonzero = nonzero
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = original_nonzero
