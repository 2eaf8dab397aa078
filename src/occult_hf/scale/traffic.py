"""What one MoE layer moves and computes on its busiest device: from a routing replayed at D, or from a measured CT.

The cost model (`cost`) turns a `LayerTraffic` into time. Two ways to get one:

* `replay_traffic`: the routing of a trace (its held-out tokens) under a placement at `D` devices, `G` per node,
  with node- and device-limited pruning. Every rank's T tokens are drawn from the same routing, so each figure
  is the expectation of a rank's T tokens (large T: the law of large numbers; the table then reflects the
  placement, not the sample's noise), and each link's figure is its busiest device's:
  - pairs: the (token, expert) pairs device d computes, `T * D * mean_n(pairs of token n on d)`;
  - flat exchange (one row per (token, device), `dedup`; per (token, expert), `per_expert`): rank r sends
    `T * p_d` rows to every other device d (`p_d`: the share of tokens reaching d, or pairs per token on d),
    over NVLink inside its node, over its own inter-node link to other nodes; device d receives as much from
    every other rank;
  - hierarchical exchange (`dedup` only): one copy per (token, other node) over the inter-node link to the
    device of the sender's rail on that node (`T * sum_m' q_m'`, `q_m`: the share of tokens reaching node m),
    then that device forwards it over NVLink to the node's other devices it needs; inside a node NVLink
    carries the node's own tokens and everything that arrived for it: N times the flat exchange's NVLink
    rows (N nodes);
  - pruning (`max_nodes_per_token` N_n, `max_devices_per_token` N_d): the project's own walks
    (`pruning.token_device_sets`: nodes first, then devices among the kept nodes' devices), on the routing
    weights (the trace's, else its score order); a pruned expert's pair moves to the token's best kept device
    (as the router / similarity policies re-select on the kept devices), so pairs per token stay k.
* `measured_traffic`: a measured two-GPU row, which records CT but not its per-rank split: each token sends
  `CT * (D - 1) / D` rows (its own device is one of its CT devices with probability CT / D), and the pairs split
  evenly over the ranks unless the replayed split of the row's trace says otherwise (`benchmarks.paper_replay`, shipped with the measurements).

Bytes per row: a dispatch row is the token's H bf16 values plus 6 bytes per pair it carries (an int32 slot
and a bf16 weight: k in `dedup`, one in `per_expert`); the combine row returns H bf16 values.

Shape legend (docs/conventions.md): N tokens (the replayed sample), k experts per token, E experts, D devices;
local to this file: Q nodes of G devices each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..metrics import device_hits
from ..pruning import token_device_sets

#: the exchanges the model knows: one row per (token, expert), per (token, device), per (token, node) then device
DISPATCHES = ("per_expert", "dedup", "hierarchical")


@dataclass(frozen=True)
class LayerTraffic:
    """One MoE layer's work on its busiest device, per forward (the backward repeats the exchange in reverse).

    Attributes:
        dispatch: one of `DISPATCHES`.
        tokens: T tokens per rank.
        pairs: (token, expert) pairs the busiest device computes.
        rows: rows the busiest rank packs and unpacks (its tokens' rows, plus the rows it forwards).
        nvlink_bytes: bytes the busiest device sends or receives over NVLink (dispatch + combine).
        internode_bytes: the same over its inter-node link (0 inside one node).
        ct: mean devices per token; ct_node: mean nodes per token.
        imbalance: the busiest device's pairs over the mean device's.
        removed_slots: share of (token, expert) slots pruning moved; removed_weight: their share of routing weight
            (None where the routing has no weights).
    """

    dispatch: str
    tokens: int
    pairs: float
    rows: float
    nvlink_bytes: float
    internode_bytes: float
    ct: float
    ct_node: float
    imbalance: float = 1.0
    removed_slots: float = 0.0
    removed_weight: float | None = 0.0

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch {self.dispatch!r} is not one of {', '.join(DISPATCHES)}")


def row_bytes(dispatch: str, hidden: int, top_k: int) -> int:
    """Bytes of one dispatch row plus its combine row (bf16 values, 6 bytes per carried pair)."""
    pairs_per_row = 1 if dispatch == "per_expert" else top_k
    return 2 * hidden + 6 * pairs_per_row + 2 * hidden


def measured_traffic(
    dispatch: str, tokens: int, ct: float, top_k: int, hidden: int, num_devices: int = 2, busiest_share: float | None = None
) -> LayerTraffic:
    """The traffic of a measured row on `num_devices` GPUs of one node from its recorded CT (module docstring); the
    busiest device computes `busiest_share` of the group's pairs (None: an even split)."""
    share = 1 / num_devices if busiest_share is None else busiest_share
    rows_per_token = top_k if dispatch == "per_expert" else ct
    remote_rows = tokens * rows_per_token * (num_devices - 1) / num_devices
    return LayerTraffic(
        dispatch, tokens, pairs=float(tokens * num_devices * top_k * share), rows=float(tokens * rows_per_token),
        nvlink_bytes=remote_rows * row_bytes(dispatch, hidden, top_k), internode_bytes=0.0, ct=ct, ct_node=1.0,
        imbalance=share * num_devices,
    )  # fmt: skip


def pruned_routing(
    topk_ids_Nk: np.ndarray,
    weights_Nk: np.ndarray,
    device_of_E: np.ndarray,
    num_devices: int,
    devices_per_node: int,
    max_devices_per_token: int | None = None,
    max_nodes_per_token: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`([N, k] serving device of each pair, [N, k] bool pruned)` under node- then device-limited pruning.

    The walks are `pruning.token_device_sets` (the library's): nodes by their best expert's weight, then devices
    among the kept nodes' devices. A pruned pair is served by the token's best kept device (its first expert's,
    which the walk always keeps).
    """
    ids = torch.as_tensor(np.ascontiguousarray(topk_ids_Nk), dtype=torch.int64)
    weights = torch.as_tensor(np.ascontiguousarray(weights_Nk), dtype=torch.float32)
    device_E = torch.as_tensor(np.asarray(device_of_E), dtype=torch.int64)
    device_Nk = device_E[ids]
    allowed_ND = torch.ones(ids.shape[0], num_devices, dtype=torch.bool)
    if max_nodes_per_token is not None:
        nodes_NQ = token_device_sets(ids, weights, device_E // devices_per_node, num_devices // devices_per_node, max_nodes_per_token)
        allowed_ND = nodes_NQ[:, torch.arange(num_devices) // devices_per_node]
    if max_devices_per_token is not None:
        allowed_ND = token_device_sets(ids, weights, device_E, num_devices, max_devices_per_token, within_TD=allowed_ND)
    pruned_Nk = ~allowed_ND.gather(1, device_Nk)
    best_N = device_Nk.gather(1, weights.argmax(1, keepdim=True))
    return torch.where(pruned_Nk, best_N, device_Nk).numpy(), pruned_Nk.numpy()


def replay_traffic(
    topk_ids_Nk: np.ndarray,
    weights_Nk: np.ndarray | None,
    device_of_E: np.ndarray,
    num_devices: int,
    devices_per_node: int,
    tokens: int,
    dispatch: str,
    hidden: int,
    max_devices_per_token: int | None = None,
    max_nodes_per_token: int | None = None,
) -> LayerTraffic:
    """The busiest device's `LayerTraffic` of `topk_ids_Nk` `[N, k]` replayed at `tokens` per rank (module docstring).

    `weights_Nk` `[N, k]` orders the pruning walks; None: the trace's slot order (a score-ordered trace), and no
    removed-weight figure.
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch {dispatch!r} is not one of {', '.join(DISPATCHES)}")
    if num_devices % devices_per_node:
        raise ValueError(f"devices_per_node {devices_per_node} does not divide num_devices {num_devices}")
    ids = np.asarray(topk_ids_Nk, dtype=np.int64)
    top_k, num_nodes, group = ids.shape[1], num_devices // devices_per_node, devices_per_node
    ranked = weights_Nk is None
    by_rank_Nk = np.broadcast_to(np.arange(top_k, 0, -1, dtype=np.float32), ids.shape)
    weights = by_rank_Nk if ranked else np.asarray(weights_Nk, dtype=np.float32)
    device_Nk, pruned_Nk = pruned_routing(ids, weights, device_of_E, num_devices, group, max_devices_per_token, max_nodes_per_token)
    hits_ND = device_hits(device_Nk, np.arange(num_devices), num_devices)
    reached_ND = hits_ND > 0
    node_of_D = np.arange(num_devices) // group
    reached_NQ = reached_ND.reshape(len(ids), num_nodes, group).any(2)
    pairs_D = tokens * num_devices * hits_ND.mean(0)
    share_D = (hits_ND if dispatch == "per_expert" else reached_ND).mean(0)  # rows per token to each device
    same_node_DD = node_of_D[:, None] == node_of_D[None, :]
    # each sum over the devices it names (not a total less the others): exactly 0 where it names none, so that
    # one node sends no inter-node byte and pays no inter-node latency
    to_own_node_D = ((same_node_DD & ~np.eye(num_devices, dtype=bool)) * share_D[None, :]).sum(1)  # to its node's others
    to_other_nodes_D = (~same_node_DD * share_D[None, :]).sum(1)
    if dispatch == "hierarchical":
        share_Q = reached_NQ.mean(0)
        node_share_D = share_Q[node_of_D]  # per device: the share of tokens reaching its node
        internode_rows = tokens * np.maximum(share_Q.sum() - node_share_D, (num_nodes - 1) * node_share_D).max()
        nvlink_rows = tokens * np.maximum(num_nodes * to_own_node_D, num_nodes * (group - 1) * share_D).max()
        # packed per device: one copy per other node, its own node's rows, and the forwarded copies
        rows = tokens * (share_Q.sum() - node_share_D + share_D + num_nodes * to_own_node_D).max()
    else:
        internode_rows = tokens * np.maximum(to_other_nodes_D, (num_devices - group) * share_D).max()
        nvlink_rows = tokens * np.maximum(to_own_node_D, (group - 1) * share_D).max()
        rows = tokens * share_D.sum()
    per_row = row_bytes(dispatch, hidden, top_k)
    return LayerTraffic(
        dispatch, tokens, pairs=float(pairs_D.max()), rows=float(rows),
        nvlink_bytes=float(nvlink_rows * per_row), internode_bytes=float(internode_rows * per_row),
        ct=float(reached_ND.sum(1).mean()), ct_node=float(reached_NQ.sum(1).mean()),
        imbalance=float(pairs_D.max() / pairs_D.mean()),
        removed_slots=float(pruned_Nk.mean()),
        removed_weight=None if ranked else float((weights * pruned_Nk).sum() / weights.sum()),
    )  # fmt: skip


__all__ = ["DISPATCHES", "LayerTraffic", "measured_traffic", "pruned_routing", "replay_traffic", "row_bytes"]
