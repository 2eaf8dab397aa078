"""Projected times of every method at D devices, G per node: a model's MoE layers and the whole model.

For each D the expert-parallel group is the largest divisor of D that holds at least one expert per device and is
a whole number of nodes (`ep_group_size`): beyond E devices the experts cannot spread further, and the other
devices run copies of that group on their own tokens (data parallel), whose expert gradients are all-reduced in
training. Placements are planned on the planning half of the routing's tokens (`routing.Routing.halves`) for every
trace layer (`contiguous`, `occult`, `refined`, and `node_refined` = `refined` with `devices_per_node=G`), and each
method's traffic is replayed on the held-out half (`traffic.replay_traffic`) at each T tokens per rank; MoE layer i
of the model replays trace layer `i * L / M` (depth in proportion, as the paper bench does). Times come from `cost`.

Per method and D: the mean MoE layer's forward and forward+backward, the whole model's prefill (one forward) and
training step (where its rest of the layer is measured: `cost.rest_ms`), CT and CT_node on the held-out tokens, the
MB its busiest device sends over its inter-node link per layer and forward, and the routing weight (or slot share)
pruning moves, and the busiest device's pairs over the mean device's (a hot expert's load: the layer waits for
that device).

Shape legend (docs/conventions.md): E experts, D devices, T tokens per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..profile.replay import trace_layer
from ..placement import plan_placement
from ..placement.placement import contiguous_devices
from ..utils.progress import progress_bar
from .parameters import Calibration
from .cost import FWD, FWD_BWD, Cluster, allreduce_ms, ep_layer_ms, gathered_ms, prefill_ms, stock_layer_ms, train_step_ms
from .methods import Method, parse_method
from .routing import Routing
from .specs import ModelSpec
from .traffic import replay_traffic


@dataclass(frozen=True)
class Projected:
    """One method at one D (module docstring); a figure the model cannot give is None and `note` says why."""

    devices: int
    ep_devices: int
    tokens: int
    method: str
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    prefill_ms: float | None = None
    step_ms: float | None = None
    ct: float | None = None
    ct_node: float | None = None
    internode_mb: float | None = None
    imbalance: float | None = None
    removed_slots: float | None = None
    removed_weight: float | None = None
    note: str = ""


def check_devices(devices: int, devices_per_node: int) -> None:
    """D must fill whole nodes of G devices (or be one node of at most G)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"device count {devices!r} must be a positive integer")
    if devices > devices_per_node and devices % devices_per_node:
        raise ValueError(f"D={devices} is not a multiple of the devices per node G={devices_per_node}")


def ep_group_size(devices: int, num_experts: int, devices_per_node: int) -> int:
    """The largest divisor of `devices` that is at most E and fills whole nodes (or is one node of at most G)."""
    check_devices(devices, devices_per_node)
    return max(size for size in range(1, min(devices, num_experts) + 1)
               if devices % size == 0 and (size <= devices_per_node or size % devices_per_node == 0))  # fmt: skip


class Planner:
    """Placements of every trace layer at one EP size, planned on the planning half, cached per placement name."""

    def __init__(self, plan_half: Routing, devices: int, devices_per_node: int) -> None:
        self.plan_half, self.devices, self.devices_per_node = plan_half, devices, devices_per_node
        self.cache: dict[str, list[np.ndarray]] = {}

    def device_maps(self, placement: str) -> list[np.ndarray]:
        """`[E]` device of each expert per trace layer under `placement`."""
        if placement not in self.cache:
            self.cache[placement] = [self._plan(placement, layer) for layer in range(self.plan_half.layers)]
        return self.cache[placement]

    def _plan(self, placement: str, layer: int) -> np.ndarray:
        num_experts = self.plan_half.num_experts
        if placement == "contiguous":
            return contiguous_devices(num_experts, self.devices)
        node_aware = placement == "node_refined" and self.devices > self.devices_per_node
        method = "refined" if placement == "node_refined" else placement
        plan = plan_placement(
            self.plan_half.profile(layer), self.devices, method, progress=False,
            devices_per_node=self.devices_per_node if node_aware else None,
        )  # fmt: skip
        return np.asarray(plan.device_of(0), dtype=np.int64)


def project(
    calib: Calibration,
    spec: ModelSpec,
    routing: Routing,
    devices: Sequence[int],
    methods: Iterable[str],
    cluster: Cluster,
    tokens: Sequence[int],
    progress: bool = True,
) -> list[Projected]:
    """Every method at every D and T (module docstring); `routing` is already fitted to `spec` (`routing.fit_to_model`).
    Rows come D by D, each D's methods in order, T innermost."""
    parsed = [parse_method(name) for name in methods]
    for count in devices:
        check_devices(count, cluster.devices_per_node)
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or t < 1]
    if bad or not tokens:
        raise ValueError(f"tokens per rank {list(tokens)} must be positive integers (at least one)")
    plan_half, held_out = routing.halves()
    rows = []
    cases = [(count, method) for count in devices for method in parsed]
    planners: dict[int, Planner] = {}
    for count, method in progress_bar(cases, enabled=progress, desc=f"plan-cluster {spec.name}", unit="case"):
        ep = ep_group_size(count, spec.num_experts, cluster.devices_per_node)
        planner = planners.setdefault(ep, Planner(plan_half, ep, min(ep, cluster.devices_per_node)))
        rows += [_project_one(calib, spec, held_out, planner, count, ep, method, cluster, t) for t in tokens]
    return rows


