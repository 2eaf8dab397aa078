"""A transformers MoE block into an `OccultMoE` and back: where the experts' weights come from and go.

Shape legend: E routed experts, L local experts, H hidden, I expert width.

`build_occult_block` gives the new block this rank's experts (`[L, 2I, H]`, `[L, H, I]` in the slot order
of its `LayerLayout`): in one process the block's own fused parameters when the family stores them fused (nothing
is copied); under EP the rows of its experts, or what `hf.loading` read for this rank alone when the full
experts were never allocated (meta). Building changes nothing of `block`, so `apply_occult` builds every block
before it swaps any in; then `retire_original_block` empties the original block's routed-expert parameters that
the new one does not share (their storage released) until `restore_block` refills them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import OccultConfig
from ..dispatch import DispatchSettings, ExpertParallelGroup
from ..distributed.collectives import GradNormCarrier
from ..experts import LocalExperts
from ..moe import OccultMoE
from ..layout import LayerLayout
from ..pruning import CollaborationPruner
from ..utils.logging import get_logger

logger = get_logger(__name__)

#: where `hf.loading` leaves a block's local experts, read per rank: (expert ids, gate_up [L,2I,H], down [L,H,I])
LOADED_EXPERTS_ATTR = "_occult_loaded_experts"


def build_occult_block(
    block: nn.Module,
    adapter,
    layout: LayerLayout,
    config: OccultConfig,
    ep: ExpertParallelGroup,
    *,
    top_k: int,
    pruner: CollaborationPruner | None = None,
    grad_norm: GradNormCarrier | None = None,
) -> OccultMoE:
    """The `OccultMoE` replacing `block` (layer `layout.layer`) for this rank, with the settings of `config`."""
    _warn_of_hooks_left_behind(block, adapter, layout.layer)
    gate_up_E2IH, down_EHI = adapter.expert_weights(block)
    if gate_up_E2IH.shape[0] != layout.num_experts:
        raise ValueError(
            f"layer {layout.layer} has {gate_up_E2IH.shape[0]} routed experts but the placement is for "
            f"num_experts={layout.num_experts}"
        )
    expert_ids = layout.expert_ids_L.tolist()
    loaded = block.__dict__.get(LOADED_EXPERTS_ATTR)  # this rank's experts, read per rank at load
    if gate_up_E2IH.is_meta:
        if loaded is None or loaded[0] != expert_ids:
            raise ValueError(
                f"layer {layout.layer}: the routed experts are on the meta device and the experts read at load "
                f"({None if loaded is None else loaded[0]}) are not this rank's {expert_ids}: load with "
                f"from_pretrained(..., occult_config=<the same OccultConfig>) on every rank"
            )
        gate_up_L2IH = nn.Parameter(loaded[1], requires_grad=gate_up_E2IH.requires_grad)
        down_LHI = nn.Parameter(loaded[2], requires_grad=down_EHI.requires_grad)
    else:
        gate_up_L2IH = _local_parameter(gate_up_E2IH, expert_ids)
        down_LHI = _local_parameter(down_EHI, expert_ids)
    layout = layout.to(gate_up_L2IH.device)
    experts = LocalExperts(
        gate_up_L2IH,
        down_LHI,
        layout.expert_ids_L,
        adapter.act_fn(block),
        backend=config.expert_backend,
        deterministic=config.deterministic,
        grad_scale=1.0 / ep.num_devices if ep.is_distributed else 1.0,
        replaces=adapter.experts_module(block),
    )
    settings = DispatchSettings.of(config, top_k)
    return OccultMoE(block, adapter, layout, experts, settings, ep, pruner, grad_norm)


def check_experts_resident(adapter, blocks) -> None:
    """Refuse, before anything changes, MoE blocks whose routed experts are not in memory and were not read for this
    rank at load: accelerate's offload (`device_map` with "disk", or a CPU offload of a device map) leaves them on the
    meta device and loads them per forward in hooks on the block, which the new block's forward does not run."""
    for layer, path, block in blocks:
        if adapter.expert_weights(block)[0].is_meta and LOADED_EXPERTS_ATTR not in block.__dict__:
            offloaded = any(hasattr(m, "_hf_hook") for m in (block, adapter.experts_module(block)))
            raise ValueError(
                f"layer {layer} ({path}): the routed experts are not in memory (on the meta device"
                + (", offloaded by accelerate's device_map" if offloaded else "")
                + "); occult_hf's blocks compute with the experts' own weights, so the MoE layers must be resident: "
                "load with a device_map that keeps them on one device (device_map='cpu', {'': 'cuda:0'}) or give "
                "that device enough max_memory"
            )


