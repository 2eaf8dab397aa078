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

from .triton_support import triton_importable


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
        sorts the caller's per-pair tensors (weights) into segment order: `weight[order_N]`.

        Expert ids must lie in [0, L) and rows in [0, R) (not checked: reading them would synchronise)."""
        rows = max(num_rows, 1)
        if _one_program_layout(pair_row, num_local_experts):
            from .triton_layout import sort_by_group

            order_N, offsets, pair_row_N = sort_by_group(pair_expert, num_local_experts, pair_row, rows)
        else:
            pair_row_N, offsets, order_N = _sort_pairs_torch(pair_row, pair_expert, rows, num_local_experts)
        return cls(pair_row_N, offsets, num_rows), order_N


def _sort_pairs_torch(pair_row: torch.Tensor, pair_expert: torch.Tensor, rows: int, num_local_experts: int):
    """`(pair_row_N, expert_offsets, order_N)` by torch: a stable sort by key = expert * R + row, in 32
    bits wherever it fits (a radix sort of 32-bit keys takes half the passes of 64-bit ones); the expert
    offsets are a binary search of the sorted keys (no histogram, no host read of a maximum)."""
    key_dtype = torch.int32 if (num_local_experts + 1) * rows < 2**31 else torch.int64
    key_N = torch.add(pair_row.to(torch.int64), pair_expert.to(torch.int64), alpha=rows).to(key_dtype)
    key_sorted_N, order_N = torch.sort(key_N, stable=True)
    bounds = torch.arange(0, (num_local_experts + 1) * rows, rows, dtype=key_dtype, device=pair_row.device)
    return pair_row.to(torch.int64)[order_N], torch.searchsorted(key_sorted_N, bounds), order_N


def _one_program_layout(pair_row: torch.Tensor, num_groups: int) -> bool:
    """Whether the layout is sorted by one Triton program (`triton_layout`): CUDA tensors of a small
    layout, where Triton imports (this package never needs it otherwise)."""
    if not pair_row.is_cuda or pair_row.shape[0] == 0 or not triton_importable():
        return False
    from .triton_layout import fits_one_program

    return fits_one_program(pair_row.shape[0], num_groups)


__all__ = ["ExpertSegments"]
