"""PEFT (LoRA) on models with `OccultMoE` blocks, in one process and under expert parallelism.

Shape legend: E routed experts, L experts of this rank, r LoRA rank, i/o the adapter's in/out features.

**How peft adapts fused experts.** `LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])` wraps the module holding a 3-D expert parameter in a `ParamWrapper`
(nested once per targeted parameter). Its forward registers a parametrization `W + scale * B A` on
the parameter, runs the wrapped module, and removes it. One wrapper adapts all experts of the
parameter: `lora_A.weight` is `[n * r, i]` with rows grouped by expert (expert-major, `(n, r, i)`)
and `lora_B.weight` is `[o, r * n]` with columns interleaved (expert-minor, `(o, r, n)`), `n` being
the parameter's first dimension.

**One process.** `OccultMoE.experts` (`LocalExperts`) holds all `E` experts in original order as
`gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` at the stock module path (`...mlp.experts`), and
reads them inside its forward, so peft wraps them exactly as on the stock model: the same targets,
the same adapter tensors; an adapter saved here loads into plain transformers + peft and back.
Attention (`target_modules=["q_proj", ...]`) is untouched by occult_hf.

**Expert parallelism.** On each rank the wrapped parameters hold the rank's `L` experts, so the
expert adapters are rank-local like the expert weights (`n = L`), and their gradients get the same
1/D scale (the parametrized weight goes through `LocalExperts`' gradient scaling). This module adds
what peft cannot know:

- `prepare_peft_model`: DDP must neither broadcast nor average the rank-local tensors (expert
  weights, expert adapters, the runtime's buffers): they are listed in the PEFT model's
  `_ddp_params_and_buffers_to_ignore` under their PEFT names; the runtime's global grad-norm
  carrier is made trainable again (peft freezes every non-adapter parameter).
- loading: a load-state-dict pre-hook on every `OccultMoE` cuts an adapter saved with all `E`
  experts down to this rank's experts, so `load_peft_model` (`PeftModel.from_pretrained`) takes
  the same adapter directory in one process and on any EP layout.
- `save_peft_model` (collective: every rank calls it): gathers the expert adapters of all ranks
  into original expert order; rank 0 writes a standard peft adapter directory.

**Plain peft works the same way.** A user who follows peft's own docs calls
`PeftModel.save_pretrained` and `PeftModel.from_pretrained` / `load_adapter`; left alone, under EP
the first had every rank write its own experts' adapters into the same files (an adapter that no
longer loads) and the second refused an adapter of all experts. `install_peft_hooks` (run by
`occult_hf.install()`, which `import occult_hf` calls; `occult_hf.uninstall()` undoes it) wraps both once peft is
imported (`hf.compat.wrap_when_imported`):

- `save_pretrained` on a model with rank-local expert adapters is `save_peft_model`: collective,
  rank 0 writes (unless `is_main_process` says otherwise). Before it gathers, the ranks check that
  they all joined (`checkpointing.check_model_ranks_agree`, bounded), so a save only rank 0 calls
  fails instead of waiting. The Trainer saves from rank 0 alone: its `save_model` hook (every rank)
  first takes `snapshot_adapters`, which rank 0's `save_pretrained` then writes while the adapters
  are unchanged. A `state_dict=` holding only this rank's experts is refused on every rank before
  any file is written.
- `load_adapter` (which `PeftModel.from_pretrained` calls) registers the slicing hooks first, so an
  adapter of all experts loads on any EP layout.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.collectives import gather_rows
from ..moe import OccultMoE
from .checkpointing import check_model_ranks_agree
from .compat import unwrap_when_imported, wrap_when_imported
from .ddp import DDP_IGNORE_ATTR, enable_grad_norm_carriers, rank_local_names
from .state import state_of

_HOOK_ATTR = "_occult_adapter_slicing_hook"
#: `(parameter versions, gathered state dict)` taken by `snapshot_adapters`, on the PEFT model
_SNAPSHOT_ATTR = "_occult_adapter_snapshot"
#: LoRA factors of a `ParamWrapper`: name -> the dimension that holds (expert, rank) pairs, and whether
#: the expert index is the slower (expert-major) or the faster (expert-minor) of the two
_FACTOR_LAYOUT = {"lora_A": (0, "expert_major"), "lora_B": (1, "expert_minor")}


# ----- the rank-local expert adapters ---------------------------------------------------------


def _expert_adapter_factors(model: nn.Module) -> Iterator[tuple[str, OccultMoE, str, torch.Tensor]]:
    """`(qualified name, block, factor name, parameter)` of every LoRA factor on an OccultMoE's experts."""
    for path, module in model.named_modules():
        if not isinstance(module, OccultMoE):
            continue
        for name, param in module.experts.named_parameters(prefix=f"{path}.experts"):
            factor = _factor_of(name)
            if factor is not None:
                yield name, module, factor, param


def _factor_of(name: str) -> str | None:
    """The LoRA factor (`lora_A` or `lora_B`) a name like `...experts.base_layer.lora_A.default.weight`
    belongs to, or None for any other tensor."""
    for part in name.split("."):
        if part in _FACTOR_LAYOUT:
            return part
    return None


