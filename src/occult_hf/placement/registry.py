"""Placement planners: a registry of named methods and `plan_profiles` over a routing profile.

A planner is a per-layer function on plain arrays,

    plan_layer(coactivation_EE, expert_counts_E, topk_sample_Nk | None, num_devices, options) -> device_of_E
                                                                        (or a plan with device_of_E, replicas)

plus a frozen options dataclass (validated in `__post_init__`). Keeping the core on arrays makes
each planner testable without a profile; `plan_profiles` runs it over a profile's layers with a
progress bar and returns a `Placement` (`planning.plan_placement`, the entry point, adds the
optional held-out estimate). Planners register themselves with `register_planner`.

Shape legend: E routed experts, D devices, N sampled tokens, k experts per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from ..utils.checks import check_num_devices, check_square, check_topk_ids, did_you_mean
from ..metrics import evaluate_layer
from ..registry import Registry
from ..replicas.routing import home_table_from
from .placement import Placement, check_devices_per_node

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
    multi_profile: bool = False

    @property
    def node_aware(self) -> bool:
        """Whether the planner takes the cluster's devices per node (its options have `devices_per_node`)."""
        return any(f.name == "devices_per_node" for f in dataclasses.fields(self.options_class))

    def make_options(self, **options: Any):
        """The planner's options dataclass from keyword arguments; unknown names are a clear error."""
        valid = [f.name for f in dataclasses.fields(self.options_class)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"placement method {self.name!r} has no option(s) {unknown}{did_you_mean(unknown, valid)}; "
                f"its options are {valid or 'none'}"
            )
        return self.options_class(**options)


#: the placement methods (`plan_placement(method=...)`, `occult place --method`)
PLANNERS: Registry[PlannerSpec] = Registry("placement method", "the placement method")


def register_planner(
    name: str, options_class: type = NoOptions, description: str = "", multi_profile: bool = False
) -> Callable[[PlanLayer], PlanLayer]:
    """Decorator registering `plan_layer` under a unique lowercase `name`.

    `plan_layer` returns the `[E]` device map, or an object with `device_of_E` (and optionally
    `replicas` `{expert: [extra devices]}`, `slots_per_device` and the load-aware rule's `pin_slack`, kept
    for layers with replicas). `multi_profile`: it accepts
    `membership_PN` / `counts_PE` keywords to bound each of several profiles."""
    if not isinstance(name, str) or name != name.lower() or not name.replace("_", "").isalnum():
        raise ValueError(f"placement method names are lowercase letters, digits and '_', got {name!r}")
    if name in PLANNERS:  # refused when the decorator is made, before any planner code runs
        raise ValueError(f"placement method {name!r} is already registered; registered methods: {list(PLANNERS.names())}")

    def decorate(plan_layer: PlanLayer) -> PlanLayer:
        PLANNERS.register(name, PlannerSpec(name, plan_layer, options_class, description, multi_profile))
        return plan_layer

    return decorate


def available_planners() -> list[str]:
    """Registered placement method names, sorted."""
    return list(PLANNERS.names())


def get_planner(name: str) -> PlannerSpec:
    return PLANNERS.get(name)


