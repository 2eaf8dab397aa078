"""Apply re-planned replicas to a running model: the runtime half of `occult replan`.

`placement.rebalance.replan_replicas` re-chooses a deployed placement's redundant copies from recent
routing (an unseen domain's hot experts), keeping every primary home. `apply_replicas` puts such a
placement into a model that occult_hf already runs: each layer's new copies are copied from their
primary holders (`OccultMoE.set_replicas`), the dispatchers and the replica gradient bookkeeping are
rebuilt, and the model's saved setup (`config.occult_config`) names the new placement. No expert
moves its primary home, so no rank loses weights it alone held, and the outputs do not change: only
which copy serves a pair does.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .state import state_of
from .checkpointing import check_model_ranks_agree
from ..placement import Placement


def apply_replicas(model: nn.Module, placement: Placement) -> nn.Module:
    """Give the running occult model `model` the replicas of `placement`; return `model`.

    `placement` must have the model's experts, devices, layers and primary homes (only the redundant
    copies differ: what `replan_replicas` returns). Collective under expert parallelism: every rank calls
    it with the same placement (checked first, like `apply_occult`). Not with collaboration pruning
    (its device walk was built for the old homes). The expert parameters become new tensors: rebuild an
    optimizer made before.
    """
    state = state_of(model)
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
    new_state = replace(state, occult_config=replace(state.occult_config, placement=placement))
    if state.ep.is_distributed:
        check_model_ranks_agree(model, new_state, "apply_replicas")
    for path in state.block_paths:
        model.get_submodule(path).set_replicas(placement)
    state.occult_config = new_state.occult_config
    state.snapshot, state.snapshot_versions = None, None
    model.config.occult_config = state.occult_config.to_dict()
    return model


__all__ = ["apply_replicas"]
