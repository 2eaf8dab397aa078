"""Small layouts in one Triton program: the stable sort of pairs by a group id and the group offsets.

Shape legend: N pairs, T tokens, k experts per token, E experts; local to this file: G groups (local experts,
or received rows), X the pairs one program of `topk_layout_kernel` places.

The layout of the expert computation sorts pairs twice on the device: by (local expert, row) to make the expert
segments (`ExpertSegments.from_pairs`), and by row to make the row -> pairs index that the row reduction reads
(`layout.row_index`). With torch each is a sort (several kernels), an arange and a binary search, plus casts: at
small T these launches are a visible part of a call that the host's launch rate bounds. Up to `MAX_PAIRS` pairs one
program does the whole of one: it packs each pair's sort key with its index into one int64 (so a plain bitonic sort
is stable and yields the permutation), sorts in registers, and finds every group's offset by a binary search of the
sorted group ids, all groups at once. Larger layouts keep torch's sort, whose throughput one program cannot match.

Routing straight from a top-k (`ExpertSegments.from_topk`: pair i is token i // k's slot i % k, so the pairs come in
row order) needs no comparison sort: a stable counting sort by expert keeps rows ascending within an expert.
`topk_layout_kernel` places the pairs of `TOPK_ROWS` tokens a program: it needs, per expert, all its pairs (the
segment offsets) and those before its own first pair (its start in each segment), ranks its own pairs among equal
experts, and writes their places, rows and weights in segment order; the row -> pairs index needs only each row's k
places in ascending order, a sort of k values. Where that is cheap (`one_launch`) each program counts those over all
pairs itself: one launch. Counting all pairs in every program grows as N^2 (and as E: one counting step holds
[256, E] compares), so elsewhere two small launches come first: `topk_count_kernel` counts each program's pairs
per expert and `topk_scan_kernel` turns the counts into each program's pairs before it (an exclusive prefix over
the programs) and the totals, which the placing programs then read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import launch
from .triton_support import cdiv, next_power_of_2

#: most pairs (and groups) one program sorts; above it the callers use torch's sort. One program runs on one
#: multiprocessor and a bitonic sort does N log^2 N work: at 1024 pairs it hides behind the host's launches, at
#: 8192 it takes several times torch's sort (docs/kernels.md)
MAX_PAIRS = 1024


@triton.jit
def sort_by_group_kernel(
    group_ptr,  # [N] group id of each pair, in [0, num_groups]
    minor_ptr,  # [N] secondary key in [0, minor_range) (HAS_MINOR), else unused
    num_pairs,
    minor_range,
    num_groups,
    order_ptr,  # [N] int64 out: pair indices sorted by (group, minor, index)
    offsets_ptr,  # [num_groups + 1] int64 out: the number of pairs with a group id below g
    minor_sorted_ptr,  # [N] int64 out when HAS_MINOR: the minor keys in sorted order
    group_sorted_ptr,  # [N] int64 scratch: the group ids in sorted order
    HAS_MINOR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # > num_groups
    INDEX_BITS: tl.constexpr,  # log2(BLOCK_N)
):
    i = tl.arange(0, BLOCK_N)
    valid = i < num_pairs
    key = tl.load(group_ptr + i, mask=valid, other=0).to(tl.int64)
    if HAS_MINOR:
        key = key * minor_range + tl.load(minor_ptr + i, mask=valid, other=0).to(tl.int64)
    # (key, index) in one int64: equal keys keep their index order, so the sort is stable
    packed = tl.sort(tl.where(valid, (key << INDEX_BITS) | i.to(tl.int64), 0x7FFFFFFFFFFFFFFF))
    tl.store(order_ptr + i, packed & ((1 << INDEX_BITS) - 1), mask=valid)
    key = packed >> INDEX_BITS
    if HAS_MINOR:
        tl.store(minor_sorted_ptr + i, key % minor_range, mask=valid)
        key = key // minor_range
    tl.store(group_sorted_ptr + i, key, mask=valid)
    tl.debug_barrier()  # the sorted group ids, stored by every thread, are read back by every thread
    # offsets[g] = lower bound of g in the sorted group ids: a binary search per group, all at once
    groups = tl.arange(0, BLOCK_G)
    low = tl.zeros((BLOCK_G,), dtype=tl.int32)
    high = tl.zeros((BLOCK_G,), dtype=tl.int32) + num_pairs
    for _ in tl.static_range(INDEX_BITS + 1):
        active = low < high
        middle = (low + high) // 2
        below = active & (tl.load(group_sorted_ptr + middle, mask=active, other=0) < groups)
        low = tl.where(below, middle + 1, low)
        high = tl.where(active & ~below, middle, high)
    tl.store(offsets_ptr + groups, low.to(tl.int64), mask=groups <= num_groups)


def _index_tensors(sizes: tuple[int, ...], device: torch.device, separate: bool) -> list[torch.Tensor]:
    """int64 tensors of these sizes: consecutive views of one allocation, or (`separate`) one allocation each."""
    if separate:
        return [torch.empty(size, dtype=torch.int64, device=device) for size in sizes]
    index = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    return list(index.split(sizes))


def fits_one_program(num_pairs: int, num_groups: int) -> bool:
    """Whether `sort_by_group` takes this layout (at most `MAX_PAIRS` pairs and fewer groups)."""
    return num_pairs <= MAX_PAIRS and num_groups < MAX_PAIRS


def sort_by_group(
    group_N: torch.Tensor, num_groups: int, minor_N: torch.Tensor | None = None, minor_range: int = 1, *, separate: bool = False
):
    """`layout.sort_by_group` (same arguments and outputs) in one program; only for `fits_one_program` sizes. The
    outputs are views of one allocation (each `torch.empty` is host time at small T), or, with `separate`, tensors
    of their own (what a custom operator must return: its outputs may not alias one another)."""
    num_pairs = group_N.shape[0]
    if not fits_one_program(num_pairs, num_groups):
        raise ValueError(
            f"sort_by_group sorts at most MAX_PAIRS={MAX_PAIRS} pairs into fewer groups in one program; "
            f"got {num_pairs} pairs and {num_groups} groups"
        )
    block_n = max(16, next_power_of_2(num_pairs))
    order_N, group_sorted_N, offsets, minor_sorted_N = _index_tensors(
        (num_pairs, num_pairs, num_groups + 1, 0 if minor_N is None else num_pairs), group_N.device, separate
    )
    minor_sorted_N = None if minor_N is None else minor_sorted_N
    launch(
        sort_by_group_kernel, (1,),
        group_N, group_N if minor_N is None else minor_N, num_pairs, minor_range, num_groups,
        order_N, offsets, group_sorted_N if minor_sorted_N is None else minor_sorted_N, group_sorted_N,
        HAS_MINOR=minor_N is not None, BLOCK_N=block_n, BLOCK_G=max(32, next_power_of_2(num_groups + 1)),
        INDEX_BITS=block_n.bit_length() - 1, num_warps=8 if block_n >= 4096 else 4,
    )  # fmt: skip
    return order_N, offsets, minor_sorted_N


#: most pairs x BLOCK_E for which every program of `topk_layout_kernel` counts all pairs itself (one launch);
#: beyond it, or above `TOPK_ONE_LAUNCH_BLOCK_E`, `topk_count_kernel` and `topk_scan_kernel` count first: every
#: program counting all pairs costs N^2 work, which the three launches avoid (docs/kernels.md)
TOPK_ONE_LAUNCH_WORK = 1 << 20
#: widest expert block the one launch takes (its [256, BLOCK_E] counting step spills above it)
TOPK_ONE_LAUNCH_BLOCK_E = 256
#: most experts `topk_layout` takes (the GPU tests run 60, 64, 128 and 256); the count kernel holds [16 k, BLOCK_E]
#: compares a program. Layers with more experts keep torch's sort
TOPK_MAX_EXPERTS = 256
#: tokens a program of `topk_layout_kernel` places (its pairs are ranked by a [k R, k R] comparison)
TOPK_ROWS = 16
#: pairs a step of the counting loop reads
_COUNT_BLOCK = 256
#: programs' counts a step of `topk_scan_kernel` reads, and the experts one of its programs scans
_SCAN_PROGRAMS, _SCAN_EXPERTS = 256, 16


@triton.jit
def _program_pairs(num_tokens, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's pairs as [ROWS, K_BLOCK] (token, slot) tiles: their indices and which exist."""
    row_Tk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None] + tl.zeros((1, K_BLOCK), dtype=tl.int32)
    slot_Tk = tl.arange(0, K_BLOCK)[None, :] + tl.zeros((ROWS, 1), dtype=tl.int32)
    return row_Tk.to(tl.int64) * TOP_K + slot_Tk, (row_Tk < num_tokens) & (slot_Tk < TOP_K)