def _warn_of_hooks_left_behind(block: nn.Module, adapter, layer: int) -> None:
    """A warning naming the forward hooks (and accelerate's `_hf_hook`) on `block` or its experts module: the new block
    routes with the block's router and computes its own experts, so neither module's forward runs, nor its hooks."""
    experts = adapter.experts_module(block)
    modules = (("the block", block), ("its experts module", experts))
    found = [
        f"{len(hooks)} {kind} on {what}"
        for what, module in modules
        for kind, hooks in (("forward hook(s)", module._forward_hooks), ("forward pre-hook(s)", module._forward_pre_hooks))
        if hooks
    ] + [f"accelerate's hook on {what}" for what, module in modules if hasattr(module, "_hf_hook")]
    if found:
        logger.warning(
            "layer %d (%s): %s will not run: occult_hf's block replaces it (the router's hooks still run); register "
            "them on the OccultMoE at the same path after apply_occult", layer, type(block).__name__, ", ".join(found),
        )


def place_full_experts(module: OccultMoE, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor) -> dict[str, torch.Tensor]:
    """The vanilla state-dict entries (keys relative to the block) of the routed experts, given the
    full `[E, 2I, H]` / `[E, H, I]` weights in original expert order."""
    return module.adapter.expert_state_dict(module.original_block, gate_up_E2IH, down_EHI)


@torch.no_grad()
def restore_block(module: OccultMoE, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor) -> nn.Module:
    """The original block of `module` with the given full expert weights written back into its own parameters, which
    train as the local experts did (frozen or unfrozen since `apply_occult`: the flags the block had then are stale)."""
    block = module.original_block
    local = module.local_experts
    trains = local.gate_up_proj.requires_grad or local.down_proj.requires_grad
    for key, value in place_full_experts(module, gate_up_E2IH, down_EHI).items():
        param = block.get_parameter(key)
        if param is value:
            continue
        new = value.detach().to(device=local.gate_up_proj.device, dtype=param.dtype).clone()
        if param.is_meta:  # read per rank at load (`hf.loading`): never allocated, so a new parameter
            owner_path, _, name = key.rpartition(".")
            setattr(block.get_submodule(owner_path), name, nn.Parameter(new, requires_grad=trains))
        else:
            param.data = new
            param.requires_grad_(trains)
    return block


def retire_original_block(module: OccultMoE) -> None:
    """Once `module` is in the model: drop the experts read for it at load from its original block, and empty the
    block's routed-expert parameters that `module.experts` does not share."""
    block = module.original_block
    block.__dict__.pop(LOADED_EXPERTS_ATTR, None)
    shared = {id(module.experts.gate_up_proj), id(module.experts.down_proj)}
    for key in place_full_experts(module, *module.adapter.expert_weights(block)):
        param = block.get_parameter(key)
        if id(param) not in shared:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _local_parameter(weight_E: torch.Tensor, expert_ids: list[int]) -> nn.Parameter:
    """This rank's experts of a `[E, ...]` expert weight as a parameter; the weight itself when it is
    already a parameter holding exactly these experts in this order (one process, fused layout)."""
    if isinstance(weight_E, nn.Parameter) and expert_ids == list(range(weight_E.shape[0])):
        return weight_E
    index = torch.tensor(expert_ids, dtype=torch.int64, device=weight_E.device)
    return nn.Parameter(weight_E.detach().index_select(0, index).clone(), requires_grad=weight_E.requires_grad)


__all__ = ["LOADED_EXPERTS_ATTR", "build_occult_block", "check_experts_resident", "place_full_experts", "restore_block", "retire_original_block"]
