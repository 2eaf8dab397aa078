"""Objective "slowest": minimise the modelled step time of the slowest device (docs/design.md §2).

A layer finishes when its slowest device finishes. Per device d, the model of its time is

    time_d = pair_cost_s x pairs_d + byte_cost_s x row_bytes x received_rows_d

where `pairs_d` are the (token, expert) pairs its experts compute and `received_rows_d` the rows
(one per (token, device) in dedup dispatch) it receives from other ranks (tokens on ranks in
contiguous chunks, `metrics.token_ranks`). `refined` with `objective="slowest"` first runs its CT
search under the load limit, then descends on `max_d time_d`: at each step, every swap of an expert
of the slowest device with an expert elsewhere (and, with unequal capacities, every move off it) is
scored exactly on the sample's tokens; the best one that lowers the maximum (ties: lower total CT)
and keeps the load limit is applied, until none does.

With replicated experts the descent works on the copies (its items: copies of one expert never share
a device), the sample's pairs mapped to the copy the replica rule serves them on; the rule's choice
moves with the copies, so `refined` keeps the result only when the rule's own times
(`device_times(..., home_table_EM=...)`) confirm the gain.

Default costs: one H200 (`docs/bench_ep_h200_1gpu.md`, Qwen1.5-MoE shape, T=16384, dedup+refined:
forward minus exchange over the 65,536 pairs: about 8.7e-8 s per pair) and NVLink all-to-all at about
400 GB/s (2.5e-12 s per byte), rows of H=2048 bf16 (4096 bytes). `costs_from_bench` reads them from
an `occult bench ep` JSON file instead.

Shape legend: N sampled tokens, k experts per token, E experts, D devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..expert_shapes import SHAPES
from ..metrics import pair_devices, token_ranks
from ..utils.strict_json import read_json_file


@dataclass(frozen=True)
class StepCosts:
    """Per-pair compute and per-byte receive costs of one device, seconds (see the module docstring)."""

    pair_cost_s: float = 8.7e-8
    byte_cost_s: float = 2.5e-12
    row_bytes: int = 4096

    def __post_init__(self) -> None:
        for name in ("pair_cost_s", "byte_cost_s", "row_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"slowest-device cost {name} must be a number >= 0, got {value!r}")


def costs_from_bench(path: str, shape: str | None = None, mode: str = "dedup+refined") -> StepCosts:
    """`StepCosts` from an `occult bench ep` JSON file: per pair, (forward - exchange) time over the
    rank's pairs; per byte, 1 / the exchange's achieved bandwidth (when it was measured, else the default).

    Uses the row of `mode` with the most tokens (of `shape` when given). The shape's k and H come
    from `occult_hf.expert_shapes.SHAPES`, the table the benchmarks time. The bench writes NaN for what
    it did not measure (a one-GPU run has no wire time), so NaN is read; the fields used are checked,
    and an error names the file, the row and the field.
    """
    label = f"bench ep results {str(path)!r}"
    data = read_json_file(path, "bench ep results", allow_nan=True)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{label}: not an `occult bench ep` result (an object with a 'rows' list)")
    rows = [
        (index, row) for index, row in enumerate(data["rows"])
        if isinstance(row, dict) and row.get("mode") == mode and (shape is None or row.get("shape") == shape)
    ]  # fmt: skip
    if not rows:
        raise ValueError(f"{label} has no row of mode {mode!r}" + (f" and shape {shape!r}" if shape else ""))
    for index, row in rows:
        _check_bench_row(row, f"{label}: rows[{index}]")
    row = max((row for _, row in rows), key=lambda r: r["tokens_per_rank"])
    spec = SHAPES[row["shape"]]
    pair_cost = (row["fwd_ms"] - row["exchange_ms"]) * 1e-3 / (row["tokens_per_rank"] * spec.top_k)
    bandwidth = row.get("bandwidth_gbs")
    byte_cost = StepCosts.byte_cost_s if bandwidth is None or not np.isfinite(bandwidth) else 1.0 / (bandwidth * 1e9)
    return StepCosts(pair_cost_s=pair_cost, byte_cost_s=byte_cost, row_bytes=spec.hidden * 2)


def _check_bench_row(row: dict, where: str) -> None:
    """Raise naming `where` and the field unless the fields `costs_from_bench` reads are usable: a known shape,
    tokens a positive integer, the times finite and the forward longer than its exchange (else no compute time
    is left to model), the bandwidth positive or not measured (absent, null or NaN)."""
    if row.get("shape") not in SHAPES:
        raise ValueError(f"{where}: shape {row.get('shape')!r} is none of the benchmark shapes {sorted(SHAPES)}")
    tokens = row.get("tokens_per_rank")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"{where}: tokens_per_rank is {tokens!r}; expected an integer >= 1")
    for name in ("fwd_ms", "exchange_ms"):
        value = row.get(name)
        if not _is_number(value) or not np.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {name} is {value!r}; expected a finite number >= 0")
    if row["fwd_ms"] <= row["exchange_ms"]:
        raise ValueError(
            f"{where}: fwd_ms {row['fwd_ms']} is not above exchange_ms {row['exchange_ms']}: no compute time is left "
            f"for the per-pair cost"
        )
    bandwidth = row.get("bandwidth_gbs")
    if bandwidth is not None and not (_is_number(bandwidth) and (np.isnan(bandwidth) or 0 < bandwidth < np.inf)):
        raise ValueError(f"{where}: bandwidth_gbs is {bandwidth!r}; expected a number > 0, or null/NaN when not measured")


def _is_number(value) -> bool:
    """A JSON number (true and false are no numbers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Times:
    """Per-device hits of the sample's tokens, pairs and received rows under a device map."""

    def __init__(self, ids_Nk: np.ndarray, device_of_E: np.ndarray, num_devices: int, costs: StepCosts) -> None:
        self.ids_Nk, self.num_devices, self.costs = ids_Nk, num_devices, costs
        self.source_N = token_ranks(len(ids_Nk), num_devices)
        flat = ids_Nk.ravel()
        order = np.argsort(flat, kind="stable")
        self.token_index = order // ids_Nk.shape[1]
        self.start = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=len(device_of_E)))])
        self.reset(device_of_E)

    def tokens_of(self, expert: int) -> np.ndarray:
        return self.token_index[self.start[expert] : self.start[expert + 1]]

    def reset(self, device_of_E: np.ndarray) -> None:
        self.device_of_E = np.array(device_of_E, dtype=np.int64)
        num_tokens = len(self.ids_Nk)
        flat = (np.arange(num_tokens)[:, None] * self.num_devices + self.device_of_E[self.ids_Nk]).ravel()
        self.hits_ND = np.bincount(flat, minlength=num_tokens * self.num_devices).reshape(num_tokens, self.num_devices)
        remote_ND = (self.hits_ND > 0) & (self.source_N[:, None] != np.arange(self.num_devices))
        self.rows_D = remote_ND.sum(0).astype(np.float64)
        self.pairs_D = self.hits_ND.sum(0).astype(np.float64)
        self.ct = float((self.hits_ND > 0).sum())

    def time_D(self, pairs_D: np.ndarray, rows_D: np.ndarray) -> np.ndarray:
        c = self.costs
        return c.pair_cost_s * pairs_D + c.byte_cost_s * c.row_bytes * rows_D

    def relocate(self, moves: list[tuple[int, int]]):
        """`(pairs_D, rows_D, ct, hits of the touched tokens)` after moving experts `(expert, device)`."""
        rows_R = np.unique(np.concatenate([self.tokens_of(e) for e, _ in moves]))
        hits_RD = self.hits_ND[rows_R].copy()
        for expert, target in moves:
            in_R = np.isin(rows_R, self.tokens_of(expert), assume_unique=True)
            hits_RD[in_R, self.device_of_E[expert]] -= 1
            hits_RD[in_R, target] += 1
        own_RD = self.source_N[rows_R][:, None] == np.arange(self.num_devices)
        before_RD, after_RD = self.hits_ND[rows_R] > 0, hits_RD > 0
        rows_D = self.rows_D + ((after_RD & ~own_RD).sum(0) - (before_RD & ~own_RD).sum(0))
        pairs_D = self.pairs_D + (hits_RD.sum(0) - self.hits_ND[rows_R].sum(0))
        ct = self.ct + float(after_RD.sum() - before_RD.sum())
        return pairs_D, rows_D, ct, (rows_R, hits_RD)

    def apply(self, moves: list[tuple[int, int]], result) -> None:
        pairs_D, rows_D, ct, (rows_R, hits_RD) = result
        for expert, target in moves:
            self.device_of_E[expert] = target
        self.hits_ND[rows_R] = hits_RD
        self.pairs_D, self.rows_D, self.ct = pairs_D, rows_D, ct