def _select_experts(factor: str, tensor: torch.Tensor, num_experts: int, expert_ids: torch.Tensor) -> torch.Tensor:
    """The rows (lora_A) or columns (lora_B) of `expert_ids` from a factor covering `num_experts` experts."""
    dim, order = _FACTOR_LAYOUT[factor]
    size = tensor.shape[dim]
    if size % num_experts:
        raise ValueError(f"a {factor} factor with {size} (expert, rank) entries cannot cover {num_experts} experts")
    rank = size // num_experts
    shape = (num_experts, rank) if order == "expert_major" else (rank, num_experts)
    split = tensor.unflatten(dim, shape)
    expert_dim = dim if order == "expert_major" else dim + 1
    return split.index_select(expert_dim, expert_ids.to(tensor.device)).flatten(dim, dim + 1)


def _place_experts(factor: str, parts: list[torch.Tensor], ids: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Inverse of `_select_experts`: the factor of all experts from each device's part and expert ids."""
    dim, order = _FACTOR_LAYOUT[factor]
    rank = parts[0].shape[dim] // len(ids[0])
    shape_of = (lambda n: (n, rank)) if order == "expert_major" else (lambda n: (rank, n))
    expert_dim = dim if order == "expert_major" else dim + 1
    first = parts[0].unflatten(dim, shape_of(len(ids[0])))
    full_shape = list(first.shape)
    full_shape[expert_dim] = num_experts
    full = first.new_zeros(full_shape)
    for part, part_ids in zip(parts, ids):
        full.index_copy_(expert_dim, part_ids.to(full.device), part.unflatten(dim, shape_of(len(part_ids))))
    return full.flatten(dim, dim + 1)


def _slice_to_local_experts(module: OccultMoE, state_dict, prefix, *args) -> None:
    """Load pre-hook: factors saved for all E experts are cut to this rank's experts (in place)."""
    num_experts = module.layout.device_of_E.numel()
    expert_ids = module.local_experts.expert_ids
    local_shapes = {
        name: param.shape for name, param in module.experts.named_parameters(prefix=f"{prefix}experts")
    }
    for key in list(state_dict):
        factor = _factor_of(key) if key.startswith(f"{prefix}experts.") else None
        if factor is None or key not in local_shapes or state_dict[key].shape == local_shapes[key]:
            continue
        state_dict[key] = _select_experts(factor, state_dict[key], num_experts, expert_ids)


def _register_slicing_hooks(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, OccultMoE) and module.ep.is_distributed and _HOOK_ATTR not in module.__dict__:
            module.__dict__[_HOOK_ATTR] = module.register_load_state_dict_pre_hook(_slice_to_local_experts)


# ----- user entry points ----------------------------------------------------------------------


def prepare_peft_model(peft_model: nn.Module) -> nn.Module:
    """Make a PEFT-wrapped occult model ready for EP training (no-op in one process); returns it.

    Sets `_ddp_params_and_buffers_to_ignore` on the PEFT model (the rank-local parameters and
    buffers of every `OccultMoE`'s experts, adapters included, and the runtime's own state, under
    their names in the PEFT model) and makes the grad-norm carriers trainable.
    """
    ignore = set(peft_model.__dict__.get(DDP_IGNORE_ATTR) or []) | set(rank_local_names(peft_model))
    enable_grad_norm_carriers(peft_model)
    if ignore:
        peft_model.__dict__[DDP_IGNORE_ATTR] = sorted(ignore)
    return peft_model


def get_peft_model(model: nn.Module, peft_config, **kwargs) -> nn.Module:
    """`peft.get_peft_model` for an occult model, then `prepare_peft_model`."""
    import peft

    _register_slicing_hooks(model)
    return prepare_peft_model(peft.get_peft_model(model, peft_config, **kwargs))


def load_peft_model(model: nn.Module, adapter_path: str | os.PathLike, **kwargs) -> nn.Module:
    """`PeftModel.from_pretrained(model, adapter_path)` for an occult model (any EP layout: an
    adapter saved for all experts is cut to each rank's experts), then `prepare_peft_model`."""
    from peft import PeftModel

    _register_slicing_hooks(model)
    return prepare_peft_model(PeftModel.from_pretrained(model, os.fspath(adapter_path), **kwargs))


def gathered_adapter_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """`peft_model.state_dict()` with every expert adapter factor covering all E experts in original
    order (collective under EP: every rank must call it; every rank gets the full result)."""
    state_dict = peft_model.state_dict()
    for name, module, factor, param in _expert_adapter_factors(peft_model):
        if not module.ep.is_distributed:  # one process: all experts, original order already
            continue
        num_experts, expert_ids = module.layout.device_of_E.numel(), module.local_experts.expert_ids
        group, num_devices = module.ep.group, module.ep.num_devices
        ids = [(module.layout.device_of_E == device).nonzero().flatten() for device in range(num_devices)]
        dim, _ = _FACTOR_LAYOUT[factor]
        rank = param.shape[dim] // len(expert_ids)
        lengths = [len(i) * rank for i in ids]
        parts = gather_rows(param.detach(), dim, lengths, group, to_all=True, what=f"gathering the expert adapter {name}")
        state_dict[name] = _place_experts(factor, parts, ids, num_experts)
    return state_dict


def save_peft_model(peft_model: nn.Module, directory: str | os.PathLike, **kwargs) -> None:
    """Save the adapters with every expert adapter gathered over the EP ranks (collective under EP:
    call it on every rank); EP rank 0 (the main process in one process) writes a standard peft
    adapter directory that loads in one process, under EP, and into plain transformers + peft."""
    if has_distributed_expert_adapters(peft_model):
        kwargs["state_dict"] = _gathered_for_save(peft_model, "save_peft_model")
        kwargs.setdefault("is_main_process", _is_main_process())
    peft_model.save_pretrained(os.fspath(directory), **kwargs)


def snapshot_adapters(peft_model: nn.Module) -> None:
    """Collective: gather every rank's expert adapters now, for a later `save_pretrained` that rank 0
    alone calls (the Trainer's); it serves while no parameter of the model has changed."""
    if has_distributed_expert_adapters(peft_model):
        state_dict = _gathered_for_save(peft_model, "snapshot_adapters")
        peft_model.__dict__[_SNAPSHOT_ATTR] = (_parameter_versions(peft_model), state_dict)


def _gathered_for_save(peft_model: nn.Module, operation: str) -> dict[str, torch.Tensor]:
    """The gathered state dict, after the bounded check that every EP rank has come to `operation`."""
    model = peft_model.get_base_model()
    check_model_ranks_agree(model, state_of(model), operation)
    return gathered_adapter_state_dict(peft_model)


def _parameter_versions(peft_model: nn.Module) -> tuple[int, ...]:
    return tuple(param._version for param in peft_model.parameters())


def _is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _check_covers_all_experts(peft_model: nn.Module, state_dict: dict) -> None:
    """A `state_dict` handed to `save_pretrained` under EP must hold every expert's adapters, not this rank's."""
    for name, module, factor, param in _expert_adapter_factors(peft_model):
        dim, _ = _FACTOR_LAYOUT[factor]
        local, total = len(module.local_experts.expert_ids), module.layout.device_of_E.numel()
        if name in state_dict and state_dict[name].shape[dim] != param.shape[dim] // local * total:
            raise ValueError(
                f"PeftModel.save_pretrained(state_dict=...): {name} has shape {tuple(state_dict[name].shape)}, "
                f"this rank's {local} experts, not all {total}: under expert parallelism call save_pretrained "
                f"without state_dict on every rank (it gathers every rank's expert adapters; rank 0 writes)"
            )


def _save_pretrained(original, peft_model, save_directory, *args, **kwargs):
    """`PeftModel.save_pretrained`, under EP with every rank's expert adapters (see the module docstring)."""
    if has_distributed_expert_adapters(peft_model):
        if kwargs.get("state_dict") is not None:
            _check_covers_all_experts(peft_model, kwargs["state_dict"])
        else:
            versions, snapshot = peft_model.__dict__.get(_SNAPSHOT_ATTR, (None, None))
            current = versions == _parameter_versions(peft_model)
            kwargs["state_dict"] = snapshot if current else _gathered_for_save(peft_model, "PeftModel.save_pretrained")
        kwargs.setdefault("is_main_process", _is_main_process())
    return original(peft_model, save_directory, *args, **kwargs)


def _load_adapter(original, peft_model, *args, **kwargs):
    """`PeftModel.load_adapter` (and so `PeftModel.from_pretrained`): an adapter of all experts is cut to this rank's."""
    _register_slicing_hooks(peft_model)
    return original(peft_model, *args, **kwargs)


_PEFT_HOOKS = {"save_pretrained": _save_pretrained, "load_adapter": _load_adapter}


def install_peft_hooks() -> None:
    """Wrap `PeftModel.save_pretrained` and `load_adapter` once peft is imported (now, if it is); idempotent."""
    wrap_when_imported("peft.peft_model", "PeftModel", _PEFT_HOOKS)


def uninstall_peft_hooks() -> None:
    """Put peft's own methods back (or forget the wrapping when peft is not imported yet)."""
    unwrap_when_imported("peft.peft_model", "PeftModel", _PEFT_HOOKS)


def has_distributed_expert_adapters(model: nn.Module) -> bool:
    """True when `model` carries LoRA factors on the experts of an EP (distributed) `OccultMoE`."""
    return any(module.ep.is_distributed for _, module, _, _ in _expert_adapter_factors(model))


__all__ = [
    "gathered_adapter_state_dict",
    "get_peft_model",
    "has_distributed_expert_adapters",
    "install_peft_hooks",
    "load_peft_model",
    "prepare_peft_model",
    "save_peft_model",
    "snapshot_adapters",
    "uninstall_peft_hooks",
]
