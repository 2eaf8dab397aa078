"""The load-aware replica rule's per-pair half (`occult_hf.replicas.routing.load_aware_homes`, steps 1 and 3) in Triton.

Shape legend: see `occult_hf.replicas.routing` (X blocks of `BLOCK_F` flat entries, local here).

In torch the per-pair half is ~78 small operators launched from Python (the preferences, the per-(expert, first
visited home) counts, `_rank_in_group`'s sorts twice, gathers), host time in every eager layer. Here it is four
launches plus two cumsums and three memsets, whatever T, k, E and M:

1. `preferences`: one program per block of tokens finds each pair's first visited home (the homes of the token's
   single-home experts, plus the caller's `devices_TD`) and adds it to the `[E, M + 1]` counts with integer
   atomics (exact and order-free: the same counts as `preference_counts` in any order);
2. a pair's place in its group's line ("the g-th pair of (expert, first visited home)") is its position among the
   earlier entries of its group in entry order, computed as a deterministic blocked scan: each block of `BLOCK_F`
   flat entries counts its entries per group and ranks each entry among the earlier ones of its block (an
   all-pairs comparison within the block), `torch.cumsum` over the blocks gives each block's start per group, and
   the position is that start plus the in-block rank: the same integers as the torch version's stable sort;
3. the same for the pairs that do not stay (ranked per expert), then the pick among the homes by the cumulative
   fractions, in fp64 with the torch version's formulas and no fused multiply-adds.

The torch version (`replicas.routing.TORCH_PAIRS`) stays the reference and the CPU path; on CPU tensors this runs
under `TRITON_INTERPRET=1`.

Under `torch.compile`, `FUSED_PAIRS` calls the custom operators `occult::replica_preferences` (`[T, k]` preferences
and `[E, M + 1]` counts) and `occult::replica_assign` (`[T, k]` devices), which run these kernels where Triton runs
and the torch half elsewhere: every shape follows from the routing's and the home table's.
"""

from __future__ import annotations

import functools

import torch

from occult_hf.replicas.routing import TORCH_PAIRS, PairHalf

from .replica_routes import unfused_options
from .triton_support import cdiv, interpreting, next_power_of_2, require_triton, triton_runs_on