def _project_one(
    calib: Calibration, spec: ModelSpec, held_out: Routing, planner: Planner, devices: int, ep: int, method: Method,
    cluster: Cluster, tokens: int,
) -> Projected:
    if method.name == "fsdp2":
        return _fsdp2(calib, spec, devices, cluster, tokens)
    if ep == 1:
        alone = "an EP group of one GPU is no expert parallelism: each GPU runs every expert (see fsdp2)"
        return Projected(devices, ep, tokens, method.name, note=alone)
    if method.name == "transformers_ep" and spec.num_experts % ep:
        refused = f"transformers' EP refuses: E={spec.num_experts} experts do not divide over {ep} ranks"
        return Projected(devices, ep, tokens, method.name, note=refused)
    traffics = [
        replay_traffic(
            held_out.ids_NLk[:, layer], held_out.weights(layer), device_of_E, ep, planner.devices_per_node, tokens, method.dispatch,
            spec.hidden, method.max_devices_per_token, method.max_nodes_per_token,
        )
        for layer, device_of_E in enumerate(planner.device_maps(method.placement))
    ]  # fmt: skip
    per_layer = {
        direction: [ep_layer_ms(calib, cluster, spec, traffic, direction, method.family) for traffic in traffics]
        for direction in (FWD, FWD_BWD)
    }
    model = {direction: [times[trace_layer(i, spec.moe_layers, len(traffics))] for i in range(spec.moe_layers)]
             for direction, times in per_layer.items()}  # fmt: skip
    sync = allreduce_ms(calib, cluster, spec.other_params, devices, devices) + allreduce_ms(
        calib, cluster, spec.routed_params / ep, devices // ep, devices
    )
    whole = _whole_model(calib, spec, model[FWD], model[FWD_BWD], tokens, spec.other_params + spec.routed_params / ep, sync)
    weights = [t.removed_weight for t in traffics]
    return Projected(
        devices, ep, tokens, method.name, float(np.mean(model[FWD])), float(np.mean(model[FWD_BWD])), *whole[:2],
        ct=float(np.mean([t.ct for t in traffics])), ct_node=float(np.mean([t.ct_node for t in traffics])),
        internode_mb=float(np.mean([t.internode_bytes for t in traffics])) / 1e6,
        imbalance=float(np.mean([t.imbalance for t in traffics])),
        removed_slots=float(np.mean([t.removed_slots for t in traffics])),
        removed_weight=None if None in weights else float(np.mean(weights)),
        note="; ".join(filter(None, [_idle_note(method, ep, planner.devices_per_node, spec.top_k), whole[2]])),
    )  # fmt: skip


def idle_limits(method: Method, ep: int, devices_per_node: int, top_k: int) -> dict[str, str]:
    """`{"N_d" / "N_n": why}` for each of the method's limits that cannot bind in an EP group of `ep` GPUs, G per node:
    at least the most devices (nodes) a token reaches, min(the group's, k); such a row is the unpruned method's."""
    nodes = ep // devices_per_node if ep > devices_per_node else 1
    limits = (("N_d", method.max_devices_per_token, ep, "GPUs"), ("N_n", method.max_nodes_per_token, nodes, "nodes"))
    return {name: f"{name}={limit} >= min({unit}={count}, k={top_k})" for name, limit, count, unit in limits
            if limit is not None and limit >= min(count, top_k)}  # fmt: skip


def _idle_note(method: Method, ep: int, devices_per_node: int, top_k: int) -> str:
    """The row's note on `idle_limits`: why its figures equal the unpruned method's."""
    idle = idle_limits(method, ep, devices_per_node, top_k)
    return f"{', '.join(idle.values())}: prunes nothing" if idle else ""


def _fsdp2(calib: Calibration, spec: ModelSpec, devices: int, cluster: Cluster, tokens: int) -> Projected:
    """Every GPU runs every expert on its own tokens; each MoE block's parameters are gathered (module docstring)."""
    block = spec.num_experts * spec.expert_params + spec.hidden * spec.num_experts + 3 * spec.hidden * spec.shared_width
    layer = {d: stock_layer_ms(calib, spec, tokens, d) + gathered_ms(calib, cluster, block, devices, d) for d in (FWD, FWD_BWD)}
    rest = spec.params - spec.moe_layers * block
    whole = _whole_model(
        calib, spec, [layer[FWD]] * spec.moe_layers, [layer[FWD_BWD]] * spec.moe_layers, tokens, spec.params / devices,
        gathered_ms(calib, cluster, rest, devices, FWD_BWD), prefill_extra_ms=gathered_ms(calib, cluster, rest, devices, FWD),
    )  # fmt: skip
    return Projected(devices, devices, tokens, "fsdp2", layer[FWD], layer[FWD_BWD], *whole[:2], imbalance=1.0, note=whole[2])


def _whole_model(
    calib: Calibration, spec: ModelSpec, fwd: list[float], fwd_bwd: list[float], tokens: int, params_per_rank: float,
    sync_ms: float, prefill_extra_ms: float = 0.0,
) -> tuple[float | None, float | None, str]:
    """(prefill ms, training step ms, note): None and the reason where the rest of the layer is not measured."""
    if spec.rest_like is None:
        return None, None, f"whole model not modelled: the rest of {spec.name}'s layers (its attention) was never measured"
    prefill = prefill_ms(calib, spec, fwd, tokens) + prefill_extra_ms
    return prefill, train_step_ms(calib, spec, fwd_bwd, tokens, params_per_rank, sync_ms), ""


__all__ = ["Planner", "Projected", "check_devices", "ep_group_size", "idle_limits", "project"]
