"""Apply re-planned replicas to a running model: the runtime half of `occult replan`.

`placement.rebalance.replan_replicas` re-chooses a deployed placement's redundant copies from recent
routing (an unseen domain's hot experts), keeping every primary home. `apply_replicas` puts such a
placement into a model that occult_hf already runs: each layer's new copies are copied from their
primary holders (`new_homes`, through `distributed.collectives.copies_from_primaries`), and once every
layer's are made its weights, layout, dispatcher and replica gradient bookkeeping are rebuilt
(`rehome_layer`), and the model's saved setup (`config.occult_config`) names the new placement. No expert
moves its primary home, so no rank loses weights it alone held, and the outputs do not change: only
which copy serves a pair does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..dispatch import build_dispatcher
from ..distributed.agreement import announce_failure
from ..distributed.collectives import copies_from_primaries
from ..experts import LocalExperts
from ..layout import LayerLayout
from ..moe import OccultMoE
from ..placement import Placement
from ..replicas.gradients import ReplicaGradients
from .checkpointing import check_model_ranks_agree
from .state import BLOCKS, OccultState, state_of


def apply_replicas(model: nn.Module, placement: Placement) -> nn.Module:
    """Give the running occult model `model` the replicas of `placement`; return `model`.

    `placement` must have the model's experts, devices, layers and primary homes (only the redundant
    copies differ: what `replan_replicas` returns). Collective under expert parallelism: every rank calls
    it with the same placement (checked first, like `apply_occult`). Not with collaboration pruning
    (its device walk was built for the old homes). The expert parameters become new tensors: rebuild an
    optimizer made before.
    """
    state = state_of(model, BLOCKS)
    try:
        _check_replicas_only(state, placement)
    except Exception as error:  # the other ranks are at the agreement below: tell them instead of letting them wait
        if state.ep.is_distributed:
            announce_failure(error, "apply_replicas", state.ep.group)
        raise
    new_state = replace(state, occult_config=replace(state.occult_config, placement=placement))
    check_model_ranks_agree(model, new_state, "apply_replicas")  # a no-op in one process
    modules = [model.get_submodule(path) for path in state.block_paths]
    homes = [new_homes(module, placement) for module in modules]  # every collective copy before any layer changes
    for module, (layout, weights) in zip(modules, homes):
        rehome_layer(module, layout, weights)
    state.occult_config = new_state.occult_config
    state.snapshot, state.snapshot_versions = None, None
    model.config.occult_config = state.occult_config.to_dict()
    return model


def _check_replicas_only(state: OccultState, placement: Placement) -> None:
    """Raise unless `placement` fits the model of `state` and differs from its placement only in the redundant
    copies, without pruning (whose device walk was built for the old homes)."""
    old = state.placement
    if state.occult_config.prune is not None:
        raise ValueError(
            f"apply_replicas: the model runs collaboration pruning (prune={state.occult_config.prune!r}), whose device "
            f"walk was built for the old homes; apply the placement with apply_occult instead"
        )
    if (placement.num_experts, placement.num_devices) != (old.num_experts, old.num_devices):
        raise ValueError(
            f"apply_replicas: the placement is for num_experts={placement.num_experts}, num_devices={placement.num_devices}; "
            f"the model runs num_experts={old.num_experts}, num_devices={old.num_devices}"
        )
    placement.validate_for(old.num_experts, list(old.layers), old.num_devices)
    moved = [layer for layer in old.layers if list(placement.device_of(layer)) != list(old.device_of(layer))]
    if moved:
        raise ValueError(
            f"apply_replicas: the primary homes of layers {moved} differ from the model's: only the redundant copies may "
            f"move (placement.rebalance.replan_replicas keeps the primaries); re-apply with apply_occult to move primaries"
        )


@torch.no_grad()
def new_homes(module: OccultMoE, placement: Placement) -> tuple[LayerLayout, dict[int, list[torch.Tensor]] | None]:
    """`(layout, copies)` of one layer under `placement`, whose primary homes must be the layer's; the layer is not
    changed. Collective under EP: each rank's new slots are its homes under `placement`, and `copies` holds the rows
    of the replicated experts among them, from their primary holders (`copies_from_primaries`); None in one process,
    where the layer holds every expert already."""
    layer = module.layer_idx
    if placement.device_of(layer) != module.layout.primary_devices():
        raise ValueError(
            f"layer {layer}: the new placement's primary homes {placement.device_of(layer)} differ from the layer's "
            f"{module.layout.primary_devices()}: only the redundant copies may move (replan_replicas keeps primaries)"
        )
    experts = module.experts
    if not isinstance(experts, LocalExperts):
        raise ValueError(f"layer {layer}: re-homing replicas does not support adapters (PEFT) on the routed experts")
    ep = module.ep
    layout = placement.layout(layer, ep.rank if ep.is_distributed else None).to(experts.gate_up_proj.device)
    if not ep.is_distributed:
        return layout, None
    old_ids, new_ids = module.layout.expert_ids_L.tolist(), layout.expert_ids_L.tolist()
    replicated = [e for e, homes in enumerate(placement.homes(layer)) if len(homes) > 1]
    params = (experts.gate_up_proj, experts.down_proj)
    return layout, copies_from_primaries(params, old_ids, new_ids, replicated, layout.primary_devices(), ep.group, ep.rank, layer)


def rehome_layer(module: OccultMoE, layout: LayerLayout, copies: dict[int, list[torch.Tensor]] | None) -> None:
    """Give one layer what `new_homes` made: its expert weights in the new slots (its own rows and `copies`; new
    parameters: an optimizer built before must be rebuilt), layout, replica gradient bookkeeping and dispatcher.
    Local: no rank waits on another here."""
    experts = module.experts
    if copies is not None:
        old_ids, new_ids = module.layout.expert_ids_L.tolist(), layout.expert_ids_L.tolist()
        params = (experts.gate_up_proj, experts.down_proj)
        weights = [param.new_empty((len(new_ids), *param.shape[1:])) for param in params]
        for slot, expert in enumerate(new_ids):
            for index, (weight, param) in enumerate(zip(weights, params)):
                weight[slot] = copies[expert][index] if expert in copies else param[old_ids.index(expert)]
        experts.gate_up_proj, experts.down_proj = (
            nn.Parameter(weight, requires_grad=param.requires_grad) for weight, param in zip(weights, params)
        )
        experts.expert_ids = layout.expert_ids_L
        module.replica_grads = (
            ReplicaGradients(layout, (experts.gate_up_proj, experts.down_proj), module._grad_norm.queue)
            if layout.num_replicated
            else None
        )
    module.layout = layout
    module.dispatcher = build_dispatcher(module.settings, module.ep, layout, experts.gate_up_proj.device)


__all__ = ["apply_replicas", "new_homes", "rehome_layer"]
