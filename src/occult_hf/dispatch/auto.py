"""How `dispatcher="auto"` chooses under torch.distributed: the padded exchange where its padding costs little.

Shape legend: see `occult_hf.dispatch.plan`.

"all_to_all" sends exactly the rows the routing needs but learns their count on the host: one read per layer,
which in a training step at real size leaves the GPU idle while the host waits and then issues the rest of the
layer (docs/bench_ep_h200_2gpu.md). "padded" (`static.PaddedDispatcher`) reads nothing on the host: each rank
sends every peer a fixed slot of `T` rows in dedup (a token sends at most one row per device), filled or not. Its cost is the padding: `D * T` rows on the
wire and through the receiver's layout instead of the `T * CT` the routing needs (CT: devices a token visits).
Also, whatever the padding, the received pairs are all `R * k` (row, slot) entries, about D times the pairs a
rank computes, the empty ones sorted past the last expert: the expert kernels skip them (no work), but the
backends' per-pair buffers are sized for all of them (memory: "grouped_mm_fused" keeps `[N, 2I]` for the backward).

The padding is estimated from the placement alone, for routing that picks each token's k experts uniformly at
random: device d, holding `n_d` of the E experts, is visited with probability `1 - C(E - n_d, k) / C(E, k)`, so
`CT = sum_d (1 - C(E - n_d, k) / C(E, k))` and the overhead is `D / CT - 1`. At D=2 with top-8 of 64 experts
(OLMoE) CT = 1.995: 0.2% padding; at D=4, 9%; at D=8, 47%. Qwen1.5-MoE (top-4 of 60): 6% at D=2, 44% at D=4.
Co-activation-aware placements (Occult's) lower CT below the uniform value (the Qwen1.5 trace: 1.63 against
1.89 at D=2), so the real padding is larger than estimated there (23% against 6%).

**The rule.** "auto" picks "padded" for a layer when it dispatches in "dedup" mode, in one chunk (the overlap of
several chunks exists only in "all_to_all"), without collaboration pruning (whose point is to send fewer rows,
which a fixed slot would not), with an expert backend that skips a static layout's empty pairs (every backend but
"torch" on CUDA, whose grouped GEMM path gathers and masks every slot, empty or not), where the ranks can agree on the most tokens any of
them passes host to host (`ExpertParallelGroup.host_group`, a gloo group `apply_occult` makes: ranks may then pass
different T), and when the estimated overhead is at most `PADDED_MAX_OVERHEAD` (25%); otherwise the registered
dispatchers by priority ("all_to_all"). The bound: the GPU idle of the host read costs more than 25% more rows on
NVLink, and still more on a link 8x slower; 25% also covers the under-estimate of refined placements at D=2 (23%).

**Across nodes.** Where the group spans nodes (`ExpertParallelGroup.spans_nodes`: `OccultConfig.devices_per_node`, or
`$LOCAL_WORLD_SIZE` under torch.distributed, smaller than the group) "auto" takes "hierarchical"
(`dispatch.hierarchical`: one row per (token, node) over the inter-node link, about 9x slower than NVLink, instead of
one per (token, device)), before the padding rule: a fixed slot per device would cross the slow link D times a token.
On one node nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

#: the most padding (extra rows relative to the rows the routing needs, estimated) at which "auto" takes "padded"
PADDED_MAX_OVERHEAD = 0.25


def expected_devices_per_token(experts_per_device: list[int], top_k: int) -> float:
    """CT under uniform routing: the expected number of devices a token's `top_k` distinct experts sit on."""
    num_experts = sum(experts_per_device)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    none_of = comb(num_experts, top_k)
    return sum(1.0 - comb(num_experts - held, top_k) / none_of for held in experts_per_device)


@dataclass(frozen=True)
class AutoHints:
    """What "auto" needs to know of a layer, beyond its group and device, to weigh the padded exchange.

    Attributes:
        device_of_E: `[E]` each routed expert's (primary) device.
        top_k: experts per token.
        mode: "dedup" or "per_expert".
        chunks: `OccultConfig.dispatch_chunks` (None: the default, one).
        pruned: collaboration pruning limits the tokens' devices.
        expert_backend: `OccultConfig.expert_backend`.
    """

    device_of_E: tuple[int, ...]
    top_k: int
    mode: str
    chunks: int | None = None
    pruned: bool = False
    expert_backend: str = "auto"

    def padding_overhead(self, num_devices: int) -> float:
        """Rows "padded" moves beyond those the routing needs, relative to them (uniform routing): `D / CT - 1` in
        dedup; in per_expert every token's k rows get a slot of `T * k` per device: `D - 1`."""
        if self.mode != "dedup":
            return num_devices - 1.0
        held_D = [0] * num_devices
        for device in self.device_of_E:
            held_D[device] += 1
        return num_devices / expected_devices_per_token(held_D, self.top_k) - 1.0

    def prefers_padded(self, num_devices: int, device_type: str | None) -> bool:
        """The rule of the module docstring."""
        return (
            self.mode == "dedup"
            and (self.chunks or 1) == 1
            and not self.pruned
            and not (self.expert_backend == "torch" and device_type == "cuda")
            and self.padding_overhead(num_devices) <= PADDED_MAX_OVERHEAD
        )


__all__ = ["PADDED_MAX_OVERHEAD", "AutoHints", "expected_devices_per_token"]
