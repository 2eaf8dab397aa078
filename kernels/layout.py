"""The layout the local expert computation consumes (docs/design.md §3 step 5).

Shape legend: R received rows, N (row, local expert) pairs, L local experts, H hidden, I expert width.

After dispatch a device holds `R` received rows `x_RH` (one per (token, this device) in `dedup`
mode, one per (token, expert) in `per_expert` mode). Each row is served by one or more of the
device's local experts. The pairs are laid out grouped by local expert, so that every local expert
reads one contiguous segment (what a grouped GEMM wants), and the output is one row per received
row: `out[r] = sum over pairs p with pair_row[p] == r of pair_weight[p] * MLP_{expert(p)}(x[r])`.

Both sorts the layout needs (by local expert for the segments, by row for the row -> pairs index the row reductions
read) are `sort_by_group`: one Triton program for small layouts where Triton runs, torch's stable sort elsewhere
(`sort_by_group_torch`, the specification and the CPU path). Routing straight from a top-k needs no comparison sort
(`ExpertSegments.from_topk`, `triton_layout.topk_layout`; `topk_layout_torch` specifies it).

Under `torch.compile` both are custom operators, `occult::sort_by_group` and `occult::topk_layout` (the latter
differentiable with respect to the routing weights), so dynamo traces the layout without a graph break and without
guards on the number of pairs: the choice between the one-program kernel and torch's sort is made inside the
operator, at run time. Every output's shape follows from the input shapes (N pairs, G groups, T tokens, k, E) alone.
Eager calls skip the operator dispatch (tens of microseconds a call on the host, where a small layout takes a few)
and run the same functions directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_support import triton_runs_on


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
        order_N, offsets, pair_row_N = sort_by_group(pair_expert, num_local_experts, pair_row, max(num_rows, 1))
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

        Where Triton runs, up to `triton_layout.TOPK_MAX_EXPERTS` experts, one launch (three for more pairs or
        experts, `triton_layout.one_launch`) builds the segments, the row -> pairs index and the weights in segment
        order (`topk_layout`), instead of an arange, a division, two sorts and an indexing with its backward (at
        small T the host's time per operator is the call's time; at large T their three dozen kernels). Expert
        ids must lie in [0, E) (not checked: reading them would synchronise)."""
        if not topk_kernel_applies(topk_ids_Tk, num_experts):
            segments, order_N = cls.from_topk_ids(topk_ids_Tk, num_experts)
            return segments, topk_weights_Tk.reshape(-1)[order_N]
        if torch.compiler.is_compiling():
            weight_N, *index = torch.ops.occult.topk_layout(topk_ids_Tk, topk_weights_Tk, num_experts)
        elif torch.is_grad_enabled() and topk_weights_Tk.requires_grad:
            weight_N, *index = _TopkLayout.apply(topk_weights_Tk, topk_ids_Tk, num_experts)
        else:
            weight_N, *index = _topk_layout(topk_ids_Tk, topk_weights_Tk.detach(), num_experts)
        pair_row_N, offsets, row_pairs_N, row_offsets, _ = index
        return cls(pair_row_N, offsets, topk_ids_Tk.shape[0], row_pairs_N, row_offsets), weight_N