#: tokens one `preferences` program holds, and flat entries one block of the scan ranks ([BLOCK_F, BLOCK_F] compares)
BLOCK_T, BLOCK_F = 64, 128
#: the scan's three stages (one kernel, the stage a constexpr): groups of the visiting pairs; which of them stay, and
#: groups of the rest; the pick
STAGE_VISITING, STAGE_REST, STAGE_PICK = 0, 1, 2


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """`(preferences, line)`, made on first use (one pair per mode: `triton.jit` decides at decoration whether it is
    interpreted). Only Triton builtins (sums as `tl.reduce` with `tl.sum`'s combine function), as in
    `kernels.replica_routes`: the interpreter cannot run Triton's jit helpers after Triton was imported without it."""
    triton = require_triton("the load-aware replica rule's kernels (occult_hf.kernels.replica_pairs)")
    import triton.language as tl

    @triton.jit
    def preferences_kernel(
        ids_ptr, table_ptr, visited_ptr, pref_ptr, counts_ptr, num_tokens, num_devices,
        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, NUM_HOMES: tl.constexpr, HAS_VISITED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        t_T = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j_k = tl.arange(0, BLOCK_K)
        in_T = t_T < num_tokens
        in_Tk = in_T[:, None] & (j_k[None, :] < TOP_K)
        ids_Tk = tl.load(ids_ptr + t_T[:, None] * TOP_K + j_k[None, :], mask=in_Tk, other=0).to(tl.int64)
        pref_Tk = tl.full([BLOCK, BLOCK_K], NUM_HOMES, tl.int64)
        for back in tl.static_range(NUM_HOMES):  # the last home first, so the first visited one is written last
            m = NUM_HOMES - 1 - back
            home_Tk = tl.load(table_ptr + ids_Tk * NUM_HOMES + m, mask=in_Tk, other=-1)
            if HAS_VISITED:
                on_Tk = tl.load(visited_ptr + t_T[:, None] * num_devices + home_Tk, mask=in_Tk & (home_Tk >= 0), other=0) != 0
            else:
                on_Tk = home_Tk < -1
            for j in tl.static_range(TOP_K):  # the token's single-home experts' homes are visited
                e_T = tl.load(ids_ptr + t_T * TOP_K + j, mask=in_T, other=0).to(tl.int64)
                second_T = tl.load(table_ptr + e_T * NUM_HOMES + 1, mask=in_T, other=0)
                first_T = tl.load(table_ptr + e_T * NUM_HOMES, mask=in_T, other=0)
                single_T = tl.where(second_T < 0, first_T, -2)
                on_Tk = on_Tk | (single_T[:, None] == home_Tk)
            pref_Tk = tl.where(on_Tk & (home_Tk >= 0), m, pref_Tk)
        tl.store(pref_ptr + t_T[:, None] * TOP_K + j_k[None, :], pref_Tk, mask=in_Tk)
        tl.atomic_add(counts_ptr + ids_Tk * (NUM_HOMES + 1) + pref_Tk, tl.full([BLOCK, BLOCK_K], 1, tl.int64), mask=in_Tk)

    @triton.jit
    def line_kernel(
        ids_ptr, pref_ptr, table_ptr, visit_rank_ptr, visit_counts_ptr, visit_ends_ptr, offset_ptr, rate_ptr, stays_ptr,
        rest_rank_ptr, rest_counts_ptr, rest_ends_ptr, rest_before_ptr, rest_total_ptr, cumulative_ptr, dest_ptr,
        num_entries, num_experts, NUM_HOMES: tl.constexpr, STAGE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        f_F = block * BLOCK + tl.arange(0, BLOCK)
        in_F = f_F < num_entries
        ids_F = tl.load(ids_ptr + f_F, mask=in_F, other=0).to(tl.int64)
        pref_F = tl.load(pref_ptr + f_F, mask=in_F, other=NUM_HOMES)
        visits_F = in_F & (pref_F < NUM_HOMES)
        visit_group_F = ids_F * NUM_HOMES + tl.minimum(pref_F, NUM_HOMES - 1)
        if STAGE == 0:
            group_F = tl.where(visits_F, visit_group_F, -1)
            num_groups = num_experts * NUM_HOMES
            rank_ptr, counts_ptr = visit_rank_ptr, visit_counts_ptr
        elif STAGE == 1:
            # a visiting pair's place in its (expert, first visited home) line: its block's start plus its rank
            at_F = block * num_experts * NUM_HOMES + visit_group_F
            line_F = tl.load(visit_ends_ptr + at_F, mask=visits_F, other=0) - tl.load(visit_counts_ptr + at_F, mask=visits_F, other=0)
            line_F = (line_F + tl.load(visit_rank_ptr + f_F, mask=visits_F, other=0)).to(tl.int64)
            line_F += tl.load(offset_ptr + visit_group_F, mask=visits_F, other=0)
            rate_F = tl.load(rate_ptr + visit_group_F, mask=visits_F, other=0.0)
            after_F = tl.floor((line_F + 1).to(tl.float64) * rate_F + 0.5)
            stays_F = visits_F & (after_F > tl.floor(line_F.to(tl.float64) * rate_F + 0.5))
            tl.store(stays_ptr + f_F, stays_F.to(tl.int8), mask=in_F)
            group_F = tl.where(in_F & ~stays_F, ids_F, -1)
            num_groups = num_experts
            rank_ptr, counts_ptr = rest_rank_ptr, rest_counts_ptr
        if STAGE < 2:
            # each entry's rank among the earlier entries of its group in this block; the first writes the count
            i_F = tl.arange(0, BLOCK)
            same_FF = (group_F[:, None] == group_F[None, :]) & (group_F[:, None] >= 0)
            earlier_FF = same_FF & (i_F[None, :] < i_F[:, None])
            rank_F = tl.reduce(earlier_FF.to(tl.int32), 1, tl.standard._sum_combine)
            count_F = tl.reduce(same_FF.to(tl.int32), 1, tl.standard._sum_combine)
            tl.store(rank_ptr + f_F, rank_F, mask=group_F >= 0)
            tl.store(counts_ptr + block * num_groups + group_F, count_F, mask=(group_F >= 0) & (rank_F == 0))
        else:
            # the rest of an expert's pairs, by their place in its line, over the cumulative fractions of its homes
            stays_F = tl.load(stays_ptr + f_F, mask=in_F, other=0) != 0
            rest_F = in_F & ~stays_F
            at_F = block * num_experts + ids_F
            line_F = tl.load(rest_ends_ptr + at_F, mask=rest_F, other=0) - tl.load(rest_counts_ptr + at_F, mask=rest_F, other=0)
            line_F = (line_F + tl.load(rest_rank_ptr + f_F, mask=rest_F, other=0)).to(tl.int64)
            line_F += tl.load(rest_before_ptr + ids_F, mask=rest_F, other=0)
            total_F = tl.maximum(tl.load(rest_total_ptr + ids_F, mask=rest_F, other=1), 1)
            position_F = (line_F.to(tl.float64) + 0.5) / total_F.to(tl.float64)
            pick_F = tl.full([BLOCK], 0, tl.int64)
            homes_F = tl.full([BLOCK], 0, tl.int64)
            for m in tl.static_range(NUM_HOMES):
                cumulative_F = tl.load(cumulative_ptr + ids_F * NUM_HOMES + m, mask=rest_F, other=0.0)
                pick_F += (position_F >= cumulative_F).to(tl.int64)
                homes_F += (tl.load(table_ptr + ids_F * NUM_HOMES + m, mask=in_F, other=-1) >= 0).to(tl.int64)
            choice_F = tl.where(stays_F, pref_F, tl.minimum(pick_F, homes_F - 1))
            tl.store(dest_ptr + f_F, tl.load(table_ptr + ids_F * NUM_HOMES + choice_F, mask=in_F, other=0), mask=in_F)

    return preferences_kernel, line_kernel


def fused_preferences_and_counts(
    topk_ids_Tk: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, devices_TD: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pref_Tk, counts_EM1)`: `replica_preferences`' `pref_Tk` and `preference_counts` of it, in one launch (and
    the counts' memset)."""
    ids_Tk = topk_ids_Tk.contiguous()
    table_EM = home_table_EM.long().contiguous()
    (num_tokens, top_k), (num_experts, num_homes) = ids_Tk.shape, table_EM.shape
    if num_homes < 2:
        raise ValueError(f"fused_preferences_and_counts: the home table [{num_experts}, {num_homes}] has no replicas (M < 2)")
    pref_Tk = torch.empty(num_tokens, top_k, dtype=torch.int64, device=ids_Tk.device)
    counts_EM1 = torch.zeros(num_experts, num_homes + 1, dtype=torch.int64, device=ids_Tk.device)
    visited = pref_Tk if devices_TD is None else devices_TD.to(torch.bool).contiguous().view(torch.uint8)
    interpret = interpreting()
    _kernels(interpret)[0][(cdiv(num_tokens, BLOCK_T),)](
        ids_Tk, table_EM, visited, pref_Tk, counts_EM1, num_tokens, num_devices, TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k), NUM_HOMES=num_homes, HAS_VISITED=devices_TD is not None, BLOCK=BLOCK_T,
        **unfused_options(interpret, num_warps=4),
    )  # fmt: skip
    return pref_Tk, counts_EM1


def fused_assign(
    topk_ids_Tk: torch.Tensor, pref_Tk: torch.Tensor, home_table_EM: torch.Tensor, tables: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """`[T, k]` int64 serving device of each pair from the per-expert half's `tables` (`replicas.routing.assign_pairs`):
    three launches of the blocked scan, two cumsums over the blocks and two memsets."""
    ids_F, pref_F = topk_ids_Tk.reshape(-1).contiguous(), pref_Tk.reshape(-1).contiguous()
    table_EM = home_table_EM.long().contiguous()
    num_experts, num_homes = table_EM.shape
    num_entries, device = ids_F.shape[0], ids_F.device
    num_blocks = max(cdiv(num_entries, BLOCK_F), 1)
    stay_EM, offset_EM, rest_before_E, rest_total_E, cumulative_EM = (t.contiguous() for t in tables)
    visit_rank_F, rest_rank_F = (torch.empty(num_entries, dtype=torch.int32, device=device) for _ in range(2))
    visit_counts_XEM = torch.zeros(num_blocks, num_experts, num_homes, dtype=torch.int32, device=device)
    rest_counts_XE = torch.zeros(num_blocks, num_experts, dtype=torch.int32, device=device)
    stays_F = torch.empty(num_entries, dtype=torch.int8, device=device)
    dest_F = torch.empty(num_entries, dtype=torch.int64, device=device)
    interpret = interpreting()
    line = _kernels(interpret)[1]

    def launch(stage, visit_ends, rest_ends):
        line[(num_blocks,)](
            ids_F, pref_F, table_EM, visit_rank_F, visit_counts_XEM, visit_ends, offset_EM, stay_EM, stays_F, rest_rank_F,
            rest_counts_XE, rest_ends, rest_before_E, rest_total_E, cumulative_EM, dest_F, num_entries, num_experts,
            NUM_HOMES=num_homes, STAGE=stage, BLOCK=BLOCK_F, **unfused_options(interpret, num_warps=4),
        )  # fmt: skip

    launch(STAGE_VISITING, visit_counts_XEM, rest_counts_XE)  # the ends are not read yet
    visit_ends_XEM = torch.cumsum(visit_counts_XEM, 0, dtype=torch.int32)
    launch(STAGE_REST, visit_ends_XEM, rest_counts_XE)
    launch(STAGE_PICK, visit_ends_XEM, torch.cumsum(rest_counts_XE, 0, dtype=torch.int32))
    return dest_F.view(topk_ids_Tk.shape)


def _preferences_and_counts(topk_ids_Tk, home_table_EM, num_devices, devices_TD=None):
    """The kernel where Triton runs, else the torch reference; under `torch.compile` the operator."""
    if torch.compiler.is_compiling():
        return torch.ops.occult.replica_preferences(topk_ids_Tk, home_table_EM, num_devices, devices_TD)
    return _preferences_impl(topk_ids_Tk, home_table_EM, num_devices, devices_TD)


def _preferences_impl(topk_ids_Tk, home_table_EM, num_devices, devices_TD):
    step = fused_preferences_and_counts if triton_runs_on(topk_ids_Tk) else TORCH_PAIRS.preferences_and_counts
    return step(topk_ids_Tk, home_table_EM, num_devices, devices_TD)


def _assign(topk_ids_Tk, pref_Tk, home_table_EM, tables):
    """The kernels where Triton runs, else the torch reference; under `torch.compile` the operator."""
    if torch.compiler.is_compiling():
        return torch.ops.occult.replica_assign(topk_ids_Tk, pref_Tk, home_table_EM, *tables)
    return _assign_impl(topk_ids_Tk, pref_Tk, home_table_EM, tables)


def _assign_impl(topk_ids_Tk, pref_Tk, home_table_EM, tables):
    return (fused_assign if triton_runs_on(topk_ids_Tk) else TORCH_PAIRS.assign)(topk_ids_Tk, pref_Tk, home_table_EM, tables)


@torch.library.custom_op("occult::replica_preferences", mutates_args=())
def _preferences_op(
    topk_ids_Tk: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, devices_TD: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pref_Tk, counts_EM1)`: step 1 of the rule as one operator."""
    return _preferences_impl(topk_ids_Tk, home_table_EM, num_devices, devices_TD)


@_preferences_op.register_fake
def _(topk_ids_Tk, home_table_EM, num_devices, devices_TD):
    num_experts, num_homes = home_table_EM.shape
    return topk_ids_Tk.new_empty(topk_ids_Tk.shape, dtype=torch.int64), topk_ids_Tk.new_empty(num_experts, num_homes + 1, dtype=torch.int64)


@torch.library.custom_op("occult::replica_assign", mutates_args=())
def _assign_op(
    topk_ids_Tk: torch.Tensor,
    pref_Tk: torch.Tensor,
    home_table_EM: torch.Tensor,
    stay_EM: torch.Tensor,
    offset_EM: torch.Tensor,
    rest_before_E: torch.Tensor,
    rest_total_E: torch.Tensor,
    cumulative_EM: torch.Tensor,
) -> torch.Tensor:
    """`[T, k]` serving device of each pair: step 3 of the rule as one operator."""
    tables = (stay_EM, offset_EM, rest_before_E, rest_total_E, cumulative_EM)
    return _assign_impl(topk_ids_Tk, pref_Tk, home_table_EM, tables)


@_assign_op.register_fake
def _(topk_ids_Tk, pref_Tk, home_table_EM, stay_EM, offset_EM, rest_before_E, rest_total_E, cumulative_EM):
    return topk_ids_Tk.new_empty(topk_ids_Tk.shape, dtype=torch.int64)


#: the per-pair half as the dispatchers run it: these kernels where Triton runs (a GPU), the torch version elsewhere
FUSED_PAIRS = PairHalf(_preferences_and_counts, _assign)

__all__ = ["FUSED_PAIRS", "fused_assign", "fused_preferences_and_counts"]
