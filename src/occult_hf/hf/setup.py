"""The set-up both front ends share: resolve the config, agree across the ranks, build the per-layer parts.

`hf.apply.apply_occult` (the model's MoE blocks replaced by `OccultMoE`) and
`hf.native_ep.apply_occult_ep` (transformers' own expert parallelism) differ only in what is
transformers' own: where the blocks and the EP group come from, and what is put into the model. Both:

1. resolve the config on this rank (`resolve_config`, `resolve_placement`);
2. meet the other ranks in one agreement check (`agree`): a rank whose own checks raised tells the others,
   which raise at once naming it instead of waiting for it until the process group's timeout, and ranks
   whose setups differ all raise `EPConfigMismatchError`, before anything changes;
3. take each layer's `LayerLayout` from the placement and build its pruner (`build_pruners`);
4. keep what they did in one `OccultState` on the model (`hf.state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch.distributed as dist
from torch import nn

from ..config import OccultConfig
from ..distributed.agreement import check_agreement, fail_together, save_timeout_s
from ..placement import Placement
from ..layout import LayerLayout
from ..pruning import CollaborationPruner, build_pruner, load_pruning_profile, needs_similarity

if TYPE_CHECKING:
    from ..profile import RoutingProfile

Resolved = TypeVar("Resolved")


def resolve_config(occult_config: OccultConfig | dict | str | None) -> OccultConfig:
    """An `OccultConfig` from what a user passes: a config, a dict, a JSON path, or None (the defaults)."""
    return OccultConfig.coerce(OccultConfig() if occult_config is None else occult_config)


def resolve_placement(placement: Placement | None, num_experts: int, num_devices: int, layers: list[int]) -> Placement:
    """The placement a model runs (`Placement.from_setting(OccultConfig.placement)`; None: contiguous), checked
    against the model."""
    if placement is None:
        return Placement.contiguous(num_experts, num_devices, layers)
    placement.validate_for(num_experts, layers, num_devices)
    return placement


def agree(
    operation: str,
    resolve: Callable[[], Resolved],
    process_group,
    make_group: Callable[[], Any],
    setup_of: Callable[[Resolved], dict[str, Any]],
) -> tuple[Resolved, Any]:
    """`(resolve(), agreement group)`: this rank's own checks, then (several ranks) the agreement check.

    `process_group` is the ranks' group (None or one rank: no agreement, the group returned is None);
    `make_group()` makes the gloo group the ranks agree on (collective: every rank calls it exactly once
    here, whether its own checks passed or not, so a failing rank meets the others in the same group);
    `setup_of(resolved)` the facts the ranks must share (`distributed.agreement.effective_setup`).
    """
    distributed = process_group is not None and dist.get_world_size(process_group) > 1
    try:
        resolved = resolve()
    except Exception as error:
        if not distributed:
            raise
        fail_together(error, make_group(), operation, save_timeout_s())
    if not distributed:
        return resolved, None
    group = make_group()
    check_agreement(setup_of(resolved), group, operation, save_timeout_s())
    return resolved, group


def build_pruners(
    config: OccultConfig, adapter, model: nn.Module, layouts: list[LayerLayout], top_k: int
) -> tuple[list[CollaborationPruner | None], RoutingProfile | None]:
    """Each layer's pruner (all None in exact mode), and the similarity profile they were built from (None
    unless similarity pruning), which must describe exactly the model's MoE layers."""
    if config.prune is None:
        return [None] * len(layouts), None
    profile = None
    if needs_similarity(config.prune):
        profile = load_pruning_profile(config.profile)
        profile.check_compatible(model)
    return [build_pruner(config, adapter, layout, top_k=top_k, profile=profile) for layout in layouts], profile


__all__ = ["agree", "build_pruners", "resolve_config", "resolve_placement"]
