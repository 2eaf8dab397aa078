"""Decoding without host reads: a check that a step never reads the device, and static-capacity dispatchers on demand.

transformers' `generate(cache_implementation="static")` is occult_hf's decode path: it compiles the decoding step
and replays it as CUDA graphs (`mode="reduce-overhead"`), which needs every size static and no host read of a
device value in the step. The one-process MoE layer reads nothing on the host; under expert parallelism the compiled
step exchanges through static capacities by itself ("all_to_all" traces "padded"'s exchange, `dispatch.all_to_all`),
and EP ranks decode in lockstep (`hf.apply`).

- `no_host_sync()` turns any host read of a tensor value (`.item()`, `bool(t)`, `.tolist()`, data-dependent shapes
  such as `nonzero`) into an error, also on the CPU, where a CUDA synchronisation cannot be observed: the tests run a
  static-cache decoding step and the one-process MoE layer under it.
- `use_dispatcher(model, name)` gives every layer another dispatcher for a block, e.g. a static-capacity one
  ("padded" over NCCL, "symm_mem" with NVSHMEM, `dispatch.static`) for an eager dynamic-cache `generate()` under EP
  whose MoE blocks then read nothing on the host, or for a step the caller captures in a CUDA graph itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..dispatch import build_dispatcher
from ..moe import OccultMoE

#: aten ops whose result needs a device value on the host (a CUDA synchronisation)
_HOST_READS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::bincount",
    "aten::repeat_interleave",
    "aten::item",
}


class HostSyncError(RuntimeError):
    """A region that must not read device values on the host did (see `no_host_sync`)."""


class _NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_READS and not (name == "aten::repeat_interleave" and _static_repeat(args, kwargs)):
            raise HostSyncError(f"{name} reads a device value on the host (a CUDA synchronisation) inside no_host_sync()")
        if func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        ):
            raise HostSyncError("boolean-mask indexing has a data-dependent shape (a CUDA synchronisation) inside no_host_sync()")
        return func(*args, **(kwargs or {}))


def _static_repeat(args, kwargs) -> bool:
    """`repeat_interleave` with an int repeat count or an explicit output size does not read the device."""
    kwargs = kwargs or {}
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return not isinstance(repeats, torch.Tensor) or kwargs.get("output_size") is not None


@contextlib.contextmanager
def no_host_sync():
    """Raise `HostSyncError` where the code inside reads a tensor value on the host."""
    with _NoHostSync():
        yield


# ----- dispatchers for decoding ------------------------------------------------------------------
@contextlib.contextmanager
def use_dispatcher(model: torch.nn.Module, name: str):
    """Give every `OccultMoE` of `model` the dispatcher `name` (same group, layout and settings otherwise) inside
    the block."""
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    before = [layer.dispatcher for layer in layers]
    try:
        for layer, old in zip(layers, before):
            settings = replace(old.settings, dispatcher=name)
            layer.dispatcher = build_dispatcher(settings, old.ep, old.layout, layer.local_experts.gate_up_proj.device)
        yield model
    finally:
        for layer, old in zip(layers, before):
            layer.dispatcher = old


__all__ = ["HostSyncError", "no_host_sync", "use_dispatcher"]
