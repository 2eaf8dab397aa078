"""The replica routing rule (DESIGN.md §6): which home of an expert serves a (token, expert) pair.

With replicated experts a placement gives some experts several homes. Every consumer (the
dispatch plan of the runtime, the metrics, the planner) must agree on which home serves a pair,
so the rule lives here once, as a pure function on tensors:

1. the token's *visited* devices are the homes of its single-home experts (it goes there anyway),
   plus any devices the caller says it visits (`visited_TD`: collaboration pruning passes the
   token's N_d devices, so that every pair stays on them);
2. a pair whose expert has a home on a visited device goes to the lowest such device (a replica
   on a device the token already visits costs no extra copy of the token: it cuts CT and load);
3. otherwise to `homes[token_index % number of homes]`: deterministic, and it spreads the expert's
   other tokens evenly over its homes.

A single-home expert always goes to its one home (its device is visited by construction), so a
placement without replicas routes exactly as `device_of_E[topk_ids]`.

`resolve_homes` is torch (the runtime calls it on the tokens' device without host
synchronisation); `resolve_homes_np` wraps it for the numpy metrics and planners.

Shape legend: T tokens, k experts per token, E experts, M most homes of one expert, D devices.
"""

from __future__ import annotations

import numpy as np
import torch


def resolve_homes(
    topk_ids_Tk: torch.Tensor,
    home_table_EM: torch.Tensor,
    num_devices: int,
    token_index_T: torch.Tensor | None = None,
    visited_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, k]` int64 device serving each (token, expert) pair under the replica rule (module docstring).

    Args:
        topk_ids_Tk: `[T, k]` int expert ids in `[0, E)`.
        home_table_EM: `[E, M]` int64 homes of each expert in increasing device id, -1 padded
            (`Placement.home_table`); every row holds at least one home.
        num_devices: `D`.
        token_index_T: `[T]` int64 index of each token for the balanced rule (default `arange(T)`).
        visited_TD: `[T, D]` bool devices each token visits anyway besides its single-home experts'
            (None: none). A pair whose expert has a home there goes to the lowest such home.
    """
    ids_Tk = topk_ids_Tk.long()
    num_tokens, top_k = ids_Tk.shape
    homes_TkM = home_table_EM[ids_Tk]
    if homes_TkM.shape[-1] == 1:  # no replicas in this layer: the primary map
        return homes_TkM[..., 0]
    num_homes_Tk = (homes_TkM >= 0).sum(-1)
    first_Tk = homes_TkM[..., 0]
    # visited devices: the homes of single-home experts (column D collects the others and is dropped)
    visited_TD1 = torch.zeros(num_tokens, num_devices + 1, dtype=torch.bool, device=ids_Tk.device)
    if visited_TD is not None:
        visited_TD1[:, :num_devices] = visited_TD
    visited_TD1.scatter_(1, torch.where(num_homes_Tk == 1, first_Tk, num_devices), True)
    on_visited_TkM = (homes_TkM >= 0) & visited_TD1.gather(
        1, homes_TkM.clamp_min(0).reshape(num_tokens, -1)
    ).reshape(homes_TkM.shape)
    if token_index_T is None:
        token_index_T = torch.arange(num_tokens, device=ids_Tk.device)
    balanced_Tk = token_index_T.long()[:, None] % num_homes_Tk
    # the first visited home (homes are in increasing device id), else the balanced pick
    choice_Tk = torch.where(on_visited_TkM.any(-1), on_visited_TkM.int().argmax(-1), balanced_Tk)
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


def home_table_from(device_of_E: np.ndarray, replicas: dict[int, list[int]] | None) -> np.ndarray:
    """`[E, M]` int64 home table (increasing device ids, -1 padded) of a primary map plus extra homes."""
    device_of_E = np.asarray(device_of_E, dtype=np.int64)
    replicas = replicas or {}
    homes = [sorted([int(d), *replicas.get(e, [])]) for e, d in enumerate(device_of_E)]
    table = np.full((len(homes), max(len(h) for h in homes)), -1, dtype=np.int64)
    for expert, devices in enumerate(homes):
        table[expert, : len(devices)] = devices
    return table


__all__ = ["home_table_from", "resolve_homes", "resolve_homes_np"]
