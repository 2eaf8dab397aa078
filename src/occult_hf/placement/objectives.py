"""Placement objectives with incremental move and swap deltas, for local search (`refined`).

An objective holds the current device map and answers, for every candidate at once,

    move_delta_ED[e, b]    change of the cost if expert e moves to device b
    swap_delta(e, f)     = move_delta_ED[e, dev f] + move_delta_ED[f, dev e] + swap_correction_EE[e, f]

(the correction accounts for what e and f share; it is only meaningful for dev e != dev f).
Applying a move or swap updates the internal state from the touched part only.

* `SampleCT`: total CT over a token sample (sum over tokens of distinct devices). State: per
  token per device counts `hits_ND`. Moving e from a to b changes a token's CT by
  `-[hits[n, a] == 1] + [hits[n, b] == 0]` for the tokens holding e, so the deltas are sums over
  those tokens, kept in `[E, D]` tables `zero_ED` (tokens of e with no expert on b) and
  `lonely_ED` (tokens of e with exactly one expert on b), and `lonely_pair_EE[e, f]` (tokens
  holding e and f in which e is alone on its device). A swap touches only the tokens of e and f:
  their old contribution to the tables is subtracted and the new one added.
* `PairwiseCut`: co-activations split across devices (for profiles without a sample). State:
  `affinity_ED[e, d] = sum_{g on d} C[e, g]`.

Costs and deltas are integers held in float64 (exact far beyond any sample size used here).

Shape legend (docs/conventions.md): N sampled tokens, k experts per token, E experts, D devices; local
to this file: X the tokens a move touches, Q the devices it touches (columns of the hit table).
"""

from __future__ import annotations

import numpy as np


