"""Communication and balance metrics of an expert placement (docs/design.md §2).

Everything here is exact and vectorised over tokens (numpy): a metric reads per-token top-k
sets (a profile's sample or a trace), per-expert counts or the co-activation matrix, and a
device map, and never loops over tokens in Python.

The per-token counts every CT figure rests on (`device_hits_TD`: pairs each device serves;
`ct_and_remote_T`: CT and remote copies; `token_ranks_T`: the tokens' ranks) are torch functions,
the one implementation: the numpy metrics here wrap them, and `OccultCallback` runs them on the
training device without a host sync.

* **CT** (`communication_cost`): distinct devices holding a token's k experts. Bounds for the
  placement's capacities: `ceil(k / max capacity) <= CT <= min(k, D)` (`ct_bounds`).
* **Remote copies** (`communication_volume`): CT minus one when the token's own rank is among its
  devices. Tokens are given to ranks in contiguous equal chunks (`token_ranks`), as expert
  parallelism's data-parallel sharding does; the volume reports every rank's sent and received
  rows, because an all-to-all ends when its largest rank ends.
* **Nodes** (`node_traffic`): with `G` devices per node (devices `n*G .. n*G + G - 1` form node n),
  CT_node is the distinct nodes holding a token's experts, what a token costs on the slow inter-node link
  when it is sent once per (token, node) and forwarded inside the node (the hierarchical exchange); the flat
  exchange instead sends every (token, device) row whose device is on another node across it.
* **Device load** (`device_load`, `load_balance`, `load_floor`): tokens x experts routed to a
  device's experts; balance = max / mean over devices; `load_floor` is the smallest max device
  load any placement with these capacities can reach (a giant expert can push it above the mean).
* **Pairwise cut** (`pairwise_cut`) and **intra-device collaboration ratio**
  (`intra_device_ratio`): from co-activation counts only, for profiles without a token sample.
* **Drift** (`coactivation_spearman`, `routing_cost`): how much routing changed between two
  profiles; `drift.profile_drift` adds what that costs a placement planned on the old one (it runs
  the planners, which use this module, so it lives outside it).

Input checks (`check_topk_ids`, `check_device_map`, `check_square`) live in `checks.py`, shared
with the planners.

`evaluate_layer` / `evaluate_placement` gather all of these for a profile and a placement.

Shape legend (docs/conventions.md): N tokens (a sample or a trace), k experts per token, E routed
experts, D devices of the EP group (each rank is one device, so per-rank figures are `_D` too), M
homes of one expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .utils.checks import check_device_map, check_devices_per_node, check_square, check_topk_ids, shown
from .replicas.routing import resolve_homes_np

if TYPE_CHECKING:  # annotations only: the planners import this module, so it imports no planner
    from .placement.placement import Placement
    from .profile import LayerRouting, RoutingProfile


# ----- CT --------------------------------------------------------------------------------------
def pair_devices(
    topk_ids_Nk: np.ndarray, device_of_E: np.ndarray, num_devices: int, home_table_EM: np.ndarray | None = None
) -> np.ndarray:
    """`[N, k]` int64 device serving each (token, expert) pair: `device_of_E[ids]`, or with replicas
    (`home_table_EM` `[E, M]`, M > 1) the replica rule `replicas.routing.resolve_homes` with the
    token's position as its index."""
    if home_table_EM is None or np.asarray(home_table_EM).shape[1] == 1:
        return device_of_E[topk_ids_Nk]
    return resolve_homes_np(topk_ids_Nk, home_table_EM, num_devices)


def device_hits_TD(device_Tk: torch.Tensor, num_devices: int) -> torch.Tensor:
    """`[T, D]` int64: how many of token t's k pairs device d serves (rows sum to k).

    `device_Tk` `[T, k]` int64 serving device of each pair (`pair_devices`, or the dispatch plan's
    `destinations`); computed on its device, with no host synchronisation.
    """
    hits_TD = torch.zeros(device_Tk.shape[0], num_devices, dtype=torch.int64, device=device_Tk.device)
    return hits_TD.scatter_add_(1, device_Tk, torch.ones_like(device_Tk))