def device_times(
    ids_Nk: np.ndarray,
    device_of_E: np.ndarray,
    num_devices: int,
    costs: StepCosts = StepCosts(),
    home_table_EM: np.ndarray | None = None,
) -> np.ndarray:
    """`[D]` modelled time of each device (seconds) for the tokens `ids_Nk` under `device_of_E`, or with
    replicas (`home_table_EM` `[E, M]`) under the replica rule (`metrics.pair_devices`)."""
    ids_Nk = np.ascontiguousarray(ids_Nk, dtype=np.int64)
    if home_table_EM is not None and np.asarray(home_table_EM).shape[1] > 1:
        # one pseudo-expert per (token, slot) pair, on the device the rule serves it on
        device_Nk = pair_devices(ids_Nk, np.asarray(device_of_E), num_devices, home_table_EM)
        ids_Nk, device_of_E = np.arange(device_Nk.size).reshape(device_Nk.shape), device_Nk.ravel()
    times = _Times(ids_Nk, device_of_E, num_devices, costs)
    return times.time_D(times.pairs_D, times.rows_D)


def slowest_descent(
    ids_Nk: np.ndarray,
    device_of_E: np.ndarray,
    num_devices: int,
    costs: StepCosts,
    scaled_load_SE: np.ndarray,
    max_steps: int = 200,
    group_E: np.ndarray | None = None,
) -> np.ndarray:
    """Descend on the slowest device's modelled time from `device_of_E` (module docstring).

    `scaled_load_SE` `[S, E]`: the load scenarios scaled so that the limit is 1; a step that puts a
    device above 1 in any scenario is not taken. `group_E` `[E]` (copies of replicated experts: the
    "experts" here are copies): no step puts two copies of one group on a device. Returns the `[E]`
    device map.
    """
    times = _Times(np.ascontiguousarray(ids_Nk, dtype=np.int64), device_of_E, num_devices, costs)
    capacities = np.bincount(times.device_of_E, minlength=num_devices)
    small, large = int(capacities.min()), int(capacities.max())
    for _ in range(max_steps):
        time_D = times.time_D(times.pairs_D, times.rows_D)
        slowest = int(np.argmax(time_D))
        best_key, best = (float(time_D.max()), times.ct), None
        load_SD = scaled_load_SE @ np.eye(num_devices)[times.device_of_E]
        count_D = np.bincount(times.device_of_E, minlength=num_devices)
        for expert in np.flatnonzero(times.device_of_E == slowest):
            candidates = [[(int(expert), int(times.device_of_E[f])), (int(f), slowest)] for f in np.flatnonzero(times.device_of_E != slowest)]
            if small != large and count_D[slowest] == large:
                candidates += [[(int(expert), int(d))] for d in np.flatnonzero(count_D == small)]
            for moves in candidates:
                if group_E is not None and not _groups_apart(moves, times.device_of_E, group_E):
                    continue
                trial_SD = load_SD.copy()
                for moved, target in moves:
                    trial_SD[:, times.device_of_E[moved]] -= scaled_load_SE[:, moved]
                    trial_SD[:, target] += scaled_load_SE[:, moved]
                if trial_SD.max() > max(1.0, load_SD.max()) + 1e-12:
                    continue
                result = times.relocate(moves)
                key = (float(times.time_D(result[0], result[1]).max()), result[2])
                if key < best_key:
                    best_key, best = key, (moves, result)
        if best is None or best_key[0] >= float(time_D.max()) * (1 - 1e-12):
            break
        times.apply(*best)
    return times.device_of_E


def _groups_apart(moves: list[tuple[int, int]], device_of_E: np.ndarray, group_E: np.ndarray) -> bool:
    """True when after `moves` no device holds two items of one group."""
    after_E = device_of_E.copy()
    for item, target in moves:
        after_E[item] = target
    touched = np.isin(group_E, [group_E[item] for item, _ in moves])
    pairs = list(zip(group_E[touched].tolist(), after_E[touched].tolist()))
    return len(set(pairs)) == len(pairs)


__all__ = ["StepCosts", "costs_from_bench", "device_times", "slowest_descent"]