# ----- shared helpers of the planners ----------------------------------------------------------
def balanced_capacities(num_experts: int, num_devices: int) -> np.ndarray:
    """`[D]` experts per device, differing by at most one: the first `E % D` devices hold one more."""
    check_device_count(num_experts, num_devices)
    capacities = np.full(num_devices, num_experts // num_devices, dtype=np.int64)
    capacities[: num_experts % num_devices] += 1
    return capacities


def check_device_count(num_experts: int, num_devices: int) -> None:
    check_num_devices(num_devices)
    if num_devices > num_experts:
        raise ValueError(
            f"num_devices ({num_devices}) exceeds num_experts ({num_experts}): some device would hold no primary expert "
            f"(every device needs one; replicas, which could fill the others, do not count)"
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
def pool_profiles(profiles) -> tuple["RoutingProfile", list[str], list["RoutingProfile"]]:
    """One profile or several (a sequence, or a dict by name) -> `(pooled, names, profiles)`.

    The pooled profile sums co-activation, counts and token counts and concatenates the samples
    (kept only when every profile has one) over the layers all profiles share.
    """
    from ..profile import LayerRouting, RoutingProfile
    from ..profile.routing_profile import check_same_model

    if isinstance(profiles, RoutingProfile):
        return profiles, ["profile"], [profiles]
    if isinstance(profiles, dict):
        names, items = [str(n) for n in profiles], list(profiles.values())
    else:
        items = list(profiles)
        names = [str(p.meta.get("source") or f"profile {i}") for i, p in enumerate(items)]
        if len(set(names)) < len(names):  # profiles of one source: told apart by their place in the list
            names = [f"{name} [{i}]" for i, name in enumerate(names)]
    if not items or not all(isinstance(p, RoutingProfile) for p in items):
        raise ValueError("plan_placement needs a RoutingProfile, or a non-empty list or dict of RoutingProfiles")
    if len(items) == 1:
        return items[0], names, items
    first = items[0]
    check_same_model(items, names)
    for name, other in zip(names, items):
        if (other.num_experts, other.top_k) != (first.num_experts, first.top_k):
            raise ValueError(
                f"profiles differ in (num_experts, top_k): {names[0]} has {(first.num_experts, first.top_k)}, "
                f"{name} has {(other.num_experts, other.top_k)}"
            )
    shared = sorted(set.intersection(*(set(p.layers) for p in items)))
    if not shared:
        raise ValueError(f"the profiles {names} share no MoE layer")
    with_samples = all(p.has_samples for p in items)
    layers = {}
    for layer in shared:
        routings = [p.layer(layer) for p in items]
        layers[layer] = LayerRouting(
            coactivation=sum(np.asarray(r.coactivation, dtype=np.int64) for r in routings),
            expert_counts=sum(np.asarray(r.expert_counts, dtype=np.int64) for r in routings),
            token_count=int(sum(int(r.token_count) for r in routings)),
            topk_sample=np.concatenate([r.topk_sample for r in routings]) if with_samples else None,
        )
    pooled = RoutingProfile(first.num_experts, first.top_k, layers, first.model_type, {"source": "pooled: " + ", ".join(names)})
    return pooled, names, items


def _profile_inputs(items: list["RoutingProfile"], layer: int, pooled_routing) -> dict[str, np.ndarray]:
    """`membership_PN` (with a pooled sample) or `counts_PE` for a planner that bounds each profile."""
    if pooled_routing.topk_sample is not None:
        sizes = [len(p.layer(layer).topk_sample) for p in items]
        owner_N = np.repeat(np.arange(len(items)), sizes)
        return {"membership_PN": owner_N[None, :] == np.arange(len(items))[:, None]}
    return {"counts_PE": np.stack([np.asarray(p.layer(layer).expert_counts, dtype=np.float64) for p in items])}


def plan_profiles(
    profile: "RoutingProfile | list[RoutingProfile] | dict[str, RoutingProfile]",
    num_devices: int,
    method: str = "refined",
    *,
    layers: Iterable[int] | None = None,
    progress: bool = True,
    devices_per_node: int | None = None,
    **options: Any,
) -> Placement:
    """Plan a placement for every layer of `profile` (or `layers`) with the named method.

    `plan_placement` is this plus the optional cross-validation (`placement.planning`).

    Args:
        profile: a `RoutingProfile` (co-activation, expert counts and, when present, the top-k
            sample), or several (a list, or a dict by name: domains, prefill and decode, before and
            after a fine-tune). Several are pooled for the objective, and a planner that supports
            it ("refined") holds its load limit on each of them: the worst, not the pooled mean.
        num_devices: `D`, devices of the expert-parallel group (1 <= D <= E).
        method: a registered planner name (`available_planners()`); default "refined".
        layers: the profile layers to plan (default: all the profiles share).
        progress: show a progress bar over layers (`utils.progress`: HF's switches turn it off too).
        devices_per_node: `G`, devices per node of the cluster (must divide D): recorded in the placement (its
            metrics then report CT_node and the rows crossing nodes), and a node-aware planner (one whose
            options have `devices_per_node`: "refined") minimises CT_node first, then CT within the nodes.
            None: one node.
        **options: the planner's options (e.g. `max_load_ratio=1.1, seed=0` for "refined").

    `placement.meta["profile_metrics"]` records, per layer, how the placement scores on the
    profile it was planned on (`_layer_score`): CT or cut, and the slowest device's load and rows,
    not only means; with several profiles `meta["worst_profile"]` adds each layer's worst
    profile and its balance.
    """
    from ..utils.progress import progress_bar

    spec = get_planner(method)
    if devices_per_node is not None:
        devices_per_node = check_devices_per_node(devices_per_node, int(num_devices), "plan_placement devices_per_node")
        if spec.node_aware:
            options = {**options, "devices_per_node": devices_per_node}
    planner_options = spec.make_options(**options)
    pooled, names, items = pool_profiles(profile)
    check_device_count(pooled.num_experts, num_devices)
    chosen = sorted(pooled.layers) if layers is None else [int(l) for l in layers]
    if not chosen:
        raise ValueError(f"plan_placement layers={layers!r} selects no layer; leave it None to plan every layer of the profile")
    maps, replicas, slots, scores, worst, pin_slack = {}, {}, None, {}, {}, {}
    bar = progress_bar(chosen, desc=f"placement {method} D={num_devices}", unit="layer", enabled=progress)
    for layer in bar:
        routing = pooled.layer(layer)
        extra = _profile_inputs(items, layer, routing) if spec.multi_profile and len(items) > 1 else {}
        result = spec.plan_layer(routing.coactivation, routing.expert_counts, routing.topk_sample, num_devices, planner_options, **extra)
        device_of_E = np.asarray(getattr(result, "device_of_E", result))
        maps[layer] = device_of_E.tolist()
        if getattr(result, "replicas", None):
            replicas[layer] = {int(e): [int(d) for d in ds] for e, ds in result.replicas.items()}
        if getattr(result, "slots_per_device", None):
            slots = max(slots or 0, int(result.slots_per_device))
        if getattr(result, "pin_slack", None) is not None and layer in replicas:
            pin_slack[layer] = float(result.pin_slack)
        home_table = home_table_from(device_of_E, replicas[layer]) if layer in replicas else None
        scores[str(layer)] = _layer_score(
            evaluate_layer(routing, device_of_E, num_devices, pooled.top_k, home_table, devices_per_node)
        )
        if len(items) > 1:
            per_profile = {
                name: evaluate_layer(p.layer(layer), device_of_E, num_devices, pooled.top_k, home_table).balance
                for name, p in zip(names, items)
            }
            name = max(per_profile, key=per_profile.get)
            worst[str(layer)] = {"profile": name, "balance": round(per_profile[name], 4)}
        bar.set_postfix({k: v for k, v in scores[str(layer)].items() if k in ("ct_node", "ct", "cut_per_token", "balance")})
    meta = {
        "method": method,
        "options": dataclasses.asdict(planner_options),
        "profile_source": pooled.meta.get("source"),
        "model_type": pooled.model_type,
        "profile_metrics": scores,
    }
    if len(items) > 1:
        meta["profiles"] = names
        meta["worst_profile"] = worst
    return Placement(
        pooled.num_experts, int(num_devices), maps, meta, replicas=replicas, slots_per_device=slots, pin_slack=pin_slack,
        devices_per_node=devices_per_node,
    )  # fmt: skip


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
        **({} if m.nodes is None else {"ct_node": round(m.nodes.ct_node_mean, 4), "cross_node_rows": round(m.nodes.cross_rows_flat, 4)}),
    }


__all__ = [
    "NoOptions",
    "PlannerSpec",
    "available_planners",
    "balanced_capacities",
    "check_layer_inputs",
    "get_planner",
    "plan_profiles",
    "pool_profiles",
    "register_planner",
]
