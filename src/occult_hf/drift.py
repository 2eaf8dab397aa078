"""Routing drift: what a change of routing costs a placement planned on the old routing.

`profile_drift(profile_a, profile_b, D)` plans placements on A and on B and measures both (and
contiguous placement) on B, per shared layer, beside the co-activation rank correlation of A and B
(`metrics.coactivation_spearman`). A plan's replicas count where B has a token sample: its CT is the one the
replica rule serves (`metrics.pair_devices`); pair counts say nothing of which home serves a pair, so the cut is
the primary map's, as `metrics.evaluate_layer` reports it. It runs the planners, which import `metrics`, so it lives in
its own module above both (docs/design.md §8 defines drift).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .metrics import coactivation_spearman, pair_devices, routing_cost, served_ct
from .placement import Placement, plan_placement
from .profile import RoutingProfile
from .profile.stats import LayerRouting


@dataclass(frozen=True)
class LayerDrift:
    """Drift of one layer from profile A (planned on) to profile B (measured on).

    Attributes:
        spearman: rank correlation of the co-activation counts of A and B.
        cost_name: "ct" (mean CT on B's sample) or "cut" (split pairs per token on B).
        transferred: cost on B of the placement planned on A (its replicas included).
        native: cost on B of the placement planned on B (what re-profiling would give).
        contiguous: cost on B of contiguous placement (what placement gives at all).
    """

    spearman: float
    cost_name: str
    transferred: float
    native: float
    contiguous: float


def profile_drift(
    profile_a: RoutingProfile,
    profile_b: RoutingProfile,
    num_devices: int,
    method: str = "refined",
    progress: bool = False,
    **options: Any,
) -> dict[int, LayerDrift]:
    """Per shared layer: co-activation Spearman of A vs B, and B's cost of placements planned on A and on B."""
    for field in ("num_experts", "top_k", "model_type"):  # drift is one model's routing at two times
        a, b = getattr(profile_a, field), getattr(profile_b, field)
        if a != b and not (field == "model_type" and None in (a, b)):
            raise ValueError(f"profiles differ in {field}: {a!r} vs {b!r}: drift compares one model's routing on two token sets")
    shared = sorted(set(profile_a.layers) & set(profile_b.layers))
    if not shared:
        raise ValueError(f"profiles share no layer: {sorted(profile_a.layers)} vs {sorted(profile_b.layers)}")
    for name, profile in (("A", profile_a), ("B", profile_b)):
        _check_has_tokens(name, profile, shared)
    planned_a = plan_placement(profile_a, num_devices, method, layers=shared, progress=progress, **options)
    planned_b = plan_placement(profile_b, num_devices, method, layers=shared, progress=progress, **options)
    contiguous = Placement.contiguous(profile_a.num_experts, num_devices, shared)
    result = {}
    for layer in shared:
        routing_b = profile_b.layer(layer)
        costs = {
            name: _cost_on(routing_b, p, layer)
            for name, p in (("transferred", planned_a), ("native", planned_b), ("contiguous", contiguous))
        }
        result[layer] = LayerDrift(
            spearman=coactivation_spearman(profile_a.layer(layer).coactivation, routing_b.coactivation),
            cost_name=costs["native"][0],
            **{name: value for name, (_, value) in costs.items()},
        )
    return result


def _check_has_tokens(name: str, profile: RoutingProfile, layers: list[int]) -> None:
    """Raise unless every layer of `profile` that drift compares counts tokens: a plan on none has no loads to
    balance, and the planners' error would not say which profile is empty."""
    empty = [layer for layer in layers if int(profile.layer(layer).token_count) < 1]
    if empty:
        where = profile.path or profile.meta.get("source") or "given"
        raise ValueError(
            f"profile_drift: profile {name} ({where}) holds no tokens in layers {empty}: drift compares routing "
            f"observed at two times; profile a window that saw traffic"
        )


def _cost_on(routing: LayerRouting, placement: Placement, layer: int) -> tuple[str, float]:
    """`metrics.routing_cost` of the placement at `layer`, with its replicas served by the replica rule where the
    routing has a token sample (the cost the runtime pays, not that of its primary map)."""
    device_of_E = np.asarray(placement.device_of(layer))
    sample = routing.topk_sample
    if layer in placement.replicas and sample is not None and len(sample):
        devices_Nk = pair_devices(sample, device_of_E, placement.num_devices, placement.home_table(layer))
        return "ct", served_ct(devices_Nk, placement.num_devices)
    return routing_cost(routing, device_of_E, placement.num_devices)


__all__ = ["LayerDrift", "profile_drift"]
