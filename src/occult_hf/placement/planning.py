"""`plan_placement`: plan with a registered method and, on request, estimate the plan held out.

The entry point above the registry (`registry.plan_profiles`, which plans) and the validation
(`validation.cross_validate`, which plans on folds with `plan_profiles`), so that neither of those
two imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from .placement import Placement
from .registry import plan_profiles, pool_profiles
from .validation import cross_validate as run_cross_validation

if TYPE_CHECKING:
    from ..profile import RoutingProfile


def plan_placement(
    profile: "RoutingProfile | list[RoutingProfile] | dict[str, RoutingProfile]",
    num_devices: int,
    method: str = "refined",
    *,
    layers: Iterable[int] | None = None,
    progress: bool = True,
    cross_validate: int = 0,
    devices_per_node: int | None = None,
    **options: Any,
) -> Placement:
    """Plan a placement for every layer of `profile` (or `layers`) with the named method.

    Args:
        profile, num_devices, method, layers, progress, devices_per_node, **options: as
            `registry.plan_profiles` (one profile or several, `D`, a registered planner name, the layers to
            plan, a tqdm bar, `G` devices per node (node-aware planning: CT_node first, then CT), the
            planner's options such as `max_load_ratio=1.1, seed=0` for "refined").
        cross_validate: K >= 2: also estimate the held-out figures by K-fold cross-validation on
            the profile's sample (`placement.validation.cross_validate`), kept in
            `meta["expected_held_out"]`; 0: skip.

    `placement.meta["profile_metrics"]` records, per layer, how the placement scores on the
    profile it was planned on; with several profiles `meta["worst_profile"]` adds each layer's
    worst profile and its balance (`registry.plan_profiles`).
    """
    placement = plan_profiles(
        profile, num_devices, method, layers=layers, progress=progress, devices_per_node=devices_per_node, **options
    )
    if cross_validate:
        _, _, items = pool_profiles(profile)
        placement.meta["expected_held_out"] = run_cross_validation(
            items, num_devices, method, folds=cross_validate, layers=list(placement.layers),
            devices_per_node=devices_per_node, **options,
        )  # fmt: skip
    return placement


__all__ = ["plan_placement"]
