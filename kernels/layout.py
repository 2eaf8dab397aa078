"""The layout the local expert computation consumes (DESIGN.md §3 step 5).

Shape legend: R received rows, N (row, local expert) pairs, L local experts, H hidden, I expert width.

After dispatch a device holds `R` received rows `x_RH` (one per (token, this device) in `dedup`
mode, one per (token, expert) in `per_expert` mode). Each row is served by one or more of the
device's local experts. The pairs are laid out grouped by local expert, so that every local expert
reads one contiguous segment (what a grouped GEMM wants), and the output is one row per received
row: `out[r] = sum over pairs p with pair_row[p] == r of pair_weight[p] * MLP_{expert(p)}(x[r])`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertSegments:
    """(row, local expert) pairs grouped by local expert.

    Attributes:
        pair_row: `[N]` int64, the received row each pair reads; pairs are sorted by local expert and,
            within one expert, by row (so the layout is deterministic).
        expert_offsets: `[L + 1]` int64, pairs of local expert `e` are `pair_row[expert_offsets[e]:expert_offsets[e+1]]`;
            `expert_offsets[0] == 0`, `expert_offsets[L] == N`. Empty experts have equal neighbours.
        num_rows: `R`, the number of received rows (rows served by no pair get a zero output row).
    """

    pair_row: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: int

    @property
    def num_pairs(self) -> int:
        return self.pair_row.shape[0]

    @property
    def num_local_experts(self) -> int:
        return self.expert_offsets.shape[0] - 1

    @classmethod
    def from_pairs(cls, pair_row: torch.Tensor, pair_expert: torch.Tensor, num_rows: int, num_local_experts: int):
        """Group unordered pairs by expert. Returns the segments and the permutation `order_N` that
        sorts the caller's per-pair tensors (weights) into segment order: `weight[order_N]`."""
        # Stable sort by (expert, row): key = expert * R + row fits int64 for any realistic R.
        key_N = pair_expert.to(torch.int64) * max(num_rows, 1) + pair_row.to(torch.int64)
        order_N = torch.argsort(key_N, stable=True)
        # a scatter-add histogram: unlike bincount (which reads the maximum on the host), no CUDA sync
        pair_expert = pair_expert.to(torch.int64)
        counts_L = torch.zeros(num_local_experts, dtype=torch.int64, device=pair_row.device)
        counts_L.scatter_add_(0, pair_expert, torch.ones_like(pair_expert))
        offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=pair_row.device)
        offsets[1:] = torch.cumsum(counts_L, 0)
        return cls(pair_row.to(torch.int64)[order_N], offsets, num_rows), order_N


__all__ = ["ExpertSegments"]
