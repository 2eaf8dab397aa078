"""Placement planners: a registry of named methods and `plan_placement` over a routing profile.

A planner is a per-layer function on plain arrays,

    plan_layer(coactivation_EE, expert_counts_E, topk_sample_Nk | None, num_devices, options) -> device_of_E

plus a frozen options dataclass (validated in `__post_init__`). Keeping the core on arrays makes
each planner testable without a profile; `plan_placement` runs it over a profile's layers with a
progress bar and returns a `Placement`. Planners register themselves with `register_planner`.

Shape legend: E routed experts, D devices, N sampled tokens, k experts per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from ..metrics import check_square, check_topk_ids
from .placement import Placement

if TYPE_CHECKING:
    from ..profile import RoutingProfile

PlanLayer = Callable[[np.ndarray, np.ndarray, "np.ndarray | None", int, Any], np.ndarray]


@dataclass(frozen=True)
class NoOptions:
    """Options of a planner that takes none."""


@dataclass(frozen=True)
class PlannerSpec:
    """A registered planner: its name, per-layer function, options class and one-line description."""

    name: str
    plan_layer: PlanLayer
    options_class: type
    description: str

    def make_options(self, **options: Any):
        """The planner's options dataclass from keyword arguments; unknown names are a clear error."""
        valid = [f.name for f in dataclasses.fields(self.options_class)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"placement method {self.name!r} has no option(s) {unknown}; its options are {valid or 'none'}"
            )
        return self.options_class(**options)


_PLANNERS: dict[str, PlannerSpec] = {}


def register_planner(name: str, options_class: type = NoOptions, description: str = "") -> Callable[[PlanLayer], PlanLayer]:
    """Decorator registering `plan_layer` under a unique lowercase `name`."""
    if not isinstance(name, str) or not name or name != name.lower() or not name.replace("_", "").isalnum():
        raise ValueError(f"placement method names are lowercase letters, digits and '_', got {name!r}")
    if name in _PLANNERS:
        raise ValueError(f"placement method {name!r} is already registered; registered methods: {sorted(_PLANNERS)}")

    def decorate(plan_layer: PlanLayer) -> PlanLayer:
        _PLANNERS[name] = PlannerSpec(name, plan_layer, options_class, description)
        return plan_layer

    return decorate


def available_planners() -> list[str]:
    """Registered placement method names, sorted."""
    return sorted(_PLANNERS)


def get_planner(name: str) -> PlannerSpec:
    try:
        return _PLANNERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown placement method {name!r}; valid methods: {available_planners()}") from None


# ----- shared helpers of the planners ----------------------------------------------------------
def balanced_capacities(num_experts: int, num_devices: int) -> np.ndarray:
    """`[D]` experts per device, differing by at most one: the first `E % D` devices hold one more."""
    check_device_count(num_experts, num_devices)
    capacities = np.full(num_devices, num_experts // num_devices, dtype=np.int64)
    capacities[: num_experts % num_devices] += 1
    return capacities


def check_device_count(num_experts: int, num_devices: int) -> None:
    if not isinstance(num_devices, (int, np.integer)) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if num_devices > num_experts:
        raise ValueError(
            f"num_devices ({num_devices}) exceeds num_experts ({num_experts}): some device would hold no expert"
        )


def check_layer_inputs(
    coactivation_EE: np.ndarray,
    expert_counts_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Validate a planner's inputs; return int64 co-activation, float64 counts and int64 sample (or None)."""
    counts = np.asarray(expert_counts_E)
    if counts.ndim != 1 or len(counts) == 0:
        raise ValueError(f"expert_counts must be a non-empty [E] array, got shape {list(counts.shape)}")
    num_experts = len(counts)
    if (counts < 0).any():
        raise ValueError("expert_counts must be non-negative")
    coactivation = np.asarray(check_square(coactivation_EE, num_experts), dtype=np.int64)
    if (coactivation < 0).any() or not (coactivation == coactivation.T).all():
        raise ValueError("coactivation must be symmetric with non-negative counts")
    check_device_count(num_experts, num_devices)
    sample = None
    if topk_sample_Nk is not None:
        sample = check_topk_ids(topk_sample_Nk, num_experts, name="topk_sample")
        if len(sample) == 0:
            sample = None
    return coactivation, counts.astype(np.float64), sample


# ----- over a profile --------------------------------------------------------------------------
def plan_placement(
    profile: "RoutingProfile",
    num_devices: int,
    method: str = "refined",
    *,
    layers: Iterable[int] | None = None,
    progress: bool = True,
    **options: Any,
) -> Placement:
    """Plan a placement for every layer of `profile` (or `layers`) with the named method.

    Args:
        profile: a `RoutingProfile` (co-activation, expert counts and, when present, the top-k sample).
        num_devices: `D`, devices of the expert-parallel group (1 <= D <= E).
        method: a registered planner name (`available_planners()`); default "refined".
        layers: the profile layers to plan (default: all).
        progress: show a tqdm bar over layers.
        **options: the planner's options (e.g. `max_load_ratio=1.1, seed=0` for "refined").

    `placement.meta["profile_metrics"]` records, per layer, how the placement scores on the
    profile it was planned on (`_layer_score`): CT or cut, and the slowest device's load and rows,
    not only means.
    """
    from tqdm.auto import tqdm

    from ..metrics import evaluate_layer

    spec = get_planner(method)
    planner_options = spec.make_options(**options)
    check_device_count(profile.num_experts, num_devices)
    chosen = sorted(profile.layers) if layers is None else [int(l) for l in layers]
    maps, scores = {}, {}
    bar = tqdm(chosen, desc=f"placement {method} D={num_devices}", unit="layer", disable=not progress)
    for layer in bar:
        routing = profile.layer(layer)
        device_of_E = np.asarray(
            spec.plan_layer(routing.coactivation, routing.expert_counts, routing.topk_sample, num_devices, planner_options)
        )
        maps[layer] = device_of_E.tolist()
        scores[str(layer)] = _layer_score(evaluate_layer(routing, device_of_E, num_devices, profile.top_k))
        bar.set_postfix({k: v for k, v in scores[str(layer)].items() if k in ("ct", "cut_per_token", "balance")})
    meta = {
        "method": method,
        "options": dataclasses.asdict(planner_options),
        "profile_source": profile.meta.get("source"),
        "model_type": profile.model_type,
        "profile_metrics": scores,
    }
    return Placement(profile.num_experts, int(num_devices), maps, meta)


def _layer_score(m) -> dict[str, float | int | bool | None]:
    """The JSON-safe summary of a `metrics.LayerMetrics` kept in a placement's meta."""
    return {
        "ct": None if m.ct is None else round(m.ct, 4),
        "ct_lower": m.ct_lower,
        "cut_per_token": round(m.cut_per_token, 4),
        "balance": round(m.balance, 4),
        "balance_floor": round(m.balance_floor, 4),
        "balance_bound_loose": bool(m.balance_floor > 1.0 + 1e-9),
        "slowest_device_load": float(m.load_D.max()),
        "max_received_rows": m.max_received_rows,
    }


__all__ = [
    "NoOptions",
    "PlannerSpec",
    "available_planners",
    "balanced_capacities",
    "check_layer_inputs",
    "get_planner",
    "plan_placement",
    "register_planner",
]
