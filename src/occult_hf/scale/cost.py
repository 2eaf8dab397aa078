"""The cost model's equations: a layer's and a model's time from its traffic, its shape and the calibration.

All times are milliseconds on one device; a layer ends when its busiest device ends (`LayerTraffic` holds that
device's work). Per MoE layer, forward:

    expert-parallel layer = max(host time, gap + per-row cost x rows + device work)
    device work           = experts(pairs) + shared experts(T) + exchange
    exchange (flat)       = 2 calls x NVLink call cost + max(NVLink bytes / NVLink rate,
                                                             inter-node bytes / inter-node rate + 2 x latency)
    exchange (hierarchical) = 2 calls x (NVLink call cost + latency) + inter-node bytes / inter-node rate
                              + 2 calls x NVLink call cost + NVLink bytes / NVLink rate        (the two hops in turn)
    experts(pairs)        = kernel intercept + 6 H I pairs / kernel rate     (18 H I pairs forward+backward)
    shared experts(T)     = 6 H I_shared T / dense rate

and forward+backward uses the forward+backward host, gap, per-row and kernel figures with the exchange twice (the
backward sends the same rows back). The host time and the gap are the layer's host synchronisation
(`parameters.HostOverlap`): the host issues the layer while the GPU works, except after the count exchange, where
the GPU waits for the host; a small batch's layer is the host's issue time, a large one's the gap plus the work. The flat exchange's two links run at once (an all-to-all over NVLink and
the network together); the hierarchical one's hops follow each other, each its own all-to-all in dispatch and in
combine (`dispatch.hierarchical`: four calls per forward, each at the call cost; the inter-node pair also at the
latency). Inside one node there is no inter-node hop: every dispatch is the flat exchange. The baselines:

    one GPU (stock)       = experts of transformers (its kernel line) on T k pairs + shared experts
    transformers' EP      = the same layer equation with transformers' own dispatcher and kernel lines,
                            one row per (token, expert) on the contiguous placement
    FSDP2                 = one GPU's layer + its parameters gathered (forward: one all-gather; forward+backward:
                            two all-gathers and a reduce-scatter, (D - 1) / D of the bytes each) at the
                            collective rate, not overlapped (what the two-GPU fine-tuning rows fit)

The collective rate is NVLink's inside a node and, across nodes, the node's NICs together (NCCL's rings use
every rail: min(NVLink rate, G x inter-node rate)). A whole model adds, per decoder layer, the rest of the layer
(attention, norms, router: a measured time per token) and dense MLPs; a training step adds the LM head, the
optimizer (a measured time per parameter the rank holds) and the gradient all-reduce of replicated parameters
(ring: 2 (R - 1) / R of the bytes).

Shape legend (docs/conventions.md): H hidden, I expert width, T tokens per rank, D devices, k experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .parameters import Calibration
from .specs import ModelSpec
from .traffic import LayerTraffic

FWD, FWD_BWD = "fwd", "fwd_bwd"
DIRECTIONS = (FWD, FWD_BWD)
#: FLOPs per weight per token: 2 forward, 6 forward+backward
FLOPS_PER_WEIGHT = {FWD: 2, FWD_BWD: 6}
#: the all-to-all calls of one forward (dispatch, combine)
CALLS = 2
BF16 = 2


@dataclass(frozen=True)
class Cluster:
    """The machines: `devices_per_node` GPUs joined by NVLink (rates from the calibration) per node, the nodes by a
    network of `internode_gbs` GB/s per GPU and `internode_latency_us` per collective call that crosses it
    (assumptions: arguments)."""

    devices_per_node: int = 8
    internode_gbs: float = 50.0
    internode_latency_us: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be a positive integer, got {self.devices_per_node!r}")
        if not self.internode_gbs > 0:
            raise ValueError(f"internode_gbs must be > 0, got {self.internode_gbs!r}")
        if not 0 <= self.internode_latency_us < math.inf:
            raise ValueError(f"internode_latency_us must be a finite number >= 0, got {self.internode_latency_us!r}")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {', '.join(DIRECTIONS)}")


def expert_gflop(spec: ModelSpec, pairs: float, direction: str) -> float:
    """GFLOPs of `pairs` (token, expert) pairs through the experts (three H x I matrices each)."""
    return FLOPS_PER_WEIGHT[direction] * spec.expert_params * pairs / 1e9


def dense_ms(calib: Calibration, weights: float, tokens: float, direction: str) -> float:
    """A dense layer of `weights` parameters over `tokens` tokens at the dense rate."""
    return FLOPS_PER_WEIGHT[direction] * weights * tokens / (calib.dense_tflops * 1e9)


def shared_ms(calib: Calibration, spec: ModelSpec, tokens: float, direction: str) -> float:
    """The shared experts of one layer."""
    return dense_ms(calib, 3 * spec.hidden * spec.shared_width, tokens, direction)


def experts_ms(calib: Calibration, implementation: str, spec: ModelSpec, pairs: float, direction: str) -> float:
    """The routed experts of one device (`implementation`: "occult" or "transformers")."""
    return calib.kernels[f"{implementation}/{direction}"](expert_gflop(spec, pairs, direction))


def exchange_ms(calib: Calibration, cluster: Cluster, traffic: LayerTraffic) -> float:
    """One forward's dispatch and combine (the equations in the module docstring). No inter-node byte means one
    node (`traffic.replay_traffic` gives exactly 0 there): no inter-node hop, no latency."""
    calls = CALLS * calib.nvlink.intercept_ms
    nvlink = calls + traffic.nvlink_bytes / 1e6 * calib.nvlink.slope_ms
    if not traffic.internode_bytes:
        return nvlink
    internode = calls + CALLS * cluster.internode_latency_us / 1e3 + traffic.internode_bytes / (cluster.internode_gbs * 1e6)
    if traffic.dispatch == "hierarchical":
        return nvlink + internode
    return max(nvlink, internode)


def ep_device_ms(
    calib: Calibration, cluster: Cluster, spec: ModelSpec, traffic: LayerTraffic, direction: str, family: str = "occult"
) -> float:
    """The GPU work of an expert-parallel MoE layer besides its dispatcher's: experts, shared experts, exchange."""
    _check_direction(direction)
    exchanges = 1 if direction == FWD else 2
    return (
        experts_ms(calib, family, spec, traffic.pairs, direction)
        + shared_ms(calib, spec, traffic.tokens, direction)
        + exchanges * exchange_ms(calib, cluster, traffic)
    )