def check_expert_shapes(
    x_RH: torch.Tensor, segments: ExpertSegments, pair_weight_N: torch.Tensor, gate_up_proj_L2IH: torch.Tensor, down_proj_LHI: torch.Tensor
) -> None:
    """The shapes, dtypes and devices of an expert computation's inputs agree (never values: reading them would
    synchronise with the device), else a `ValueError` naming the input and the shape it must have: every backend
    checks this, the Triton ones with more (`triton_expert_mlp.check_inputs`)."""
    if x_RH.dim() != 2:
        raise ValueError(f"x_RH must be [R, H], got shape {tuple(x_RH.shape)}")
    rows, hidden = x_RH.shape
    if rows != segments.num_rows:
        raise ValueError(f"x_RH has {rows} rows but segments.num_rows is {segments.num_rows}; they must be equal")
    if gate_up_proj_L2IH.dim() != 3 or gate_up_proj_L2IH.shape[2] != hidden or gate_up_proj_L2IH.shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [L, 2I, H={hidden}], got shape {tuple(gate_up_proj_L2IH.shape)}")
    num_experts, intermediate = gate_up_proj_L2IH.shape[0], gate_up_proj_L2IH.shape[1] // 2
    if tuple(down_proj_LHI.shape) != (num_experts, hidden, intermediate):
        raise ValueError(
            f"down_proj must be [L, H, I] = {[num_experts, hidden, intermediate]} to match gate_up_proj, "
            f"got {list(down_proj_LHI.shape)}"
        )
    if segments.num_local_experts != num_experts:
        raise ValueError(
            f"segments.expert_offsets describes {segments.num_local_experts} local experts but the weights hold {num_experts}"
        )
    if tuple(pair_weight_N.shape) != (segments.num_pairs,):
        raise ValueError(f"pair_weight_N must be [N={segments.num_pairs}], got shape {tuple(pair_weight_N.shape)}")
    for name, tensor in (("gate_up_proj", gate_up_proj_L2IH), ("down_proj", down_proj_LHI)):
        if tensor.dtype != x_RH.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from x_RH dtype {x_RH.dtype}; cast one of them")
    for name, tensor in (("segments.pair_row", segments.pair_row), ("segments.expert_offsets", segments.expert_offsets)):
        if tensor.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {tensor.dtype}")
    tensors = {
        "x_RH": x_RH, "pair_weight_N": pair_weight_N, "gate_up_proj": gate_up_proj_L2IH, "down_proj": down_proj_LHI,
        "segments.pair_row": segments.pair_row, "segments.expert_offsets": segments.expert_offsets,
    }  # fmt: skip
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def sort_by_group(group_N: torch.Tensor, num_groups: int, minor_N: torch.Tensor | None = None, minor_range: int = 1):
    """`(order_N, offsets, minor_sorted_N)`: the stable order of the pairs by (group, minor), the `[num_groups + 1]`
    offsets of each group in it (pairs whose group id is `num_groups` sort after the last group, outside every
    range), and the minor keys in that order (None without `minor_N`). One Triton program where Triton runs on these
    tensors and the layout is small (`triton_layout.fits_one_program`), torch's sort elsewhere; under
    `torch.compile` the operator `occult::sort_by_group`, which makes the same choice when it runs. Group ids must lie
    in [0, num_groups] and minor keys in [0, minor_range) (not checked: reading them would synchronise)."""
    if torch.compiler.is_compiling():
        order_N, offsets, minor_sorted_N = torch.ops.occult.sort_by_group(group_N, num_groups, minor_N, minor_range)
        return order_N, offsets, None if minor_N is None else minor_sorted_N
    return _sort_by_group(group_N, num_groups, minor_N, minor_range, separate=False)


def _sort_by_group(group_N, num_groups, minor_N, minor_range, separate: bool):
    """`sort_by_group` without the operator (`separate`: outputs that do not share one allocation)."""
    if group_N.shape[0] and triton_runs_on(group_N):
        from . import triton_layout

        if triton_layout.fits_one_program(group_N.shape[0], num_groups):
            return triton_layout.sort_by_group(group_N, num_groups, minor_N, minor_range, separate=separate)
    return sort_by_group_torch(group_N, num_groups, minor_N, minor_range)


def sort_by_group_torch(group_N: torch.Tensor, num_groups: int, minor_N: torch.Tensor | None = None, minor_range: int = 1):
    """`sort_by_group` by torch (its specification, and the path for large layouts and CPU tensors): a stable sort
    of key = group * minor_range + minor, in 32 bits wherever it fits (a radix sort of 32-bit keys takes half the
    passes of 64-bit ones); the offsets are a binary search of the sorted keys (no histogram, no host read of a
    maximum)."""
    key_dtype = torch.int32 if (num_groups + 1) * minor_range < 2**31 else torch.int64
    if minor_N is None:
        key_N = group_N.to(key_dtype)
    else:
        key_N = torch.add(minor_N.to(torch.int64), group_N.to(torch.int64), alpha=minor_range).to(key_dtype)
    key_sorted_N, order_N = torch.sort(key_N, stable=True)
    bounds = torch.arange(0, (num_groups + 1) * minor_range, minor_range, dtype=key_dtype, device=group_N.device)
    minor_sorted_N = None if minor_N is None else minor_N.to(torch.int64)[order_N]
    return order_N, torch.searchsorted(key_sorted_N, bounds), minor_sorted_N


