"""Small layouts in one Triton program: the stable sort of pairs by a group id and the group offsets.

Shape legend: N pairs, G groups (local experts, or received rows), local to this file.

The layout of the expert computation sorts pairs twice on the device: by (local expert, row) to make the
expert segments (`ExpertSegments.from_pairs`), and by row to make the row -> pairs index that the row
reduction reads (`triton_expert_mlp._row_index`). With torch each is a sort (several kernels), an
arange and a binary search, plus casts: at small T (a few thousand pairs) these launches are a visible
part of a call that the host's launch rate bounds (docs/bench_experts_h200.md). Up to `MAX_PAIRS` pairs
one program does the whole of one: it packs each pair's sort key with its index into one int64 (so a
plain bitonic sort is stable and yields the permutation), sorts in registers, and finds every group's
offset by a binary search of the sorted group ids, all groups at once. Larger layouts keep torch's
sort, whose throughput one program cannot match.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import launch

#: most pairs (and groups) one program sorts; above it the callers use torch's sort. One program runs on one
#: multiprocessor and a bitonic sort does N log^2 N work: on the H200 (2026-12-01 04:17 UTC, profiler, OLMoE
#: k = 8) a sort took 17 us at 1024 pairs (T = 128, hidden behind the host's launches) but 275 us at 8192
#: (T = 1024: 0.55 ms of a 0.92 ms forward, where torch's sort takes tens of microseconds)
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


def fits_one_program(num_pairs: int, num_groups: int) -> bool:
    """Whether `sort_by_group` takes this layout (at most `MAX_PAIRS` pairs and fewer groups)."""
    return num_pairs <= MAX_PAIRS and num_groups < MAX_PAIRS


def sort_by_group(group_N: torch.Tensor, num_groups: int, minor_N: torch.Tensor | None = None, minor_range: int = 1):
    """`(order_N, offsets, minor_sorted_N)`: the stable order of the pairs by (group, minor), the
    `[num_groups + 1]` offsets of each group in it (pairs whose group id is `num_groups` sort after the
    last group, outside every range), and the minor keys in that order (None without `minor_N`).
    One program; only for `fits_one_program` sizes. Group ids must lie in [0, num_groups] and minor keys
    in [0, minor_range) (not checked: reading them would synchronise)."""
    num_pairs = group_N.shape[0]
    if not fits_one_program(num_pairs, num_groups):
        raise ValueError(
            f"sort_by_group sorts at most MAX_PAIRS={MAX_PAIRS} pairs into fewer groups in one program; "
            f"got {num_pairs} pairs and {num_groups} groups"
        )
    block_n = max(16, 1 << (num_pairs - 1).bit_length())
    device = group_N.device
    order_N = torch.empty(num_pairs, dtype=torch.int64, device=device)
    offsets = torch.empty(num_groups + 1, dtype=torch.int64, device=device)
    minor_sorted_N = None if minor_N is None else torch.empty(num_pairs, dtype=torch.int64, device=device)
    group_sorted_N = torch.empty(num_pairs, dtype=torch.int64, device=device)
    launch(
        sort_by_group_kernel, (1,),
        group_N, group_N if minor_N is None else minor_N, num_pairs, minor_range, num_groups,
        order_N, offsets, group_sorted_N if minor_sorted_N is None else minor_sorted_N, group_sorted_N,
        HAS_MINOR=minor_N is not None, BLOCK_N=block_n, BLOCK_G=max(32, 1 << num_groups.bit_length()),
        INDEX_BITS=block_n.bit_length() - 1, num_warps=8 if block_n >= 4096 else 4,
    )  # fmt: skip
    return order_N, offsets, minor_sorted_N


__all__ = ["MAX_PAIRS", "fits_one_program", "sort_by_group"]
