"""The replica routing rule (docs/design.md §6): which home of an expert serves a (token, expert) pair.

With replicated experts a placement gives some experts several homes. Every consumer (the
dispatch plan of the runtime, the metrics, the planner) must agree on which home serves a pair,
so the rule lives here once, as a pure function on tensors:

1. the token's *visited* devices are the homes of its single-home experts (it goes there anyway),
   plus any devices the caller says it visits (`devices_TD`: collaboration pruning passes the
   token's N_d devices, so that every pair stays on them);
2. a pair whose expert has a home on a visited device goes to the lowest such device (a replica
   on a device the token already visits costs no extra copy of the token: it cuts CT and load);
3. otherwise to `homes[token_index % number of homes]`: deterministic, and it spreads the expert's
   other tokens evenly over its homes.

A single-home expert always goes to its one home (its device is visited by construction), so a
placement without replicas routes exactly as `device_of_E[topk_ids]`.

`resolve_homes` is torch (the runtime calls it on the tokens' device without host
synchronisation); `resolve_homes_np` wraps it for the numpy metrics and planners.

Shape legend: T tokens, k experts per token, E experts, M most homes of one expert, D devices,
F flat entries of any kind (local: the entries `_rank_in_group` ranks within their groups).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from ..utils.cuda_graph import capture


def replica_preferences(
    topk_ids_Tk: torch.Tensor,
    home_table_EM: torch.Tensor,
    num_devices: int,
    devices_TD: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(homes_TkM, pref_Tk)`: each pair's homes (`[T, k, M]` int64, -1 padded) and the index in `[0, M)` of
    its first home on a device the token visits (steps 1 and 2 of the rule), `M` where it has none.

    A single-home expert's pair always has `pref 0` (its one home is visited by construction).
    """
    ids_Tk = topk_ids_Tk.long()
    num_tokens = ids_Tk.shape[0]
    homes_TkM = home_table_EM[ids_Tk]
    num_homes_Tk = (homes_TkM >= 0).sum(-1)
    # visited devices: the homes of single-home experts (column D collects the others and is dropped)
    devices_TD1 = torch.zeros(num_tokens, num_devices + 1, dtype=torch.bool, device=ids_Tk.device)
    if devices_TD is not None:
        devices_TD1[:, :num_devices] = devices_TD
    devices_TD1.scatter_(1, torch.where(num_homes_Tk == 1, homes_TkM[..., 0], num_devices), True)
    on_visited_TkM = (homes_TkM >= 0) & devices_TD1.gather(
        1, homes_TkM.clamp_min(0).reshape(num_tokens, homes_TkM.shape[1] * homes_TkM.shape[2])  # [T, k * M], also for T = 0
    ).reshape(homes_TkM.shape)
    # the first visited home (homes are in increasing device id), else M
    pref_Tk = torch.where(on_visited_TkM.any(-1), on_visited_TkM.int().argmax(-1), homes_TkM.shape[-1])
    return homes_TkM, pref_Tk