def ep_layer_ms(
    calib: Calibration, cluster: Cluster, spec: ModelSpec, traffic: LayerTraffic, direction: str, family: str = "occult"
) -> float:
    """An expert-parallel MoE layer (`family`: "occult" or "transformers", whose dispatcher and kernels it uses)."""
    device = ep_device_ms(calib, cluster, spec, traffic, direction, family)
    return calib.dispatchers[f"{family}/{direction}"](traffic.rows / 1e3, device)


def stock_layer_ms(calib: Calibration, spec: ModelSpec, tokens: float, direction: str) -> float:
    """One GPU's MoE layer as transformers runs it (every expert local)."""
    _check_direction(direction)
    return experts_ms(calib, "transformers", spec, tokens * spec.top_k, direction) + shared_ms(calib, spec, tokens, direction)


def collective_gbs(calib: Calibration, cluster: Cluster, devices: int) -> float:
    """GB/s of a large all-gather / reduce-scatter / all-reduce over `devices` GPUs (module docstring)."""
    nvlink = 1e3 / calib.nvlink.slope_ms / 1e3
    return nvlink if devices <= cluster.devices_per_node else min(nvlink, cluster.devices_per_node * cluster.internode_gbs)


def gathered_ms(calib: Calibration, cluster: Cluster, params: float, devices: int, direction: str) -> float:
    """FSDP2's traffic for `params` parameters sharded over `devices` (module docstring)."""
    if devices == 1:
        return 0.0
    collectives = 1 if direction == FWD else 3
    return collectives * params * BF16 * (devices - 1) / devices / (collective_gbs(calib, cluster, devices) * 1e6)


def allreduce_ms(calib: Calibration, cluster: Cluster, params: float, replicas: int, span: int) -> float:
    """A ring all-reduce of `params` bf16 gradients over `replicas` copies spread over `span` devices."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * params * BF16 / (collective_gbs(calib, cluster, span) * 1e6)


def rest_ms(calib: Calibration, spec: ModelSpec, tokens: float, direction: str) -> float:
    """Every decoder layer's attention, norms and router, and the dense layers' MLPs, over `tokens` tokens."""
    if spec.rest_like is None:
        raise ValueError(
            f"the rest of {spec.name}'s decoder layers (its attention) was never measured: its whole-model time is not "
            f"modelled (its MoE layers are)"
        )
    per_token = calib.rest_ms_per_ktoken[f"{spec.rest_like}/{direction}"] / 1e3
    dense = spec.dense_layers * dense_ms(calib, 3 * spec.hidden * spec.dense_width, tokens, direction)
    return spec.layers * per_token * tokens + dense


def prefill_ms(calib: Calibration, spec: ModelSpec, moe_layers_ms: Sequence[float], tokens: float) -> float:
    """A forward of the whole model: its MoE layers (one time each) and the rest (the LM head keeps one position)."""
    _check_layers(spec, moe_layers_ms)
    return sum(moe_layers_ms) + rest_ms(calib, spec, tokens, FWD)


def train_step_ms(
    calib: Calibration, spec: ModelSpec, moe_layers_ms: Sequence[float], tokens: float, params_per_rank: float,
    sync_ms: float,
) -> float:
    """A training step: forward+backward of every layer, the LM head, the optimizer over the rank's parameters
    and `sync_ms` of gradient or parameter traffic not overlapped with compute."""
    _check_layers(spec, moe_layers_ms)
    head = dense_ms(calib, spec.vocab * spec.hidden, tokens, FWD_BWD)
    optimizer = calib.optimizer_ms_per_bparam * params_per_rank / 1e9
    return sum(moe_layers_ms) + rest_ms(calib, spec, tokens, FWD_BWD) + head + optimizer + sync_ms


def _check_layers(spec: ModelSpec, moe_layers_ms: Sequence[float]) -> None:
    if len(moe_layers_ms) != spec.moe_layers:
        raise ValueError(f"{spec.name} has {spec.moe_layers} MoE layers; got {len(moe_layers_ms)} layer times")


__all__ = [
    "CALLS", "DIRECTIONS", "FWD", "FWD_BWD", "Cluster", "allreduce_ms", "collective_gbs", "dense_ms", "ep_device_ms", "ep_layer_ms",
    "exchange_ms", "expert_gflop", "experts_ms", "gathered_ms", "prefill_ms", "rest_ms", "shared_ms", "stock_layer_ms",
    "train_step_ms",
]  # fmt: skip