@triton.jit(do_not_specialize=["num_tokens"])
def topk_count_kernel(
    ids_ptr,  # [T * k] expert of each pair
    num_tokens,
    counts_ptr,  # [programs + 1, BLOCK_E] int32 out: row p, program p's pairs per expert
    TOP_K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pair_Tk, valid_Tk = _program_pairs(num_tokens, TOP_K, K_BLOCK, ROWS)
    expert_Tk = tl.load(ids_ptr + pair_Tk, mask=valid_Tk, other=-1).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    hit = tl.reshape(expert_Tk, (ROWS * K_BLOCK,))[:, None] == experts[None, :]
    tl.store(counts_ptr + tl.program_id(0) * BLOCK_E + experts, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def topk_scan_kernel(
    counts_ptr,  # [programs + 1, BLOCK_E] int32: in, each program's counts; out, the counts before it (row
    #              num_programs: the totals)
    num_programs,
    BLOCK_E: tl.constexpr,
    SCAN_PROGRAMS: tl.constexpr,
    SCAN_EXPERTS: tl.constexpr,
):
    experts = tl.program_id(0) * SCAN_EXPERTS + tl.arange(0, SCAN_EXPERTS)
    carry = tl.zeros((SCAN_EXPERTS,), dtype=tl.int32)
    for start in range(0, num_programs, SCAN_PROGRAMS):
        programs = start + tl.arange(0, SCAN_PROGRAMS)
        ptrs = counts_ptr + programs[:, None] * BLOCK_E + experts[None, :]
        mask = (programs < num_programs)[:, None]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + carry[None, :], mask=mask)
        carry += tl.sum(counts, axis=0)
    tl.store(counts_ptr + num_programs * BLOCK_E + experts, carry)


@triton.jit(do_not_specialize=["num_tokens"])  # read as a tensor value, never as the constant 1
def topk_layout_kernel(
    ids_ptr,  # [T * k] expert of each pair (pair i: token i // k), in [0, num_experts)
    weights_ptr,  # [T * k] routing weight of each pair
    num_tokens,
    num_experts,
    order_ptr,  # [N] int64 out: the pair (index into ids) at each place of the segment order
    pair_row_ptr,  # [N] int64 out: its token
    weight_out_ptr,  # [N] out: its weight
    offsets_ptr,  # [num_experts + 1] int64 out: each expert's first place
    row_pairs_ptr,  # [N] int64 out: each token's k places, ascending
    row_offsets_ptr,  # [T + 1] int64 out: token t's places are row_pairs[t k : t k + k]
    counts_ptr,  # [programs + 1, BLOCK_E] int32 from `topk_scan_kernel` (COUNTED)
    TOP_K: tl.constexpr,
    K_BLOCK: tl.constexpr,  # next power of two >= TOP_K
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two > num_experts
    COUNT_BLOCK: tl.constexpr,
    COUNTED: tl.constexpr,  # each program's pairs before it and the totals are given (`counts_ptr`)
):
    PAIRS_X: tl.constexpr = ROWS * K_BLOCK
    num_pairs = num_tokens * TOP_K
    pair_Tk, valid_Tk = _program_pairs(num_tokens, TOP_K, K_BLOCK, ROWS)
    pair_X = tl.reshape(pair_Tk, (PAIRS_X,))
    valid_X = tl.reshape(valid_Tk, (PAIRS_X,))
    expert_X = tl.load(ids_ptr + pair_X, mask=valid_X, other=0).to(tl.int32)
    # per expert: all its pairs, and those before this program's first pair
    experts = tl.arange(0, BLOCK_E)
    if COUNTED:
        before_E = tl.load(counts_ptr + tl.program_id(0) * BLOCK_E + experts)
        total_E = tl.load(counts_ptr + tl.num_programs(0) * BLOCK_E + experts)
    else:
        first_pair = tl.program_id(0).to(tl.int64) * ROWS * TOP_K
        total_E = tl.zeros((BLOCK_E,), dtype=tl.int32)
        before_E = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for start in range(0, num_pairs, COUNT_BLOCK):
            i = start + tl.arange(0, COUNT_BLOCK)
            ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1).to(tl.int32)
            hit = (ids[:, None] == experts[None, :]).to(tl.int32)
            total_E += tl.sum(hit, axis=0)
            before_E += tl.sum(hit * (i < first_pair).to(tl.int32)[:, None], axis=0)
    ends_E = tl.cumsum(total_E, axis=0)
    # place = the expert's first place + its pairs before this program + earlier pairs of it in this program
    start_E = ends_E - total_E + before_E
    same_XX = (expert_X[:, None] == expert_X[None, :]) & valid_X[None, :]
    earlier_XX = tl.arange(0, PAIRS_X)[None, :] < tl.arange(0, PAIRS_X)[:, None]
    rank_X = tl.sum((same_XX & earlier_XX).to(tl.int32), axis=1)
    place_X = tl.sum(tl.where(expert_X[:, None] == experts[None, :], start_E[None, :], 0), axis=1) + rank_X
    place_X = place_X.to(tl.int64)
    tl.store(order_ptr + place_X, pair_X, mask=valid_X)
    tl.store(pair_row_ptr + place_X, pair_X // TOP_K, mask=valid_X)
    tl.store(weight_out_ptr + place_X, tl.load(weights_ptr + pair_X, mask=valid_X), mask=valid_X)
    # row index: each token's places in ascending order (invalid slots sort last and are not stored)
    place_Tk = tl.sort(tl.where(valid_Tk, tl.reshape(place_X, (ROWS, K_BLOCK)), 0x7FFFFFFFFFFFFFFF), dim=1)
    tl.store(row_pairs_ptr + pair_Tk, place_Tk, mask=valid_Tk)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tl.store(row_offsets_ptr + rows, rows.to(tl.int64) * TOP_K, mask=rows < num_tokens)
    if tl.program_id(0) == 0:
        tl.store(offsets_ptr + 1 + experts, ends_E.to(tl.int64), mask=experts < num_experts)
        tl.store(offsets_ptr, 0)
        tl.store(row_offsets_ptr + num_tokens, num_pairs.to(tl.int64))


def one_launch(num_pairs: int, block_e: int) -> bool:
    """Whether `topk_layout_kernel` counts the pairs itself (one launch) rather than after `topk_count_kernel` and
    `topk_scan_kernel`: few pairs of few experts (`TOPK_ONE_LAUNCH_WORK`, `TOPK_ONE_LAUNCH_BLOCK_E`)."""
    return num_pairs * block_e <= TOPK_ONE_LAUNCH_WORK and block_e <= TOPK_ONE_LAUNCH_BLOCK_E


def topk_layout(topk_ids_Tk: torch.Tensor, num_experts: int, topk_weights_Tk: torch.Tensor, *, separate: bool = False):
    """`(order_N, pair_row_N, weight_N, expert_offsets, row_pairs_N, row_offsets)` of pairs straight from a
    top-k routing (`topk_layout_kernel`). One launch where `one_launch` says, three elsewhere; one int64 buffer
    (with `separate`, a tensor each, as `sort_by_group`). At most `TOPK_MAX_EXPERTS` experts and, per token, all k
    experts in [0, num_experts) (not checked: reading them would synchronise)."""
    num_tokens, top_k = topk_ids_Tk.shape
    num_pairs = num_tokens * top_k
    if num_experts > TOPK_MAX_EXPERTS:
        raise ValueError(
            f"topk_layout places the pairs of at most TOPK_MAX_EXPERTS={TOPK_MAX_EXPERTS} experts; got {num_experts}"
        )
    num_programs = max(1, cdiv(num_tokens, TOPK_ROWS))
    block_e = next_power_of_2(num_experts + 1)
    counted = not one_launch(num_pairs, block_e)
    counts_int64 = cdiv((num_programs + 1) * block_e, 2) if counted else 0  # int32 counts in int64 slots
    sizes = (num_pairs, num_pairs, num_pairs, num_experts + 1, num_tokens + 1, counts_int64)
    order_N, pair_row_N, row_pairs_N, offsets, row_offsets, counts = _index_tensors(sizes, topk_ids_Tk.device, separate)
    counts = counts.view(torch.int32) if counted else order_N
    weight_N = topk_weights_Tk.new_empty(num_pairs)
    ids = topk_ids_Tk.contiguous()
    shape = dict(TOP_K=top_k, K_BLOCK=next_power_of_2(top_k), ROWS=TOPK_ROWS, BLOCK_E=block_e)
    if counted:
        launch(topk_count_kernel, (num_programs,), ids, num_tokens, counts, **shape, num_warps=4)
        scan_experts = min(_SCAN_EXPERTS, block_e)
        launch(
            topk_scan_kernel, (block_e // scan_experts,), counts, num_programs,
            BLOCK_E=block_e, SCAN_PROGRAMS=_SCAN_PROGRAMS, SCAN_EXPERTS=scan_experts, num_warps=4,
        )  # fmt: skip
    launch(
        topk_layout_kernel, (num_programs,), ids, topk_weights_Tk.contiguous(), num_tokens, num_experts,
        order_N, pair_row_N, weight_N, offsets, row_pairs_N, row_offsets, counts,
        **shape, COUNT_BLOCK=_COUNT_BLOCK, COUNTED=counted, num_warps=4,
    )  # fmt: skip
    return order_N, pair_row_N, weight_N, offsets, row_pairs_N, row_offsets


__all__ = [
    "MAX_PAIRS", "TOPK_MAX_EXPERTS", "TOPK_ONE_LAUNCH_BLOCK_E", "TOPK_ONE_LAUNCH_WORK", "fits_one_program",
    "one_launch", "sort_by_group", "topk_layout",
]  # fmt: skip