def resolve_homes(
    topk_ids_Tk: torch.Tensor,
    home_table_EM: torch.Tensor,
    num_devices: int,
    token_index_T: torch.Tensor | None = None,
    devices_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, k]` int64 device serving each (token, expert) pair under the replica rule (module docstring).

    Args:
        topk_ids_Tk: `[T, k]` int expert ids in `[0, E)`.
        home_table_EM: `[E, M]` int64 homes of each expert in increasing device id, -1 padded
            (`Placement.home_table`); every row holds at least one home.
        num_devices: `D`.
        token_index_T: `[T]` int64 index of each token for the balanced rule (default `arange(T)`).
        devices_TD: `[T, D]` bool devices each token visits anyway besides its single-home experts'
            (None: none). A pair whose expert has a home there goes to the lowest such home.
    """
    ids_Tk = topk_ids_Tk.long()
    if home_table_EM.shape[-1] == 1:  # no replicas in this layer: the primary map
        return home_table_EM[ids_Tk][..., 0]
    homes_TkM, pref_Tk = replica_preferences(ids_Tk, home_table_EM, num_devices, devices_TD)
    num_homes_Tk = (homes_TkM >= 0).sum(-1)
    if token_index_T is None:
        token_index_T = torch.arange(ids_Tk.shape[0], device=ids_Tk.device)
    balanced_Tk = token_index_T.long()[:, None] % num_homes_Tk
    choice_Tk = torch.where(pref_Tk < homes_TkM.shape[-1], pref_Tk, balanced_Tk)
    return homes_TkM.gather(-1, choice_Tk[..., None]).squeeze(-1)


def resolve_homes_np(
    topk_ids_Nk: np.ndarray, home_table_EM: np.ndarray, num_devices: int, token_index_N: np.ndarray | None = None
) -> np.ndarray:
    """`resolve_homes` on numpy arrays: `[N, k]` int64 serving device of each pair."""
    index = None if token_index_N is None else torch.from_numpy(np.asarray(token_index_N, dtype=np.int64))
    return resolve_homes(
        torch.from_numpy(np.asarray(topk_ids_Nk, dtype=np.int64)),
        torch.from_numpy(np.asarray(home_table_EM, dtype=np.int64)),
        num_devices,
        index,
    ).numpy()


#: best-response rounds of the load-aware split (each phase; each round is a few dozen small operators)
SPLIT_ROUNDS = 8

#: how far above the least max load the load-aware split lets a device go to keep a pair on a home its
#: token visits anyway (a fraction of the mean device load): a little balance buys back most of the CT that
#: moving pinned pairs costs. The default for a layer whose placement states none (`Placement.pin_slack`: the
#: planner chooses it per layer, `refined` option `pin_slack`; docs/placement.md weighs the values)
PIN_SLACK = 0.02


def preference_counts(topk_ids_Tk: torch.Tensor, pref_Tk: torch.Tensor, num_experts: int, max_homes: int) -> torch.Tensor:
    """`[E, M + 1]` int64: the pairs of each expert whose first visited home is its m-th, column M: no visited home.

    The one statistic the load-aware rule exchanges (summed over the EP group: E x (M + 1) integers)."""
    flat = topk_ids_Tk.long().reshape(-1) * (max_homes + 1) + pref_Tk.reshape(-1)
    counts = torch.zeros(num_experts * (max_homes + 1), dtype=torch.int64, device=topk_ids_Tk.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat)).view(num_experts, max_homes + 1)


def _fill(total_E: torch.Tensor, other_EM: torch.Tensor, floor_EM: torch.Tensor, off_EM: torch.Tensor) -> torch.Tensor:
    """`[E, M]` shares of each expert's `total_E` over its homes: `max(floor, level - other)` with the level
    that makes them sum to the total (water-filling above floors; `sum(floor) <= total`). 0 off the homes
    (`off_EM`: 0 on a home, +inf elsewhere).

    Without a sort (a few fused-size operators): with `start = other + floor`, a home's share is
    `max(start, level) - other`, so the level solves `sum_m max(start_m, level) = total + sum_m other_m`. For
    any set S of homes that sum is at least `|S| level + sum_{m not in S} start_m`, so the level is at most
    `(total + sum other - sum_{m not in S} start_m) / |S|` for every S, with equality for the homes that rise
    (those with `start_m <= level`); those are the homes starting no later than some home j, so the level is
    the least of that bound over the sets `{m: start_m <= start_j}`.
    """
    start_EM = other_EM + floor_EM + off_EM
    rises_EMM = start_EM[:, None, :] <= start_EM[:, :, None]  # [e, j, m]: home m has started when home j starts
    on_EM = off_EM == 0
    started_EM = torch.where(rises_EMM, start_EM[:, None, :], 0.0).sum(2)
    excess_E = total_E + torch.where(on_EM, other_EM - start_EM, 0.0).sum(1)  # total + sum other - sum start
    level_EM = (excess_E[:, None] + started_EM) / rises_EMM.sum(2)
    level_E = torch.where(on_EM, level_EM, torch.inf).amin(1, keepdim=True)
    return torch.where(on_EM, torch.maximum(start_EM, level_E) - other_EM, 0.0)


def split_steps(replicated_EM: torch.Tensor, on_EMD: torch.Tensor, home_EM: torch.Tensor) -> torch.Tensor:
    """`[E, 1]` float64 the fraction of the way to its best response each replicated expert moves in a round of
    `replica_shares`: `1 / sqrt(2 n)`, n >= 2 the most replicated experts with a home on one of its devices (one half
    where no device holds more than two). Of the steps tried on the herding cases of tests/test_replica_split.py
    (1/2, 1/n, 2/(n+2), 1/sqrt(2n)), this one came closest to the fluid split in `SPLIT_ROUNDS` rounds; 1/n
    converges too slowly."""
    sharing_D = (on_EMD * replicated_EM[..., None]).sum((0, 1))
    most_E = torch.where(replicated_EM, sharing_D[home_EM], 0.0).amax(1, keepdim=True)
    return 1.0 / torch.sqrt(2.0 * most_E.clamp_min(2.0))


def replica_shares(
    counts_EM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, pin_slack: float = PIN_SLACK
) -> torch.Tensor:
    """`[E, M]` float64 pairs each home of each expert should serve, from the group's `preference_counts`.

    Single-home experts serve all their pairs at home. The replicated experts' pairs are split in two
    phases of `SPLIT_ROUNDS` damped best responses (every expert at once, vectorised: no host read, and
    dense reductions only, so every rank computes the same bits from the same integers):
    1. the least max device load: each expert water-fills its pairs over its homes given the other
       experts' loads (the fluid min-max split);
    2. the same with floors: a home keeps up to its visited pairs (those need no extra copy of the
       token) as far as its device stays within `pin_slack` x the mean above phase 1's max load.
    An expert moves `split_steps` of the way to its best response each round: half where at most two replicated
    experts share each of its devices, less where more do. All best-responding at once, n experts with a home on a
    light device each move their excess there and overshoot it n-fold: a fixed half step oscillates instead of
    converging, so that more copies balance worse.
    About 20 operators a round on `[E, M]` tensors, whatever E, M and D.
    """
    counts_EM1 = counts_EM1.to(torch.float64)
    max_homes = home_table_EM.shape[1]
    total_E, visited_EM = counts_EM1.sum(1), counts_EM1[:, :max_homes]
    valid_EM = home_table_EM >= 0
    replicated_EM = valid_EM & (valid_EM.sum(1, keepdim=True) > 1)
    off_EM = torch.where(replicated_EM, 0.0, torch.inf).to(torch.float64)
    home_EM = home_table_EM.clamp_min(0)
    on_EMD = (home_table_EM[..., None] == torch.arange(num_devices, device=home_table_EM.device)).to(torch.float64)
    single_E = torch.where(replicated_EM[:, 0], 0.0, total_E)
    single_D = (single_E[:, None] * on_EMD[:, 0]).sum(0)  # what no split moves
    shares_EM = torch.where(replicated_EM, total_E[:, None] / valid_EM.sum(1, keepdim=True), 0.0)
    step_E1 = split_steps(replicated_EM, on_EMD, home_EM)

    def rounds(shares_EM, floor_of):
        for _ in range(SPLIT_ROUNDS):
            load_D = single_D + (shares_EM[..., None] * on_EMD).sum((0, 1))
            other_EM = load_D[home_EM] - shares_EM
            shares_EM = torch.lerp(shares_EM, _fill(total_E, other_EM, floor_of(other_EM), off_EM), step_E1)
        return shares_EM

    shares_EM = rounds(shares_EM, torch.zeros_like)
    cap = (single_D + (shares_EM[..., None] * on_EMD).sum((0, 1))).max() + pin_slack * total_E.sum() / num_devices
    shares_EM = rounds(shares_EM, lambda other_EM: torch.minimum(visited_EM, (cap - other_EM).clamp_min(0.0)))
    return torch.where(replicated_EM, shares_EM, single_E[:, None] * (torch.arange(max_homes, device=home_EM.device) == 0))


def _stays(index: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """Of the first `index` pairs of a group whose fraction `rate` stays, how many stay (evenly spaced)."""
    return torch.floor(index * rate + 0.5)


def expert_routes(
    all_GEM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, rank: int, pin_slack: float, pinned: bool
) -> tuple[torch.Tensor, ...]:
    """The per-expert half of the load-aware rule (steps 2 and 3's tables), from the group's gathered counts.

    Args:
        all_GEM1: `[G, E, M + 1]` int64 every rank's `preference_counts`, in rank order.
        home_table_EM, num_devices, pin_slack: as `load_aware_homes`.
        rank: this rank's place in the group's line.
        pinned: True when every visited home must keep its pairs (collaboration pruning's `devices_TD`).

    Returns `(stay_EM, offset_EM, rest_before_E, rest_total_E, cumulative_EM)`: the fraction of each (expert,
    first visited home)'s pairs that stays there; the pairs of that group on the ranks before this one; the
    pairs of each expert that do not stay, on the ranks before and in all; and the cumulative fractions of those
    over the homes. Static shapes and no host read: `GraphedRoutes` replays it from a CUDA graph, and
    `occult_hf.kernels.replica_routes` computes it in one Triton kernel (what the dispatchers launch on a GPU).
    """
    max_homes = home_table_EM.shape[1]
    counts_EM1, before_EM1 = all_GEM1.sum(0), all_GEM1[:rank].sum(0)
    shares_EM = replica_shares(counts_EM1, home_table_EM, num_devices, pin_slack)
    visited_EM = counts_EM1[:, :max_homes].to(torch.float64)
    # with pruning a pair must stay on the token's devices: every visited home is kept
    keep_EM = visited_EM if pinned else torch.minimum(visited_EM, shares_EM)
    stay_EM = torch.where(visited_EM > 0, keep_EM / visited_EM.clamp_min(1.0), 1.0)
    before_visited_EM = before_EM1[:, :max_homes].to(torch.float64)
    rest_before_E = before_EM1[:, max_homes] + (before_visited_EM - _stays(before_visited_EM, stay_EM)).sum(1).long()
    rest_total_E = counts_EM1[:, max_homes] + (visited_EM - _stays(visited_EM, stay_EM)).sum(1).long()
    pool_EM = (shares_EM - keep_EM).clamp_min(0.0)
    pool_EM = torch.where(pool_EM.sum(1, keepdim=True) > 0, pool_EM, shares_EM)  # nothing left: as the shares
    cumulative_EM = pool_EM.cumsum(1) / pool_EM.sum(1, keepdim=True).clamp_min(1e-300)
    return stay_EM, before_EM1[:, :max_homes], rest_before_E, rest_total_E, cumulative_EM


class GraphedRoutes:
    """`expert_routes` replayed from a CUDA graph: its ~480 small operators (the split's rounds and the
    per-expert tables) become one launch on a GPU.

    Its inputs have static shapes (`[G, E, M + 1]` counts, `[E, M]` homes) and it reads nothing on the host,
    so it is captured once per (device, shapes, D, rank, pin slack, pinning) and replayed; the counts and the
    table are copied into the graph's input buffers first, so re-homed copies (`rehome.apply_replicas`) need no
    new capture (eager, these small operators cost milliseconds per layer on a GPU). Eager where graphs do not
    apply: on CPU, and inside an enclosing capture (the outer graph holds it then). One instance per layer: the
    outputs are the graph's own buffers, read by the operators that follow in stream order before the next replay
    of that layer can overwrite them. The dispatchers launch the one-kernel version instead
    (`occult_hf.kernels.replica_routes.FusedRoutes`).
    """

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple] = {}

    def __call__(
        self, all_GEM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, rank: int, pin_slack: float, pinned: bool
    ) -> tuple[torch.Tensor, ...]:
        args = (num_devices, rank, pin_slack, pinned)
        if all_GEM1.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return expert_routes(all_GEM1, home_table_EM, *args)
        key = (all_GEM1.device, tuple(all_GEM1.shape), all_GEM1.dtype, tuple(home_table_EM.shape), *args)
        if key not in self._graphs:
            self._graphs[key] = self._capture(all_GEM1, home_table_EM, args)
        graph, counts_in, table_in, outputs = self._graphs[key]
        counts_in.copy_(all_GEM1)
        table_in.copy_(home_table_EM)
        graph.replay()
        return outputs

    @staticmethod
    def _capture(all_GEM1, home_table_EM, args) -> tuple:
        counts_in, table_in = all_GEM1.clone(), home_table_EM.clone()
        # thread_local: the NCCL watchdog thread's event queries during the capture must not invalidate it
        graph, outputs = capture(
            lambda: expert_routes(counts_in, table_in, *args), all_GEM1.device, warmup=1, error_mode="thread_local"
        )
        return graph, counts_in, table_in, outputs


def _rank_in_group(group_F: torch.Tensor) -> torch.Tensor:
    """`[F]` int64: each entry's position among the entries of its group (non-negative group ids), in
    entry order (one sort, no host read)."""
    num_entries = group_F.shape[0]
    key_F = group_F * num_entries + torch.arange(num_entries, device=group_F.device)
    sorted_F, order_F = torch.sort(key_F)
    start_F = torch.searchsorted(sorted_F, group_F * num_entries)
    position_F = torch.empty_like(order_F).scatter_(0, order_F, torch.arange(num_entries, device=group_F.device))
    return position_F - start_F


def load_aware_homes(
    topk_ids_Tk: torch.Tensor,
    home_table_EM: torch.Tensor,
    num_devices: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rank: int = 0,
    devices_TD: torch.Tensor | None = None,
    pin_slack: float = PIN_SLACK,
    routes: Callable[..., tuple[torch.Tensor, ...]] = expert_routes,
    pairs: PairHalf | None = None,
) -> torch.Tensor:
    """`[T, k]` int64 device serving each pair under the load-aware rule (`replica_choice="load_aware"`).

    The static rule (`resolve_homes`) sends a replicated expert's pairs to a visited home or round-robin,
    whatever the batch's loads. This one balances the devices on the batch itself:

    1. each rank counts its pairs per (expert, first visited home) (`preference_counts`) and `gather`
       collects every rank's counts (one all-gather of E x (M + 1) integers per rank per layer, `[G, E,
       M + 1]` in rank order; None: this process's tokens are the whole batch, as with logical devices);
    2. every rank derives the same split of each replicated expert's pairs over its homes from their sum
       (`replica_shares`, within `routes`: `expert_routes`, or the `occult_hf.kernels.replica_routes.FusedRoutes` the
       dispatchers pass, one Triton launch on a GPU);
    3. the pairs are assigned as if the group's pairs stood in one line, rank by rank (`rank`: this one's
       place; the counts of the ranks before it give its offset), so the split is met to one pair per
       home, not one per home and rank: of the pairs whose token visits home m, the fraction
       `a = min(visited, share) / visited` stays there (the g-th stays when `round((g + 1) a) > round(g a)`:
       evenly spaced); the others and the pairs that visit no home are spread over the homes in
       proportion to what each home's share leaves after its visited pairs.

    Steps 1 and 3 are `pairs` (default `TORCH_PAIRS`; the dispatchers pass `occult_hf.kernels.replica_pairs.FUSED_PAIRS`, a
    few Triton launches on a GPU instead of ~78 torch operators).

    Single-home experts go home, so a layer without replicas routes as `device_of_E[topk_ids]`. With
    collaboration pruning (`devices_TD`: the token's N_d devices) a pair never leaves a visited home (the
    pruner keeps every pair on the token's devices), so only pairs that visit none are balanced. The result
    depends only on the routing (integers), never on a value with a gradient: replicas stay exact.
    """
    ids_Tk = topk_ids_Tk.long()
    if home_table_EM.shape[-1] == 1:
        return home_table_EM[ids_Tk][..., 0]
    pairs = TORCH_PAIRS if pairs is None else pairs
    pref_Tk, local_EM1 = pairs.preferences_and_counts(topk_ids_Tk, home_table_EM, num_devices, devices_TD)
    all_GEM1 = local_EM1[None] if gather is None else gather(local_EM1)
    tables = routes(all_GEM1, home_table_EM, num_devices, rank, pin_slack, devices_TD is not None)
    return pairs.assign(topk_ids_Tk, pref_Tk, home_table_EM, tables)


def preferences_and_counts(
    topk_ids_Tk: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, devices_TD: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pref_Tk, counts_EM1)`: step 1 of `load_aware_homes`, `replica_preferences`' `pref_Tk` and its
    `preference_counts` (the statistic the group gathers)."""
    _, pref_Tk = replica_preferences(topk_ids_Tk, home_table_EM, num_devices, devices_TD)
    return pref_Tk, preference_counts(topk_ids_Tk, pref_Tk, *home_table_EM.shape)


def assign_pairs(
    topk_ids_Tk: torch.Tensor, pref_Tk: torch.Tensor, home_table_EM: torch.Tensor, tables: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """`[T, k]` int64 serving device of each pair: step 3 of `load_aware_homes` from the per-expert half's `tables`
    (`expert_routes`' five) and the pairs' first visited homes `pref_Tk`."""
    ids_Tk = topk_ids_Tk.long()
    num_experts, max_homes = home_table_EM.shape
    stay_EM, offset_EM, rest_before_E, rest_total_E, cumulative_EM = tables
    # 3a: the g-th pair (in the group's line) of (expert e, first visited home m) stays at m
    ids_F, pref_F = ids_Tk.reshape(-1), pref_Tk.reshape(-1)
    visits_F = pref_F < max_homes
    group_F = ids_F * max_homes + pref_F.clamp_max(max_homes - 1)
    line_F = _rank_in_group(torch.where(visits_F, group_F, num_experts * max_homes)) + offset_EM.reshape(-1)[group_F]
    rate_F = stay_EM.reshape(-1)[group_F]
    stays_F = visits_F & (_stays(line_F + 1, rate_F) > _stays(line_F, rate_F))
    # 3b: the rest of expert e's pairs, in the line, spread over what the homes' shares leave
    rest_F = ~stays_F
    line_F = _rank_in_group(torch.where(rest_F, ids_F, num_experts)) + rest_before_E[ids_F]
    position_F = (line_F.to(torch.float64) + 0.5) / rest_total_E[ids_F].clamp_min(1).to(torch.float64)
    pick_F = (position_F[:, None] >= cumulative_EM[ids_F]).sum(1)
    homes_FM = home_table_EM[ids_F]
    pick_F = torch.minimum(pick_F, (homes_FM >= 0).sum(1) - 1)
    choice_F = torch.where(stays_F, pref_F, pick_F)
    return homes_FM.gather(1, choice_F[:, None]).view(ids_Tk.shape)


class PairHalf(NamedTuple):
    """The per-pair half of the load-aware rule, as two functions around the gather and the per-expert half:
    `preferences_and_counts` (step 1) and `assign` (step 3). `TORCH_PAIRS` is the reference (and the CPU path);
    `occult_hf.kernels.replica_pairs.FUSED_PAIRS` runs them as a few Triton launches on a GPU."""

    preferences_and_counts: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    assign: Callable[..., torch.Tensor]


TORCH_PAIRS = PairHalf(preferences_and_counts, assign_pairs)


def home_table_from(device_of_E: np.ndarray, replicas: dict[int, list[int]] | None) -> np.ndarray:
    """`[E, M]` int64 home table (increasing device ids, -1 padded) of a primary map plus extra homes."""
    device_of_E = np.asarray(device_of_E, dtype=np.int64)
    replicas = replicas or {}
    homes = [sorted([int(d), *replicas.get(e, [])]) for e, d in enumerate(device_of_E)]
    table = np.full((len(homes), max(len(h) for h in homes)), -1, dtype=np.int64)
    for expert, devices in enumerate(homes):
        table[expert, : len(devices)] = devices
    return table


__all__ = [
    "GraphedRoutes",
    "PairHalf",
    "TORCH_PAIRS",
    "assign_pairs",
    "home_table_from",
    "expert_routes",
    "load_aware_homes",
    "preference_counts",
    "preferences_and_counts",
    "replica_preferences",
    "replica_shares",
    "resolve_homes",
    "resolve_homes_np",
]
