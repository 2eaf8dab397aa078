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
        row_pairs: `[N]` int64 or None: the row -> pairs index the row reductions read (each row's pairs in
            segment order, ascending), where the layout built it on the way (`from_topk`); else the kernels
            build it from `pair_row` (`triton_expert_mlp.plan_launch`).
        row_offsets: `[R + 1]` int64 or None: row r's pairs are `row_pairs[row_offsets[r]:row_offsets[r+1]]`.
    """

    pair_row: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: int
    row_pairs: torch.Tensor | None = None
    row_offsets: torch.Tensor | None = None

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

    @classmethod
    def from_topk_ids(cls, topk_ids_Tk: torch.Tensor, num_experts: int):
        """All `E` experts local (one device): the layout of `from_topk` by `from_pairs` (torch's sort, or one
        program's). Returns the segments and `order_N`, each pair's position in the flattened `[T k]` routing
        tensors (`weights.reshape(-1)[order_N]` are the weights in segment order)."""
        num_tokens, top_k = topk_ids_Tk.shape
        row_N = torch.arange(num_tokens * top_k, device=topk_ids_Tk.device) // top_k
        return cls.from_pairs(row_N, topk_ids_Tk.reshape(-1), num_tokens, num_experts)

    @classmethod
    def from_topk(cls, topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor, num_experts: int):
        """All `E` experts local (one device): pairs (t, topk_ids[t, j]) grouped by expert, rows ascending within
        an expert, the same layout as `from_topk_ids`. Returns the segments and
        the routing weights in segment order `[N]` (differentiable with respect to `topk_weights_Tk`).

        On CUDA with Triton, up to `triton_layout.TOPK_MAX_EXPERTS` experts, one launch (three for more pairs or
        experts, `triton_layout.one_launch`) builds the segments, the row -> pairs index and the weights in segment
        order (`topk_layout`), instead of an arange, a division, two sorts and an indexing with its backward (at
        small T the host's time per operator is the call's time; at large T their three dozen kernels). Expert
        ids must lie in [0, E) (not checked: reading them would synchronise)."""
        if not topk_kernel_applies(topk_ids_Tk, num_experts):
            segments, order_N = cls.from_topk_ids(topk_ids_Tk, num_experts)
            return segments, topk_weights_Tk.reshape(-1)[order_N]
        if torch.is_grad_enabled() and topk_weights_Tk.requires_grad:
            weight_N, *index = _TopkLayout.apply(topk_weights_Tk, topk_ids_Tk, num_experts)
        else:
            weight_N, *index = _topk_layout(topk_ids_Tk, topk_weights_Tk.detach(), num_experts)
        pair_row_N, offsets, row_pairs_N, row_offsets, _ = index
        return cls(pair_row_N, offsets, topk_ids_Tk.shape[0], row_pairs_N, row_offsets), weight_N


def _topk_layout(topk_ids_Tk, topk_weights_Tk, num_experts):
    """`(weight_N, pair_row_N, expert_offsets, row_pairs_N, row_offsets, order_N)` by `triton_layout.topk_layout`."""
    from .triton_layout import topk_layout

    order_N, pair_row_N, weight_N, offsets, row_pairs_N, row_offsets = topk_layout(topk_ids_Tk, num_experts, topk_weights_Tk)
    return weight_N, pair_row_N, offsets, row_pairs_N, row_offsets, order_N


class _TopkLayout(torch.autograd.Function):
    """`_topk_layout` with the weights' gradient: the layout is a permutation of the pairs, so the backward
    puts each pair's gradient back at its top-k place (one `index_copy_`, no accumulation)."""

    @staticmethod
    def forward(ctx, topk_weights_Tk, topk_ids_Tk, num_experts: int):
        outputs = _topk_layout(topk_ids_Tk, topk_weights_Tk, num_experts)
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.save_for_backward(outputs[-1])
        ctx.weights_shape = topk_weights_Tk.shape
        return outputs

    @staticmethod
    def backward(ctx, grad_weight_N, *_):
        (order_N,) = ctx.saved_tensors
        grad_Tk = grad_weight_N.new_empty(ctx.weights_shape)
        return grad_Tk.view(-1).index_copy_(0, order_N, grad_weight_N).view(ctx.weights_shape), None, None


def _sort_pairs_torch(pair_row: torch.Tensor, pair_expert: torch.Tensor, rows: int, num_local_experts: int):
    """`(pair_row_N, expert_offsets, order_N)` by torch: a stable sort by key = expert * R + row, in 32
    bits wherever it fits (a radix sort of 32-bit keys takes half the passes of 64-bit ones); the expert
    offsets are a binary search of the sorted keys (no histogram, no host read of a maximum)."""
    key_dtype = torch.int32 if (num_local_experts + 1) * rows < 2**31 else torch.int64
    key_N = torch.add(pair_row.to(torch.int64), pair_expert.to(torch.int64), alpha=rows).to(key_dtype)
    key_sorted_N, order_N = torch.sort(key_N, stable=True)
    bounds = torch.arange(0, (num_local_experts + 1) * rows, rows, dtype=key_dtype, device=pair_row.device)
    return pair_row.to(torch.int64)[order_N], torch.searchsorted(key_sorted_N, bounds), order_N


def topk_kernel_applies(topk_ids_Tk: torch.Tensor, num_experts: int) -> bool:
    """Whether `from_topk` takes the Triton layout (`triton_layout.topk_layout`): CUDA, Triton importable, a
    non-empty routing over at most `triton_layout.TOPK_MAX_EXPERTS` experts."""
    if not topk_ids_Tk.is_cuda or topk_ids_Tk.numel() == 0 or not triton_importable():
        return False
    from .triton_layout import TOPK_MAX_EXPERTS

    return num_experts <= TOPK_MAX_EXPERTS


def _one_program_layout(pair_row: torch.Tensor, num_groups: int) -> bool:
    """Whether the layout is sorted by one Triton program (`triton_layout`): CUDA tensors of a small
    layout, where Triton imports (this package never needs it otherwise)."""
    if not pair_row.is_cuda or pair_row.shape[0] == 0 or not triton_importable():
        return False
    from .triton_layout import fits_one_program

    return fits_one_program(pair_row.shape[0], num_groups)


__all__ = ["ExpertSegments", "topk_kernel_applies"]