class SampleCT:
    """Total CT of a top-k sample under the current device map (lower is better)."""

    name = "ct"

    def __init__(self, topk_ids_Nk: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> None:
        self.ids_Nk = np.ascontiguousarray(topk_ids_Nk, dtype=np.int64)
        self.num_tokens, self.top_k = self.ids_Nk.shape
        self.num_devices = num_devices
        self.device_of_E = np.array(device_of_E, dtype=np.int64)
        self.num_experts = len(self.device_of_E)
        # tokens holding each expert, CSR: tokens_of(e) = token_index[start[e]:start[e + 1]]
        flat_ids = self.ids_Nk.ravel()
        order = np.argsort(flat_ids, kind="stable")
        self._token_index = (order // self.top_k).astype(np.int64)
        self._start = np.concatenate([[0], np.cumsum(np.bincount(flat_ids, minlength=self.num_experts))])
        self.reset(self.device_of_E)

    def tokens_of(self, expert: int) -> np.ndarray:
        return self._token_index[self._start[expert] : self._start[expert + 1]]

    def reset(self, device_of_E: np.ndarray) -> None:
        """Rebuild every table from scratch for `device_of_E`."""
        self.device_of_E = np.array(device_of_E, dtype=np.int64)
        device_Nk = self.device_of_E[self.ids_Nk]
        flat = (np.arange(self.num_tokens)[:, None] * self.num_devices + device_Nk).ravel()
        self.hits_ND = np.bincount(flat, minlength=self.num_tokens * self.num_devices).reshape(
            self.num_tokens, self.num_devices
        )
        self.cost = float((self.hits_ND > 0).sum())
        self.zero_ED, self.lonely_ED, self.lonely_pair_EE = self._tables()

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`zero_ED`, `lonely_ED` and `lonely_pair_EE` of the current hit table (module docstring)."""
        E, D, N, k = self.num_experts, self.num_devices, self.num_tokens, self.top_k
        ids_Nk = self.ids_Nk
        # every (expert slot, device) pair: index e * D + b, weight from the token's row
        slot_device = (ids_Nk[:, :, None] * D + np.arange(D)).reshape(-1)
        lonely_ND = self.hits_ND == 1
        zero_ED, lonely_ED = (
            np.bincount(slot_device, weights=np.broadcast_to(flag_ND[:, None, :], (N, k, D)).reshape(-1), minlength=E * D).reshape(E, D)
            for flag_ND in (self.hits_ND == 0, lonely_ND)
        )
        # e alone on its own device in the token, paired with every expert f of the token
        alone_Nk = np.take_along_axis(lonely_ND, self.device_of_E[ids_Nk], axis=1)
        pair = (ids_Nk[:, :, None] * E + ids_Nk[:, None, :]).reshape(-1)
        lonely_pair_EE = np.bincount(
            pair, weights=np.broadcast_to(alone_Nk[:, :, None], (N, k, k)).reshape(-1), minlength=E * E
        ).reshape(E, E)
        return zero_ED, lonely_ED, lonely_pair_EE

    def move_delta_ED(self) -> np.ndarray:
        own_lonely_E = self.lonely_ED[np.arange(self.num_experts), self.device_of_E]
        return self.zero_ED - own_lonely_E[:, None]

    def swap_correction_EE(self) -> np.ndarray:
        return self.lonely_pair_EE + self.lonely_pair_EE.T

    def _relocate(self, experts: list[int], targets: list[int], delta: float) -> None:
        """Move `experts` to `targets`; update the tables from the tokens of those experts only.

        Only the devices involved (`columns`) change their counts, so `zero_ED` and `lonely_ED`
        change in those columns only, and `lonely_pair_EE` only in the rows of slots on those
        devices whose "alone on its device" flag flipped.
        """
        E, k = self.num_experts, self.top_k
        columns_Q = np.array(sorted({int(self.device_of_E[e]) for e in experts} | {int(t) for t in targets}))
        column_of_D = np.full(self.num_devices, -1)
        column_of_D[columns_Q] = np.arange(len(columns_Q))
        touched_N = np.zeros(self.num_tokens, dtype=bool)
        for expert in experts:
            touched_N[self.tokens_of(expert)] = True
        rows_X = np.flatnonzero(touched_N)
        ids_Xk = self.ids_Nk[rows_X]
        hits_before_XQ = self.hits_ND[np.ix_(rows_X, columns_Q)]
        column_before_Xk = column_of_D[self.device_of_E[ids_Xk]]
        for expert, target in zip(experts, targets):
            tokens = self.tokens_of(expert)
            self.hits_ND[tokens, self.device_of_E[expert]] -= 1
            self.hits_ND[tokens, target] += 1
        for expert, target in zip(experts, targets):
            self.device_of_E[expert] = target
        hits_after_XQ = self.hits_ND[np.ix_(rows_X, columns_Q)]
        column_after_Xk = column_of_D[self.device_of_E[ids_Xk]]
        experts_Xk = ids_Xk.reshape(-1)
        for table, level in ((self.zero_ED, 0), (self.lonely_ED, 1)):
            change_XQ = (hits_after_XQ == level).astype(np.float64) - (hits_before_XQ == level)
            for position, column in enumerate(columns_Q):
                weights = np.repeat(change_XQ[:, position], k)
                table[:, column] += np.bincount(experts_Xk, weights=weights, minlength=E)
        # a slot's device lies among the columns before the step exactly when it does after it
        row, slot = np.nonzero(column_before_Xk >= 0)
        flipped = (hits_after_XQ[row, column_after_Xk[row, slot]] == 1).astype(np.int64) - (
            hits_before_XQ[row, column_before_Xk[row, slot]] == 1
        )
        changed = flipped != 0
        if changed.any():
            row, slot, flipped = row[changed], slot[changed], flipped[changed]
            pair = (ids_Xk[row, slot][:, None] * E + ids_Xk[row]).reshape(-1)
            self.lonely_pair_EE += np.bincount(pair, weights=np.repeat(flipped, k).astype(np.float64), minlength=E * E).reshape(E, E)
        self.cost += delta

    def apply_move(self, expert: int, device: int, delta: float) -> None:
        self._relocate([expert], [device], delta)

    def apply_swap(self, first: int, second: int, delta: float) -> None:
        self._relocate([first, second], [self.device_of_E[second], self.device_of_E[first]], delta)


class PairwiseCut:
    """Co-activations whose two experts sit on different devices (lower is better)."""

    name = "cut"

    def __init__(self, coactivation_EE: np.ndarray, device_of_E: np.ndarray, num_devices: int) -> None:
        self.coactivation_EE = np.asarray(coactivation_EE, dtype=np.float64)
        self.num_experts = len(self.coactivation_EE)
        self.num_devices = num_devices
        self.reset(device_of_E)

    def reset(self, device_of_E: np.ndarray) -> None:
        self.device_of_E = np.array(device_of_E, dtype=np.int64)
        one_hot_ED = np.zeros((self.num_experts, self.num_devices))
        one_hot_ED[np.arange(self.num_experts), self.device_of_E] = 1.0
        self.affinity_ED = self.coactivation_EE @ one_hot_ED
        internal = self.affinity_ED[np.arange(self.num_experts), self.device_of_E].sum()
        self.cost = float((self.coactivation_EE.sum() - internal) / 2)

    def move_delta_ED(self) -> np.ndarray:
        own_E = self.affinity_ED[np.arange(self.num_experts), self.device_of_E]
        return own_E[:, None] - self.affinity_ED

    def swap_correction_EE(self) -> np.ndarray:
        return 2.0 * self.coactivation_EE

    def apply_move(self, expert: int, device: int, delta: float) -> None:
        self.affinity_ED[:, self.device_of_E[expert]] -= self.coactivation_EE[:, expert]
        self.affinity_ED[:, device] += self.coactivation_EE[:, expert]
        self.device_of_E[expert] = device
        self.cost += delta

    def apply_swap(self, first: int, second: int, delta: float) -> None:
        first_device, second_device = self.device_of_E[first], self.device_of_E[second]
        self.apply_move(first, second_device, 0.0)
        self.apply_move(second, first_device, delta)



class NodesFirst:
    """CT_node first, then CT (or the pairwise cut over nodes first, then over devices): what a node-aware plan
    minimises. `G` devices per node; device d is on node `d // G`.

    One objective of the same kind per level, `devices` over the D devices and `nodes` over the D / G nodes of the
    same map, combined lexicographically: `cost = weight * nodes.cost + devices.cost` with `weight` above any change
    of the device cost, so a step that saves a node copy wins over any number of device copies. A move or swap
    inside one node leaves the node map, and the node cost, as they are.
    """

    def __init__(self, make, device_of_E: np.ndarray, num_devices: int, devices_per_node: int, weight: float) -> None:
        """`make(device_of_E, num_devices)`: a `SampleCT` or `PairwiseCut` on the same data."""
        self.devices_per_node = int(devices_per_node)
        self.node_of_D = np.arange(num_devices) // self.devices_per_node
        self.devices = make(device_of_E, num_devices)
        self.nodes = make(self.node_of_D[np.asarray(device_of_E, dtype=np.int64)], num_devices // self.devices_per_node)
        self.weight = float(weight)
        self.name = f"{self.devices.name} after nodes"

    @property
    def device_of_E(self) -> np.ndarray:
        return self.devices.device_of_E

    @property
    def cost(self) -> float:
        return self.weight * self.nodes.cost + self.devices.cost

    def reset(self, device_of_E: np.ndarray) -> None:
        self.devices.reset(device_of_E)
        self.nodes.reset(self.node_of_D[np.asarray(device_of_E, dtype=np.int64)])

    def _node_moves_ED(self) -> np.ndarray:
        """`[E, D]` change of the node cost if e moves to device d (0 inside e's node)."""
        node_E = self.nodes.device_of_E
        moves_ED = self.nodes.move_delta_ED()[:, self.node_of_D]
        return np.where(self.node_of_D[None, :] == node_E[:, None], 0.0, moves_ED)

    def move_delta_ED(self) -> np.ndarray:
        return self.devices.move_delta_ED() + self.weight * self._node_moves_ED()

    def swap_correction_EE(self) -> np.ndarray:
        node_E = self.nodes.device_of_E
        across_EE = node_E[:, None] != node_E[None, :]
        return self.devices.swap_correction_EE() + self.weight * np.where(across_EE, self.nodes.swap_correction_EE(), 0.0)

    def apply_move(self, expert: int, device: int, delta: float) -> None:
        node = int(self.node_of_D[device])
        if node != self.nodes.device_of_E[expert]:
            self.nodes.apply_move(expert, node, float(self.nodes.move_delta_ED()[expert, node]))
        self.devices.apply_move(expert, device, float(self.devices.move_delta_ED()[expert, device]))

    def apply_swap(self, first: int, second: int, delta: float) -> None:
        node_E = self.nodes.device_of_E
        if node_E[first] != node_E[second]:
            self.nodes.apply_swap(first, second, _swap_delta(self.nodes, first, second))
        self.devices.apply_swap(first, second, _swap_delta(self.devices, first, second))


def _swap_delta(objective, first: int, second: int) -> float:
    """The cost change of swapping `first` and `second` (on different devices) under `objective` (module docstring)."""
    device_E, moves_ED = objective.device_of_E, objective.move_delta_ED()
    return float(moves_ED[first, device_E[second]] + moves_ED[second, device_E[first]] + objective.swap_correction_EE()[first, second])


__all__ = ["NodesFirst", "PairwiseCut", "SampleCT"]