def row_index(pair_row_N: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(row_pairs_N, row_offsets)`: the row -> pairs CSR the row reductions read, on the device: pairs sorted by row
    (stable: pair order within a row) and `row_offsets` `[R + 1]` (pairs past the segments, whose row is R, fall
    outside every row's range). `sort_by_group` by row (searchsorted instead of bincount, which would synchronise)."""
    row_pairs_N, row_offsets, _ = sort_by_group(pair_row_N, num_rows)
    return row_pairs_N, row_offsets


@torch.library.custom_op("occult::sort_by_group", mutates_args=())
def _sort_by_group_op(
    group_N: torch.Tensor, num_groups: int, minor_N: torch.Tensor | None, minor_range: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sort_by_group` as one operator; without `minor_N` the third output is empty (an operator returns tensors)."""
    order_N, offsets, minor_sorted_N = _sort_by_group(group_N, num_groups, minor_N, minor_range, separate=True)
    return order_N, offsets, group_N.new_empty(0, dtype=torch.int64) if minor_sorted_N is None else minor_sorted_N


@_sort_by_group_op.register_fake
def _(group_N, num_groups, minor_N, minor_range):
    num_pairs = group_N.shape[0]
    return (
        group_N.new_empty(num_pairs, dtype=torch.int64),
        group_N.new_empty(num_groups + 1, dtype=torch.int64),
        group_N.new_empty(0 if minor_N is None else num_pairs, dtype=torch.int64),
    )


def _topk_layout(topk_ids_Tk, topk_weights_Tk, num_experts, separate: bool = False):
    """`(weight_N, pair_row_N, expert_offsets, row_pairs_N, row_offsets, order_N)` by `triton_layout.topk_layout`."""
    from .triton_layout import topk_layout

    order_N, pair_row_N, weight_N, offsets, row_pairs_N, row_offsets = topk_layout(
        topk_ids_Tk, num_experts, topk_weights_Tk, separate=separate
    )
    return weight_N, pair_row_N, offsets, row_pairs_N, row_offsets, order_N


def topk_layout_torch(topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor, num_experts: int):
    """`_topk_layout`'s six tensors by torch (the specification of `triton_layout.topk_layout`): `from_topk_ids`'
    segments, the weights in segment order, each token's k places in ascending order and their offsets (t k)."""
    num_tokens, top_k = topk_ids_Tk.shape
    segments, order_N = ExpertSegments.from_topk_ids(topk_ids_Tk, num_experts)
    place_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.shape[0], device=order_N.device))
    row_pairs_N = place_N.view(num_tokens, top_k).sort(dim=1).values.reshape(-1)
    row_offsets = torch.arange(num_tokens + 1, device=order_N.device) * top_k
    weight_N = topk_weights_Tk.reshape(-1)[order_N]
    return weight_N, segments.pair_row, segments.expert_offsets, row_pairs_N, row_offsets, order_N


def _weights_grad(grad_weight_N: torch.Tensor | None, order_N: torch.Tensor, weights_shape) -> torch.Tensor | None:
    """The routing weights' gradient from their segment-order one: the layout is a permutation of the pairs, so each
    pair's gradient goes back to its top-k place (one `index_copy_`, no accumulation)."""
    if grad_weight_N is None:
        return None
    grad_Tk = grad_weight_N.new_empty(weights_shape)
    return grad_Tk.view(-1).index_copy_(0, order_N, grad_weight_N).view(weights_shape)


class _TopkLayout(torch.autograd.Function):
    """`_topk_layout` with the weights' gradient (`_weights_grad`), for eager calls."""

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
        return _weights_grad(grad_weight_N, order_N, ctx.weights_shape), None, None


@torch.library.custom_op("occult::topk_layout", mutates_args=())
def _topk_layout_op(
    topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`from_topk`'s layout as one operator: the Triton kernels where `topk_kernel_applies`, else `topk_layout_torch`."""
    if topk_kernel_applies(topk_ids_Tk, num_experts):
        return _topk_layout(topk_ids_Tk, topk_weights_Tk, num_experts, separate=True)
    return topk_layout_torch(topk_ids_Tk, topk_weights_Tk, num_experts)


@_topk_layout_op.register_fake
def _(topk_ids_Tk, topk_weights_Tk, num_experts):
    num_tokens, top_k = topk_ids_Tk.shape
    num_pairs = num_tokens * top_k
    index = [topk_ids_Tk.new_empty(size, dtype=torch.int64) for size in (num_pairs, num_experts + 1, num_pairs, num_tokens + 1, num_pairs)]
    return topk_weights_Tk.new_empty(num_pairs), *index


def _topk_layout_setup(ctx, inputs, output):
    ctx.save_for_backward(output[-1])
    ctx.weights_shape = inputs[1].shape


def _topk_layout_backward(ctx, grad_weight_N, *_):
    (order_N,) = ctx.saved_tensors
    return None, _weights_grad(grad_weight_N, order_N, ctx.weights_shape), None


_topk_layout_op.register_autograd(_topk_layout_backward, setup_context=_topk_layout_setup)


def topk_kernel_applies(topk_ids_Tk: torch.Tensor, num_experts: int) -> bool:
    """Whether `from_topk` takes the Triton layout (`triton_layout.topk_layout`): Triton runs on the routing (CUDA, or
    the interpreter), a non-empty routing over at most `triton_layout.TOPK_MAX_EXPERTS` experts."""
    if topk_ids_Tk.numel() == 0 or not triton_runs_on(topk_ids_Tk):
        return False
    from .triton_layout import TOPK_MAX_EXPERTS

    return num_experts <= TOPK_MAX_EXPERTS


__all__ = ["ExpertSegments", "row_index", "sort_by_group", "sort_by_group_torch", "topk_kernel_applies", "topk_layout_torch"]