def ct_and_remote_T(hits_TD: torch.Tensor, source_rank_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`([T] CT, [T] remote copies)` int64 from `device_hits_TD` and each token's own rank `[T]` int64.

    Remote copies are CT minus one when the token's own rank is among its devices (that copy never
    crosses a link).
    """
    reached_TD = hits_TD > 0
    ct_T = reached_TD.sum(1)
    return ct_T, ct_T - reached_TD.gather(1, source_rank_T[:, None]).squeeze(1).long()


def device_hits(
    topk_ids_Nk: np.ndarray, device_of_E: np.ndarray, num_devices: int, home_table_EM: np.ndarray | None = None
) -> np.ndarray:
    """`[N, D]` int64: how many of token n's k pairs device d serves (rows sum to k); `device_hits_TD`."""
    device_Nk = pair_devices(topk_ids_Nk, device_of_E, num_devices, home_table_EM)
    return device_hits_TD(torch.from_numpy(np.ascontiguousarray(device_Nk, dtype=np.int64)), num_devices).numpy()


def communication_cost(topk_ids_Nk: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> np.ndarray:
    """`[N]` int64 CT of each token: the number of distinct devices holding its k experts.

    Args:
        topk_ids_Nk: `[N, k]` expert ids, distinct within a row.
        device_of_E: `[E]` device of each expert.
        num_devices: `D`.
    """
    num_experts = len(np.asarray(device_of_E))
    ids = check_topk_ids(topk_ids_Nk, num_experts)
    devices = check_device_map(device_of_E, num_experts, num_devices)
    return (device_hits(ids, devices, num_devices) > 0).sum(axis=1)


def _check_has_tokens(num_tokens: int, what: str) -> None:
    """Raise for a mean over no tokens: numpy would return NaN with only a warning, a number a table prints."""
    if num_tokens == 0:
        raise ValueError(f"{what} needs at least one token (a mean CT over no tokens is undefined)")


def served_ct(device_Nk: np.ndarray, num_devices: int) -> float:
    """Mean CT of tokens whose k pairs are served by the devices `device_Nk` `[N, k]` (a replica rule's choice, or
    `pair_devices`): the number of distinct devices in each row, averaged."""
    _check_has_tokens(len(device_Nk), "served_ct")
    reached_ND = np.zeros((len(device_Nk), num_devices), dtype=bool)
    np.put_along_axis(reached_ND, np.asarray(device_Nk, dtype=np.int64), True, axis=1)
    return float(reached_ND.sum(1).mean())


def mean_ct(topk_ids_Nk: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> float:
    """Mean CT over tokens (the per-layer number docs/design.md reports)."""
    _check_has_tokens(len(np.asarray(topk_ids_Nk)), "mean_ct")
    return float(communication_cost(topk_ids_Nk, device_of_E, num_devices).mean())


def _check_capacities(capacities_D: np.ndarray) -> np.ndarray:
    """Return `capacities_D` as an integer array or raise: a non-empty `[D]` of positive whole counts (every device
    holds an expert; a zero would make the bounds and the load floor reason about a device that holds none)."""
    capacities = np.asarray(capacities_D)
    if capacities.dtype.kind == "f" and np.isfinite(capacities).all() and (capacities == np.round(capacities)).all():
        capacities = capacities.astype(np.int64)  # whole counts held as floats (4.0)
    if capacities.ndim != 1 or len(capacities) == 0 or capacities.dtype.kind not in "iu" or capacities.min() < 1:
        raise ValueError(
            f"capacities must be a non-empty [D] integer array of positive counts, got {shown(capacities.tolist())}"
        )
    return capacities


def ct_bounds(top_k: int, capacities_D: np.ndarray) -> tuple[int, int]:
    """`(lower, upper)` bounds on any token's CT for devices holding `capacities_D` experts.

    `lower = ceil(k / max capacity)`: a token needs at least that many devices to hold k experts
    (the paper's `ceil(k*D/E)` for equal groups); `upper = min(k, D)`. A bound over all
    placements, not a promise for one: report it beside what a placement achieves.
    """
    capacities = _check_capacities(capacities_D)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= capacities.sum():
        raise ValueError(
            f"top_k must be an integer in [1, {int(capacities.sum())}] (the experts the devices hold), got {top_k!r}"
        )
    return math.ceil(top_k / int(capacities.max())), min(top_k, len(capacities))


# ----- remote copies ---------------------------------------------------------------------------
def _source_ranks(source_rank_N: np.ndarray | None, num_tokens: int, num_devices: int) -> np.ndarray:
    """`[N]` int64 rank of each token: `token_ranks` when None, else `source_rank_N` checked (integers, one per
    token, in `[0, D)`): a float rank would be truncated to another rank and a rank past D index another node."""
    if source_rank_N is None:
        return token_ranks(num_tokens, num_devices)
    ranks = np.asarray(source_rank_N)
    if ranks.shape != (num_tokens,) or ranks.dtype.kind not in "iu" or ranks.min() < 0 or ranks.max() >= num_devices:
        shown_range = f"in [{ranks.min()}, {ranks.max()}]" if ranks.size else "empty"
        raise ValueError(
            f"source_rank_N must be an integer array [N={num_tokens}] of ranks in [0, {num_devices}), "
            f"got {ranks.dtype} with shape {list(ranks.shape)}, {shown_range}"
        )
    return ranks.astype(np.int64, copy=False)


def token_ranks_T(num_tokens: int, num_ranks: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`[T]` int64 source rank of each token: contiguous equal chunks (sizes differ by at most one), rank 0 first.

    This is how expert parallelism shards a batch: every rank is also a data-parallel rank that
    owns a contiguous slice of the tokens. Token t goes to rank `t * D // T`. Built on `device`.
    """
    return torch.arange(num_tokens, dtype=torch.int64, device=device) * num_ranks // max(num_tokens, 1)


def token_ranks(num_tokens: int, num_ranks: int) -> np.ndarray:
    """`[N]` int64 `token_ranks_T` as a numpy array."""
    return token_ranks_T(num_tokens, num_ranks).numpy()


@dataclass(frozen=True)
class CommunicationVolume:
    """Dispatch traffic of one MoE layer with one copy per (token, destination device).

    Attributes:
        ct_mean: mean CT over tokens.
        remote_copies_mean: mean over tokens of copies that leave the token's rank.
        sent_rows_D: `[D]` rows each rank sends to other ranks (combine returns as many).
        received_rows_D: `[D]` rows each rank receives from other ranks.
    """

    ct_mean: float
    remote_copies_mean: float
    sent_rows_D: np.ndarray
    received_rows_D: np.ndarray

    @property
    def max_sent_rows(self) -> int:
        """Rows of the slowest sender."""
        return int(self.sent_rows_D.max())

    @property
    def max_received_rows(self) -> int:
        """Rows of the slowest receiver."""
        return int(self.received_rows_D.max())


def communication_volume(
    topk_ids_Nk: np.ndarray,
    device_of_E: np.ndarray,
    num_devices: int,
    source_rank_N: np.ndarray | None = None,
    home_table_EM: np.ndarray | None = None,
) -> CommunicationVolume:
    """CT, remote copies and per-rank rows of dispatching `topk_ids_Nk` under `device_of_E`.

    Args:
        topk_ids_Nk: `[N, k]` expert ids.
        device_of_E: `[E]` device of each expert.
        num_devices: `D` (= ranks: each rank is one device).
        source_rank_N: `[N]` rank holding each token; default `token_ranks(N, D)` (contiguous equal chunks).
        home_table_EM: `[E, M]` homes of each expert when the placement has replicas (`pair_devices`).

    A token's remote copies are its CT minus one when its own rank holds one of its experts (that
    copy never crosses a link). Bytes per token and direction = remote copies x hidden x bytes per element.
    """
    num_experts = len(np.asarray(device_of_E))
    ids = check_topk_ids(topk_ids_Nk, num_experts)
    devices = check_device_map(device_of_E, num_experts, num_devices)
    num_tokens = ids.shape[0]
    if num_tokens == 0:
        raise ValueError("communication_volume needs at least one token")
    source_rank_N = _source_ranks(source_rank_N, num_tokens, num_devices)
    hits_ND = torch.from_numpy(device_hits(ids, devices, num_devices, home_table_EM))
    ct_N, remote_N = (t.numpy() for t in ct_and_remote_T(hits_ND, torch.from_numpy(source_rank_N)))
    sent_D = np.bincount(source_rank_N, weights=remote_N, minlength=num_devices).astype(np.int64)
    # a device receives the tokens that reach it, less those of its own rank (they never cross a link)
    own_N = ct_N - remote_N
    received_D = ((hits_ND > 0).sum(0).numpy() - np.bincount(source_rank_N, weights=own_N, minlength=num_devices)).astype(np.int64)
    return CommunicationVolume(float(ct_N.mean()), float(remote_N.mean()), sent_D, received_D)


# ----- nodes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeTraffic:
    """What one MoE layer sends across nodes, with `G` devices per node.

    Attributes:
        devices_per_node: `G`.
        ct_node_mean: mean over tokens of the distinct nodes holding its k experts (CT_node).
        cross_rows_flat: mean rows per token and direction that cross nodes when each (token, device) row is
            sent directly (the flat exchange): its devices on other nodes than the token's own.
        cross_rows_hierarchical: the same when one copy per (token, node) crosses (the hierarchical exchange):
            CT_node minus one when the token's own node is among its nodes.
        sent_cross_flat_D, sent_cross_hierarchical_D: `[D]` such rows each rank sends (an inter-node link of one
            GPU carries its rank's rows; the exchange ends with its busiest).
    """

    devices_per_node: int
    ct_node_mean: float
    cross_rows_flat: float
    cross_rows_hierarchical: float
    sent_cross_flat_D: np.ndarray
    sent_cross_hierarchical_D: np.ndarray


def node_traffic(
    topk_ids_Nk: np.ndarray,
    device_of_E: np.ndarray,
    num_devices: int,
    devices_per_node: int,
    source_rank_N: np.ndarray | None = None,
    home_table_EM: np.ndarray | None = None,
) -> NodeTraffic:
    """CT_node and the rows that cross nodes when dispatching `topk_ids_Nk` (see `NodeTraffic`).

    Tokens sit on ranks as in `communication_volume` (`token_ranks` by default); with replicas the pairs follow
    the replica rule (`pair_devices`)."""
    num_experts = len(np.asarray(device_of_E))
    ids = check_topk_ids(topk_ids_Nk, num_experts)
    devices = check_device_map(device_of_E, num_experts, num_devices)
    check_devices_per_node(devices_per_node, num_devices)
    num_tokens, num_nodes = ids.shape[0], num_devices // int(devices_per_node)
    if num_tokens == 0:
        raise ValueError("node_traffic needs at least one token")
    source_N = _source_ranks(source_rank_N, num_tokens, num_devices)
    reached_ND = device_hits(ids, devices, num_devices, home_table_EM) > 0
    reached_NM = reached_ND.reshape(num_tokens, num_nodes, int(devices_per_node)).any(2)  # M: nodes, local here
    own_node_N = source_N // int(devices_per_node)
    on_own_node_ND = (np.arange(num_devices) // int(devices_per_node))[None, :] == own_node_N[:, None]
    flat_N = (reached_ND & ~on_own_node_ND).sum(1)
    hierarchical_N = reached_NM.sum(1) - reached_NM[np.arange(num_tokens), own_node_N]
    return NodeTraffic(
        devices_per_node=int(devices_per_node),
        ct_node_mean=float(reached_NM.sum(1).mean()),
        cross_rows_flat=float(flat_N.mean()),
        cross_rows_hierarchical=float(hierarchical_N.mean()),
        sent_cross_flat_D=np.bincount(source_N, weights=flat_N, minlength=num_devices).astype(np.int64),
        sent_cross_hierarchical_D=np.bincount(source_N, weights=hierarchical_N, minlength=num_devices).astype(np.int64),
    )


# ----- load ------------------------------------------------------------------------------------
def expert_load(topk_ids_Nk: np.ndarray, num_experts: int) -> np.ndarray:
    """`[E]` int64 tokens routed to each expert."""
    ids = check_topk_ids(topk_ids_Nk, num_experts)
    return np.bincount(ids.ravel(), minlength=num_experts)


def device_load(expert_load_E: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> np.ndarray:
    """`[D]` float64 load of each device: sum of its experts' loads (tokens x experts it computes)."""
    load = np.asarray(expert_load_E, dtype=np.float64)
    devices = check_device_map(device_of_E, len(load), num_devices)
    return np.bincount(devices, weights=load, minlength=num_devices)


def _check_loads(loads: np.ndarray, what: str, name: str) -> np.ndarray:
    """Return `loads` as float64 or raise: a non-empty 1-D array of finite, non-negative numbers. NaN would pass every
    comparison and come out as a NaN balance or floor; a negative load makes max / mean meaningless."""
    load = np.asarray(loads, dtype=np.float64)
    if load.ndim != 1 or len(load) == 0 or not np.isfinite(load).all() or (load < 0).any():
        raise ValueError(
            f"{what} needs a non-empty 1-D array of finite, non-negative {name}, got {shown(load.tolist())}"
        )
    return load


def load_balance(load_D: np.ndarray) -> float:
    """max / mean of `[D]` device loads (1.0 = perfectly even; a device at 2.0 takes twice as long)."""
    load = _check_loads(load_D, "load_balance", "device loads")
    mean = load.mean()
    if mean <= 0:
        raise ValueError("load_balance needs a positive total load")
    return float(load.max() / mean)


def load_floor(expert_load_E: np.ndarray, capacities_D: np.ndarray) -> float:
    """A lower bound on the largest device load of any placement with these capacities.

    The largest of three bounds: the mean device load; the heaviest expert plus the `c_min - 1`
    lightest other experts (its device holds at least `c_min` experts); and the `c_max` lightest
    experts together (a device of the largest capacity holds at least those). When one expert is
    a giant, or E % D devices must take one expert more of nearly equal ones, this floor exceeds
    the mean: `load_floor / mean` is then the best balance any placement can reach.
    """
    load = np.sort(_check_loads(expert_load_E, "load_floor", "expert loads"))
    capacities = _check_capacities(capacities_D)
    if int(capacities.sum()) != len(load):
        raise ValueError(f"capacities sum to {int(capacities.sum())} but there are {len(load)} experts")
    mean = load.sum() / len(capacities)
    giant = load[-1] + load[: int(capacities.min()) - 1].sum()
    largest_device = load[: int(capacities.max())].sum()
    return float(max(mean, giant, largest_device))


# ----- co-activation metrics ------------------------------------------------------------------
def _check_coactivation(coactivation_EE: np.ndarray, num_experts: int) -> np.ndarray:
    """Return `coactivation_EE` as an array or raise: `[E, E]`, finite, non-negative and symmetric, as a profile's
    co-activation counts are. The cut halves the off-device sum of both triangles, which is `sum_{i<j}` only for a
    symmetric matrix (one triangle alone would be halved), and a NaN would be cast to a garbage integer."""
    coactivation = check_square(coactivation_EE, num_experts)
    if not np.isfinite(coactivation).all() or (coactivation < 0).any():
        raise ValueError("coactivation must hold finite, non-negative counts")
    if not np.array_equal(coactivation, coactivation.T):
        i, j = (int(v) for v in np.argwhere(coactivation != coactivation.T)[0])
        raise ValueError(
            f"coactivation must be symmetric (C[i, j] counts the tokens holding both i and j), but "
            f"C[{i}, {j}] = {coactivation[i, j]} and C[{j}, {i}] = {coactivation[j, i]}"
        )
    return coactivation


def _same_device_EE(device_of_E: np.ndarray) -> np.ndarray:
    return device_of_E[:, None] == device_of_E[None, :]


def pairwise_cut(coactivation_EE: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> int:
    """Co-activations split across devices: `sum_{i<j, dev i != dev j} C[i, j]`.

    For a token whose experts put `n_d` on device d this counts `(k^2 - sum_d n_d^2) / 2` pairs, so
    it falls with CT; it is what can be measured without per-token samples. Divide by the token
    count for split pairs per token.
    """
    devices = check_device_map(device_of_E, len(device_of_E), num_devices)
    coactivation = _check_coactivation(coactivation_EE, len(devices))
    return int(np.asarray(coactivation, dtype=np.int64)[~_same_device_EE(devices)].sum() // 2)


def intra_device_ratio(coactivation_EE: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> float:
    """Fraction of all co-activations whose two experts share a device (the paper's intra-device collaboration)."""
    devices = check_device_map(device_of_E, len(device_of_E), num_devices)
    coactivation = np.asarray(_check_coactivation(coactivation_EE, len(devices)), dtype=np.float64)
    total = coactivation.sum() - np.trace(coactivation)
    if total <= 0:
        return 0.0
    same = _same_device_EE(devices)
    np.fill_diagonal(same, False)
    return float(coactivation[same].sum() / total)


# ----- drift -----------------------------------------------------------------------------------
def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank (as Spearman's rho needs)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]]))
    ends = np.concatenate([starts[1:], [len(values)]])
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def coactivation_spearman(coactivation_a_EE: np.ndarray, coactivation_b_EE: np.ndarray) -> float:
    """Spearman rank correlation of the `E(E-1)/2` expert-pair co-activation counts of two profiles.

    1.0: the same pairs are frequent in both; near 0: a placement planned on one says little about
    the other. Ties get average ranks. NaN when one side is constant.
    """
    a, b = np.asarray(coactivation_a_EE), np.asarray(coactivation_b_EE)
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"co-activation matrices must both be [E, E], got {list(a.shape)} and {list(b.shape)}")
    upper = np.triu_indices(a.shape[0], k=1)
    ranks_a, ranks_b = _average_ranks(a[upper].astype(np.float64)), _average_ranks(b[upper].astype(np.float64))
    if ranks_a.std() == 0 or ranks_b.std() == 0:
        return float("nan")
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


def routing_cost(routing: "LayerRouting", device_of_E: np.ndarray, num_devices: int) -> tuple[str, float]:
    """`("ct", mean CT on the sample)` when the layer has a token sample, else `("cut", split pairs per token)`."""
    if routing.topk_sample is not None and len(routing.topk_sample):
        return "ct", mean_ct(routing.topk_sample, device_of_E, num_devices)
    tokens = max(int(routing.token_count), 1)
    return "cut", pairwise_cut(routing.coactivation, device_of_E, num_devices) / tokens


# ----- a placement on a profile ---------------------------------------------------------------
@dataclass(frozen=True)
class LayerMetrics:
    """Every metric of one placement on one profile layer.

    CT fields are None when the layer has no token sample (pair counts only). Loads are
    tokens x experts: from the sample when there is one (so CT, load and rows describe the same
    tokens), else from the profile's expert counts.

    Attributes:
        ct: mean CT over the sample's tokens.
        ct_lower, ct_upper: `ct_bounds` for this placement's capacities.
        remote_copies: mean remote copies per token (tokens on ranks as `token_ranks`).
        max_sent_rows, max_received_rows: rows of the slowest sending and receiving rank.
        cut_per_token: split co-activation pairs per token (`pairwise_cut / token_count`).
        intra_device_ratio: fraction of co-activations kept on one device.
        load_D: `[D]` device loads.
        balance: max / mean of `load_D`.
        balance_floor: `load_floor / mean`: the best balance any placement with these capacities can reach.
        slowest_device: the device with the largest load.
        nodes: the `NodeTraffic` on the sample when the placement states its devices per node, else None.
    """

    ct: float | None
    ct_lower: int
    ct_upper: int
    remote_copies: float | None
    max_sent_rows: int | None
    max_received_rows: int | None
    cut_per_token: float
    intra_device_ratio: float
    load_D: np.ndarray
    balance: float
    balance_floor: float
    slowest_device: int
    nodes: NodeTraffic | None = None


def replica_device_load(
    topk_ids_Nk: np.ndarray | None,
    expert_load_E: np.ndarray,
    device_of_E: np.ndarray,
    num_devices: int,
    home_table_EM: np.ndarray | None = None,
    token_weight_N: np.ndarray | None = None,
) -> np.ndarray:
    """`[D]` float64 device loads (pairs served) under a placement that may have replicas.

    With a token sample: the pairs each device serves under the replica rule (`pair_devices`),
    each token weighted by `token_weight_N` (default 1). Without one (counts only): each expert's
    load split evenly over its homes, what the rule's balanced pick gives tokens that visit none
    of them (an estimate: tokens that visit a home send it more).
    """
    if home_table_EM is None or np.asarray(home_table_EM).shape[1] == 1:
        if topk_ids_Nk is None:
            return device_load(expert_load_E, device_of_E, num_devices)
        device_Nk = device_of_E[topk_ids_Nk]
    elif topk_ids_Nk is None:
        homes_EM = np.asarray(home_table_EM)
        share_E = np.asarray(expert_load_E, dtype=np.float64) / (homes_EM >= 0).sum(1)
        held = homes_EM >= 0
        return np.bincount(homes_EM[held], weights=np.broadcast_to(share_E[:, None], homes_EM.shape)[held], minlength=num_devices)
    else:
        device_Nk = pair_devices(topk_ids_Nk, device_of_E, num_devices, home_table_EM)
    weights = None
    if token_weight_N is not None:
        weights = np.repeat(np.asarray(token_weight_N, dtype=np.float64), device_Nk.shape[1])
    return np.bincount(device_Nk.ravel(), weights=weights, minlength=num_devices).astype(np.float64)


def evaluate_layer(
    routing: "LayerRouting",
    device_of_E: np.ndarray,
    num_devices: int,
    top_k: int,
    home_table_EM: np.ndarray | None = None,
    devices_per_node: int | None = None,
) -> LayerMetrics:
    """All metrics of `device_of_E` on one profile layer (see `LayerMetrics`); with `devices_per_node` (and a
    token sample) also what crosses nodes (`node_traffic`).

    With replicas (`home_table_EM` `[E, M]`, `Placement.home_table`) CT, rows and loads follow the
    replica rule; the pairwise cut and intra-device ratio stay those of the primary map, and the
    balance floor is the mean (replicas can split any expert).
    """
    num_experts = len(routing.expert_counts)
    devices = check_device_map(device_of_E, num_experts, num_devices)
    nodes = None
    replicated = home_table_EM is not None and np.asarray(home_table_EM).shape[1] > 1
    if replicated:
        homes_EM = np.asarray(home_table_EM)
        capacities_D = np.bincount(homes_EM[homes_EM >= 0], minlength=num_devices)
    else:
        capacities_D = np.bincount(devices, minlength=num_devices)
    ct_lower, ct_upper = ct_bounds(top_k, capacities_D)
    sample = routing.topk_sample
    if sample is not None and len(sample):
        volume = communication_volume(sample, devices, num_devices, home_table_EM=home_table_EM)
        load_E = expert_load(sample, num_experts)
        ct, remote = volume.ct_mean, volume.remote_copies_mean
        sent, received = volume.max_sent_rows, volume.max_received_rows
        if devices_per_node is not None:
            nodes = node_traffic(sample, devices, num_devices, devices_per_node, home_table_EM=home_table_EM)
    else:
        sample = None
        load_E = np.asarray(routing.expert_counts)
        ct = remote = sent = received = None
    load_D = replica_device_load(sample, load_E, devices, num_devices, home_table_EM)
    floor = float(load_D.mean()) if replicated else load_floor(load_E, capacities_D)
    return LayerMetrics(
        ct=ct,
        ct_lower=ct_lower,
        ct_upper=ct_upper,
        remote_copies=remote,
        max_sent_rows=sent,
        max_received_rows=received,
        cut_per_token=pairwise_cut(routing.coactivation, devices, num_devices) / max(int(routing.token_count), 1),
        intra_device_ratio=intra_device_ratio(routing.coactivation, devices, num_devices),
        load_D=load_D,
        balance=load_balance(load_D),
        balance_floor=floor / float(load_D.mean()),
        slowest_device=int(load_D.argmax()),
        nodes=nodes,
    )


def evaluate_placement(profile: "RoutingProfile", placement: "Placement") -> dict[int, LayerMetrics]:
    """`evaluate_layer` for every profile layer; the placement must cover them and match E."""
    placement.validate_for(profile.num_experts, profile.layers, exact=False, against="the routing profile")
    return {
        layer: evaluate_layer(
            routing,
            np.asarray(placement.device_of(layer)),
            placement.num_devices,
            profile.top_k,
            placement.home_table(layer) if placement.has_replicas else None,
            placement.devices_per_node,
        )
        for layer, routing in profile.layers.items()
    }


def summarize(per_layer: dict[int, LayerMetrics]) -> dict[str, float | None]:
    """Overall numbers: means over layers (CT, cut, balance) and the worst layer's balance and received rows."""
    metrics = list(per_layer.values())
    if not metrics:
        raise ValueError("summarize needs at least one layer")

    def mean_of(name: str) -> float | None:
        values = [getattr(m, name) for m in metrics]
        return None if any(v is None for v in values) else float(np.mean(values))

    received = [m.max_received_rows for m in metrics]
    nodes = [m.nodes for m in metrics]
    node_fields = {"ct_node": "ct_node_mean", "cross_rows_flat": "cross_rows_flat", "cross_rows_hierarchical": "cross_rows_hierarchical"}
    node_means = {
        key: None if any(n is None for n in nodes) else float(np.mean([getattr(n, field) for n in nodes]))
        for key, field in node_fields.items()
    }
    return {
        "ct": mean_of("ct"),
        "ct_lower": mean_of("ct_lower"),
        "cut_per_token": mean_of("cut_per_token"),
        "intra_device_ratio": mean_of("intra_device_ratio"),
        "remote_copies": mean_of("remote_copies"),
        "balance": mean_of("balance"),
        "worst_balance": float(max(m.balance for m in metrics)),
        "balance_floor": mean_of("balance_floor"),
        "max_received_rows": None if None in received else float(max(received)),
        **node_means,
    }


__all__ = [
    "CommunicationVolume",
    "LayerMetrics",
    "NodeTraffic",
    "check_device_map",
    "check_topk_ids",
    "coactivation_spearman",
    "communication_cost",
    "communication_volume",
    "ct_and_remote_T",
    "ct_bounds",
    "device_hits",
    "device_hits_TD",
    "device_load",
    "evaluate_layer",
    "evaluate_placement",
    "expert_load",
    "intra_device_ratio",
    "load_balance",
    "load_floor",
    "mean_ct",
    "node_traffic",
    "pair_devices",
    "pairwise_cut",
    "replica_device_load",
    "routing_cost",
    "summarize",
    "token_ranks",
    "token_ranks_T",
]
