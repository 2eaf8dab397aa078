"""`refined` placement (ours, the default): minimise the exact CT of the profile's token sample
under a device-load balance constraint.

Problem, per layer: choose `device_of_E` with the balanced capacities (`E % D` devices hold one
expert more) minimising

* the total CT of the top-k sample (`SampleCT`), or, when the profile has no sample, the pairwise
  cut of the co-activation counts (`PairwiseCut`),

subject to `max_d load_d <= max_load_ratio * max(mean load, load_floor)`, where `load_d` sums the
profile's expert counts (tokens x experts) on device d and `load_floor` (metrics.load_floor) is
a lower bound on the max load of any placement with these capacities (the heaviest expert plus
its lightest possible companions). It exceeds the mean when one expert is a giant (real OLMoE
layer 0 on arXiv: one expert in 98% of tokens): then a max/mean of 1.10 is unattainable, the limit
is relative to the floor instead, and `LayerPlan.balance_bound_loose` says so.

Method (iterated local search, deterministic for a seed):

1. *Initial assignment*: experts in decreasing load go to the device with the most co-activation
   with the experts already there, among devices with room and load under the limit.
2. *Repair*: if some device is still over the limit, swaps and moves that reduce the total
   overload (ties: best objective) until none is over. If none helps, the limit is raised to the
   load reached and a warning says so.
3. *Descent*: best-improvement over all feasible swaps (any two experts on different devices) and,
   when capacities are unequal, moves from a larger to a smaller device (capacities stay balanced),
   with deltas from the objective's incremental tables (only the tokens of the two experts are
   re-counted after a step).
4. *Perturbation*: `search_rounds` times, apply `kick_swaps` random feasible swaps to the best
   map, descend again, keep the result when it is no worse.

Shape legend (docs/conventions.md): E experts, D devices, N sampled tokens, k experts per token, Y load
scenarios, M most copies (homes) of one expert, P profiles; local to this file: X items (the experts'
copies, E plus the replicas), Q groups of items (the copies of one expert).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..metrics import communication_cost
from .objectives import NodesFirst, PairwiseCut, SampleCT
from ..registry import REPLICA_CHOICES
from ..replicas.routing import PIN_SLACK, home_table_from, load_aware_homes, resolve_homes_np
from .in_time import choose_in_time
from .shedding import link_groups
from .robust import time_window_membership, token_scenarios
from .placement import check_devices_per_node
from .rebalance import replan_layer_replicas
from .refined_scenarios import (
    Limits, Scenarios, checked_membership, counts_scenarios, load_limits, planned_tokens, sample_scenarios,
    with_single_home_rows,
)
from .registry import balanced_capacities, check_layer_inputs, register_planner
from .slowest import StepCosts, device_times, slowest_descent


#: objective values are integers held in float64: a step must gain at least this much
_MIN_GAIN = 0.5

OBJECTIVES = ("auto", "ct", "cut", "slowest")


@dataclass(frozen=True)
class RefinedOptions:
    """Options of the `refined` planner.

    Attributes:
        max_load_ratio: largest allowed max device load / max(mean load, load floor) (>= 1); "auto": chosen
            per layer among `AUTO_LOAD_RATIOS` by cross-validation in time (`cross_validated`, under the
            rule the replicas are planned for; the default 1.10 without a token sample).
        seed: seed of the perturbations (same inputs and seed -> same placement).
        objective: "ct" (exact CT on the sample), "cut" (pairwise cut of co-activation counts),
            "auto" (ct when the profile has a sample, else cut) or "slowest" (the ct search, then a
            descent on the slowest device's modelled time: `placement.slowest`; needs a sample).
        search_rounds: perturbation rounds of the iterated local search (0: one descent only).
        kick_swaps: random swaps per perturbation.
        max_sample_tokens: use at most this many sample tokens (a seeded uniform subset) to bound time
            and memory on very large samples; None: all.
        robust_resamples: B block-bootstrap resamples of each profile whose loads must also stay within
            the limit (0: only the profile(s) themselves); the limit then holds at about the
            `1 - 1/(B + 2)` quantile of a new sample of the same kind (`placement.robust`).
        robust_blocks: contiguous blocks the sample is cut into for the bootstrap.
        time_windows: W consecutive windows each profile's tokens (in sample order) are cut into, each held
            within the limit (and the single-home rows) as a profile of its own (`robust.time_window_membership`):
            a profile collected over time drifts, and later tokens resemble its later windows more than its
            pooled mean. 1 (default): the profiles as given. Needs a token sample (ignored for pair counts).
        load_reliability: the fraction of each profile's spread of expert loads expected to persist
            on later tokens: loads (and their resamples') are pulled toward their mean by it before
            the limit is held (`robust.shrink_toward_mean`), so the limit bounds the loads expected
            on new tokens rather than the sample's noise (an expert that looks hot in a finite
            sample is less hot later). 1.0 (default): no shrinkage; "auto": chosen per layer from the
            profile alone by cross-validation in time (`cross_validated`: plan on the first
            half of each profile's tokens with each of `AUTO_RELIABILITIES`, keep the one whose plan is
            best balanced on the second halves). Needs a token sample (ignored for pair counts).
        num_redundant_experts: R redundant expert slots (as DeepSeek's EPLB): R extra homes of hot
            experts, `ceil((E + R) / D)` slots per device, placed jointly with the others.
        replica_rounds: with replicas and a token sample, re-plan the copies this many times on the
            loads the replica rule really gives (tokens use a copy on a device they already visit).
        replica_choice: the runtime rule the replicas are planned for (`OccultConfig.replica_choice`).
            "static": the load limit holds on the loads the static rule gives (pairs pinned to a visited
            home, else round-robin): after the rounds, swaps and moves scored under the rule bring the devices
            under it; where they cannot, the plan without redundant slots, alone or with the copies that lower its
            busiest device (`rebalance.replan_layer_replicas`), is kept when it is less overloaded.
            "load_aware": the runtime splits a replicated expert's pairs by the
            batch's loads, so what bounds a device is the load no split can move, its single-home
            experts': the limit holds on the even split of the replicas, and each device's single-home
            load must also stay within `1 - shed_margin` x the mean (`shedding.single_home_rows`), so
            that a device whose experts run hotter on new tokens can shed the excess through its copies.
        shed_margin: with replica_choice "load_aware", the fraction of the mean device load kept free of
            single-home experts on every device, for the drift of loads on tokens the plan has not seen;
            "auto": chosen per layer from the profile alone by cross-validation in time under the load-aware
            rule (`cross_validated`, among `AUTO_SHED_MARGINS`). Needs a token sample ("auto" is the
            default 0.15 without one).
        pin_slack: with replica_choice "load_aware", the pin slack the runtime's rule uses in this layer (how far
            above the least max load, as a fraction of the mean device load, a device keeps pairs on a home their
            token visits anyway: more slack saves CT, less balances better; `replicas.routing.replica_shares`),
            recorded in the placement file. "auto" (default): the largest of `AUTO_PIN_SLACKS` whose plans hold
            the balance within `max_load_ratio` on later tokens, by cross-validation in time on the profile
            (`cross_validated_pin_slack`; the least slack's balance is traded for CT only where it holds); without
            a token sample `replicas.routing.PIN_SLACK`.
        devices_per_node: `G` devices per node of the cluster (None: one node): the search then minimises the
            nodes per token first (CT_node, or the co-activations split across nodes without a sample) and CT
            within the nodes second (`objectives.NodesFirst`), under the same load limits, robust options and
            replicas; device d is on node `d // G`. Set by `plan_placement(devices_per_node=G)`. Not with
            objective "slowest".
        pair_cost_s, byte_cost_s, row_bytes: the costs of objective "slowest" (seconds per
            (token, expert) pair, per received byte; bytes per row); `slowest.costs_from_bench` reads
            them from an `occult bench ep` JSON file.
    """

    max_load_ratio: float | str = 1.10
    seed: int = 0
    objective: str = "auto"
    search_rounds: int = 40
    kick_swaps: int = 8
    max_sample_tokens: int | None = 16384
    robust_resamples: int = 0
    robust_blocks: int = 32
    time_windows: int = 1
    load_reliability: float | str = 1.0
    num_redundant_experts: int = 0
    replica_rounds: int = 2
    replica_choice: str = "static"
    shed_margin: float | str = 0.15
    pin_slack: float | str = "auto"
    devices_per_node: int | None = None
    pair_cost_s: float = StepCosts.pair_cost_s
    byte_cost_s: float = StepCosts.byte_cost_s
    row_bytes: int = StepCosts.row_bytes

    def __post_init__(self) -> None:
        for name, rule, holds in (
            ("max_load_ratio", ">= 1.0", lambda v: v >= 1.0),
            ("shed_margin", "in [0, 1)", lambda v: 0.0 <= v < 1.0),
            ("pin_slack", "in [0, 1]", lambda v: 0.0 <= v <= 1.0),
            ("load_reliability", "in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        ):
            value = getattr(self, name)
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not holds(value)):
                raise ValueError(f"refined option {name} must be a number {rule} or 'auto', got {value!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"refined option objective must be one of {OBJECTIVES}, got {self.objective!r}")
        StepCosts(self.pair_cost_s, self.byte_cost_s, self.row_bytes)  # validates the costs
        if self.replica_choice not in REPLICA_CHOICES:
            raise ValueError(f"refined option replica_choice must be one of {REPLICA_CHOICES}, got {self.replica_choice!r}")
        for name, minimum in (
            ("robust_blocks", 1), ("time_windows", 1), ("seed", 0), ("search_rounds", 0), ("kick_swaps", 0),
            ("robust_resamples", 0), ("num_redundant_experts", 0), ("replica_rounds", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"refined option {name} must be an integer >= {minimum}, got {value!r}")
        per_node = self.devices_per_node
        if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1):
            raise ValueError(f"refined option devices_per_node must be None or an integer >= 1, got {per_node!r}")
        if per_node is not None and self.objective == "slowest":
            raise ValueError("refined option objective='slowest' does not model nodes; leave devices_per_node unset or use 'ct'")
        if self.max_sample_tokens is not None and (
            not isinstance(self.max_sample_tokens, int) or isinstance(self.max_sample_tokens, bool) or self.max_sample_tokens < 1
        ):
            raise ValueError(f"refined option max_sample_tokens must be None or an integer >= 1, got {self.max_sample_tokens!r}")


class _Search:
    """Device map, loads and objective of one layer's search, with the feasible steps.

    Expert loads come as `[Y, E]` scenarios (Y = 1: the profile; more with robust balance or several
    profiles), each scaled so that its device-load limit is 1: a step is feasible when no device it
    touches ends above 1 in any scenario.
    """

    def __init__(self, objective, load_YE: np.ndarray, capacities_D: np.ndarray, group_E: np.ndarray | None = None) -> None:
        self.objective = objective
        self.load_YE = np.atleast_2d(np.asarray(load_YE, dtype=np.float64))
        self.num_devices = len(capacities_D)
        self.small, self.large = int(capacities_D.min()), int(capacities_D.max())
        # copies of one expert (same group) never share a device; None: every item is its own group
        self.group_E = group_E
        self.sync()

    @property
    def device_of_E(self) -> np.ndarray:
        return self.objective.device_of_E

    def sync(self) -> None:
        one_hot_ED = np.zeros((len(self.device_of_E), self.num_devices))
        one_hot_ED[np.arange(len(self.device_of_E)), self.device_of_E] = 1.0
        self.load_YD = self.load_YE @ one_hot_ED
        self.count_D = np.bincount(self.device_of_E, minlength=self.num_devices)
        if self.group_E is not None:
            # [E, D] copies of e's group on device d, e itself excluded
            group_QD = np.zeros((int(self.group_E.max()) + 1, self.num_devices))
            np.add.at(group_QD, (self.group_E, self.device_of_E), 1.0)
            self.siblings_ED = group_QD[self.group_E] - one_hot_ED

    def swap_deltas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`[E, E]` objective deltas of swaps, and `[Y, E, E]` loads of e's and of f's device after them."""
        device_E = self.device_of_E
        move_ED = self.objective.move_delta_ED()
        toward_EE = move_ED[:, device_E]  # [e, f]: e moves to f's device
        delta_EE = toward_EE + toward_EE.T + self.objective.swap_correction_EE()
        delta_EE[device_E[:, None] == device_E[None, :]] = np.inf
        if self.group_E is not None:  # e onto f's device, f onto e's: no copy of the same expert there
            same_EE = self.group_E[:, None] == self.group_E[None, :]
            clash_EE = self.siblings_ED[:, device_E] - same_EE > 0
            delta_EE[clash_EE | clash_EE.T | same_EE] = np.inf
        own_YEE = self.load_YD[:, device_E][:, :, None] - self.load_YE[:, :, None] + self.load_YE[:, None, :]
        return delta_EE, own_YEE, own_YEE.transpose(0, 2, 1)

    def move_deltas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`[E, D]` objective deltas of moves from a larger to a smaller device; `[Y, E, D]` target
        loads and `[Y, E]` source loads after them."""
        delta_ED = self.objective.move_delta_ED().astype(np.float64, copy=True)
        allowed_ED = (self.count_D[self.device_of_E] == self.large)[:, None] & (self.count_D == self.small)[None, :]
        delta_ED[~allowed_ED] = np.inf
        if self.small == self.large:
            delta_ED[:] = np.inf
        if self.group_E is not None:
            delta_ED[self.siblings_ED > 0] = np.inf
        target_YED = self.load_YD[:, None, :] + self.load_YE[:, :, None]
        return delta_ED, target_YED, self.load_YD[:, self.device_of_E] - self.load_YE

    def apply_swap(self, first: int, second: int, delta: float) -> None:
        self.objective.apply_swap(first, second, delta)
        self.sync()

    def apply_move(self, expert: int, device: int, delta: float) -> None:
        self.objective.apply_move(expert, device, delta)
        self.sync()

    def feasible_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """Swap `[E, E]` and move `[E, D]` objective deltas, infinite where a step breaks a load limit."""
        swap_EE, load_a_YEE, load_b_YEE = self.swap_deltas()
        swap_EE[(load_a_YEE.max(0) > 1.0) | (load_b_YEE.max(0) > 1.0)] = np.inf
        move_ED, target_load_YED, _ = self.move_deltas()
        move_ED[target_load_YED.max(0) > 1.0] = np.inf
        return swap_EE, move_ED

    def _take(self, swap_EE: np.ndarray, move_ED: np.ndarray) -> float:
        """Apply the better of the best swap and the best move; return its objective delta."""
        best_swap, best_move = int(np.argmin(swap_EE)), int(np.argmin(move_ED))
        swap_delta, move_delta = swap_EE.flat[best_swap], move_ED.flat[best_move]
        if swap_delta <= move_delta:
            self.apply_swap(*divmod(best_swap, swap_EE.shape[1]), swap_delta)
            return swap_delta
        self.apply_move(*divmod(best_move, move_ED.shape[1]), move_delta)
        return move_delta

    # ----- phases -----------------------------------------------------------------------------
    def descend(self) -> None:
        """Best-improvement steps within the load limits until none gains."""
        while True:
            swap_EE, move_ED = self.feasible_steps()
            if min(swap_EE.min(), move_ED.min()) > -_MIN_GAIN:
                return
            self._take(swap_EE, move_ED)

    @staticmethod
    def overload(load: np.ndarray) -> np.ndarray:
        return np.maximum(load - 1.0, 0.0)

    def overload_steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`(swap_EE, swap_relief_EE, move_ED, move_relief_ED)`: the objective deltas of swaps and moves
        (`swap_deltas`, `move_deltas`) and the change of the total overload (over scenarios) above the limits
        each brings, infinite where the step is not allowed."""
        swap_EE, load_a_YEE, load_b_YEE = self.swap_deltas()
        before_YE = self.overload(self.load_YD[:, self.device_of_E])
        swap_relief_EE = (
            self.overload(load_a_YEE) + self.overload(load_b_YEE) - before_YE[:, :, None] - before_YE[:, None, :]
        ).sum(0)
        swap_relief_EE[~np.isfinite(swap_EE)] = np.inf
        move_ED, target_load_YED, source_load_YE = self.move_deltas()
        move_relief_ED = (
            self.overload(target_load_YED) - self.overload(self.load_YD)[:, None, :]
            + (self.overload(source_load_YE) - before_YE)[:, :, None]
        ).sum(0)
        move_relief_ED[~np.isfinite(move_ED)] = np.inf
        return swap_EE, swap_relief_EE, move_ED, move_relief_ED

    def repair(self) -> bool:
        """Reduce the total overload (over scenarios) above the limits; True when no device is left over one."""
        while self.overload(self.load_YD).sum() > 0:
            swap_EE, swap_relief_EE, move_ED, move_relief_ED = self.overload_steps()
            best_relief = min(swap_relief_EE.min(), move_relief_ED.min())
            if best_relief >= -1e-12:
                return False
            # among the steps with the largest relief, the best for the objective
            self._take(
                np.where(swap_relief_EE == best_relief, swap_EE, np.inf),
                np.where(move_relief_ED == best_relief, move_ED, np.inf),
            )
        return True

    def accept_reached_load(self) -> float:
        """Raise the limit to the largest load now reached (after a failed repair); return the factor."""
        factor = float(max(self.load_YD.max(), 1.0))
        self.load_YE = self.load_YE / factor
        self.sync()
        return factor

    def kick(self, rng: np.random.Generator, swaps: int) -> None:
        """Random feasible swaps (within the load limits), whatever they do to the objective."""
        for _ in range(swaps):
            swap_EE, _ = self.feasible_steps()
            candidates = np.flatnonzero(np.triu(np.isfinite(swap_EE), k=1))
            if len(candidates) == 0:
                return
            pick = int(candidates[rng.integers(len(candidates))])
            self.apply_swap(*divmod(pick, swap_EE.shape[1]), swap_EE.flat[pick])


def initial_assignment(
    coactivation_EE: np.ndarray,
    load_E: np.ndarray,
    capacities_D: np.ndarray,
    group_E: np.ndarray | None = None,
    devices_per_node: int | None = None,
) -> np.ndarray:
    """Balanced greedy by co-activation: heaviest expert first, to the device it collaborates with most.

    `load_E` (`[E]`, or `[Y, E]` scenarios) is scaled so that a device's load limit is 1. Among
    devices with room left that stay within the limit in every scenario (if none: the lightest
    device with room; `repair` fixes it), pick the largest co-activation with the experts already
    there; ties to the lighter, then lower-id device. With zero co-activation this is
    longest-processing-time-first balancing under capacities. `group_E`: items of one group (copies
    of one expert) go to different devices. `devices_per_node`: the co-activation with the experts already on
    the device's node comes first, then with those on the device.
    """
    load_YE = np.atleast_2d(np.asarray(load_E, dtype=np.float64))
    num_experts, num_devices = load_YE.shape[1], len(capacities_D)
    device_of_E = np.full(num_experts, -1, dtype=np.int64)
    affinity_ED = np.zeros((num_experts, num_devices))
    load_YD = np.zeros((len(load_YE), num_devices))
    count_D = np.zeros(num_devices, dtype=np.int64)
    taken_QD = None if group_E is None else np.zeros((int(group_E.max()) + 1, num_devices), dtype=bool)
    for expert in np.argsort(-load_YE.max(0), kind="stable"):
        room_D = count_D < capacities_D
        if taken_QD is not None and (room_D & ~taken_QD[group_E[expert]]).any():
            room_D &= ~taken_QD[group_E[expert]]
        fits_D = room_D & (load_YD + load_YE[:, expert : expert + 1] <= 1.0).all(0)
        worst_D = load_YD.max(0)
        if fits_D.any():
            # lexicographic: most affinity (with the node's experts first), then least load, then lowest id
            keys = (np.arange(num_devices), worst_D, -affinity_ED[expert])
            if devices_per_node is not None:
                node_D = affinity_ED[expert].reshape(-1, devices_per_node).sum(1).repeat(devices_per_node)
                keys = (*keys, -node_D)
            order = np.lexsort(keys)
            device = int(next(d for d in order if fits_D[d]))
        else:
            device = int(np.flatnonzero(room_D)[np.argmin(worst_D[room_D])])
        device_of_E[expert] = device
        if taken_QD is not None:
            taken_QD[group_E[expert], device] = True
        load_YD[:, device] += load_YE[:, expert]
        count_D[device] += 1
        affinity_ED[:, device] += coactivation_EE[:, expert]
    return device_of_E


@dataclass(frozen=True)
class LayerPlan:
    """What `refine_layer` found for one layer.

    Attributes:
        device_of_E: `[E]` int64 device of each expert.
        objective: "ct" or "cut".
        cost: objective value (total CT over the sample tokens used, or cut co-activations).
        load_limit: the max device load allowed (raised when the requested one was not reached).
        balance_bound: max(mean, load_floor) / mean: the best balance any placement can reach.
        balance_bound_loose: True when a giant expert makes `balance_bound` exceed 1 (the mean is unattainable).
        limit_reached: False when repair could not bring every device under the requested limit (with replicas
            for the static rule and a token sample: under the loads that rule gives, as the metrics measure them).
        replicas: `{expert: [extra devices]}` chosen for the redundant slots (empty without them).
        slots_per_device: expert slots per device the plan assumed (None without redundant slots).
        scenarios: load scenarios the limit was held on (profiles x (1 + resamples)).
        load_reliability: the shrinkage factor the loads were planned with (what "auto" chose).
        shed_margin: the single-home margin planned with (what "auto" chose; None unless the replicas were
            planned for the load-aware rule).
        pin_slack: the load-aware rule's pin slack for this layer (what "auto" chose; None unless the replicas
            were planned for the load-aware rule).
    """

    device_of_E: np.ndarray
    objective: str
    cost: float
    load_limit: float
    balance_bound: float
    balance_bound_loose: bool
    limit_reached: bool
    replicas: dict = field(default_factory=dict)
    slots_per_device: int | None = None
    scenarios: int = 1
    load_reliability: float = 1.0
    shed_margin: float | None = None
    pin_slack: float | None = None


def replication_counts(load_YE: np.ndarray, redundant: int, num_devices: int) -> np.ndarray:
    """`[E]` copies of each expert for `redundant` extra slots: each goes, as in EPLB, to the expert
    whose load per copy is largest (in its worst scenario, relative to that scenario's mean); at most
    one copy per device."""
    share_YE = load_YE / np.maximum(load_YE.sum(1, keepdims=True), 1e-12)
    worst_E = share_YE.max(0)
    copies_E = np.ones(load_YE.shape[1], dtype=np.int64)
    for _ in range(redundant):
        per_copy_E = np.where(copies_E < num_devices, worst_E / copies_E, -1.0)
        copies_E[int(np.argmax(per_copy_E))] += 1
    return copies_E


def copy_items(copies_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`([E, M] item id of copy m of expert e (-1: none), [X] expert of each item)`: copy 0 of e is item e,
    further copies follow after the E experts."""
    num_experts = len(copies_E)
    item_of_EM = np.full((num_experts, int(copies_E.max())), -1, dtype=np.int64)
    item_of_EM[:, 0] = np.arange(num_experts)
    group = list(range(num_experts))
    for expert in range(num_experts):
        for copy in range(1, int(copies_E[expert])):
            item_of_EM[expert, copy] = len(group)
            group.append(expert)
    return item_of_EM, np.array(group, dtype=np.int64)


def make_objective(sample, coactivation, start_E, num_devices, options):
    """The search's objective: CT of `sample` (or the pairwise cut of `coactivation` without one, or for objective
    "cut"), nodes first with `options.devices_per_node` (`objectives.NodesFirst`, weighted above any change of the
    device cost: tokens x min(k, D), or all co-activations)."""
    if sample is not None and options.objective != "cut":
        make = lambda device_of_E, n: SampleCT(sample, device_of_E, n)  # noqa: E731
        most = float(sample.shape[0] * min(sample.shape[1], num_devices))
    else:
        make = lambda device_of_E, n: PairwiseCut(coactivation, device_of_E, n)  # noqa: E731
        most = float(np.asarray(coactivation, dtype=np.float64).sum())
    per_node = options.devices_per_node
    if per_node is None or per_node >= num_devices:
        return make(start_E, num_devices)
    return NodesFirst(make, start_E, num_devices, per_node, weight=most + 1.0)


def _search(coactivation, sample, scaled_YE, start_E, capacities_D, group_X, num_devices, options, rng):
    """Repair, descent and perturbation rounds from `start_E`; `(best map, its cost, objective name,
    factor the limit had to be raised by (1.0: reached))`."""
    objective = make_objective(sample, coactivation, start_E, num_devices, options)
    search = _Search(objective, scaled_YE, capacities_D, group_X)
    factor = 1.0 if search.repair() else search.accept_reached_load()
    search.descend()
    best_E, best_cost = search.device_of_E.copy(), objective.cost
    for _ in range(options.search_rounds):
        search.kick(rng, options.kick_swaps)
        search.descend()
        if objective.cost <= best_cost:
            best_E, best_cost = search.device_of_E.copy(), objective.cost
        else:
            objective.reset(best_E)
            search.sync()
    return best_E, best_cost, objective.name, factor


def _homes_of(item_device_X: np.ndarray, group_X: np.ndarray) -> tuple[list[int], dict[int, list[int]]]:
    """`(primary device of each expert, {expert: [extra devices]})` of the items' devices: an expert's lowest
    device is its primary one."""
    homes = [sorted(item_device_X[group_X == e].tolist()) for e in range(int(group_X.max()) + 1)]
    return [h[0] for h in homes], {e: h[1:] for e, h in enumerate(homes) if len(h) > 1}


def _rule_items(item_device_X, group_X, sample_Nk, num_devices, devices_per_node=None):
    """`[N, k]` item serving each pair under the replica rule for the homes of `item_device_X`, and the
    total CT the rule gives (with `devices_per_node`: the total CT_node weighted as `objectives.NodesFirst` does,
    plus the total CT)."""
    num_experts = int(group_X.max()) + 1
    table = home_table_from(*_homes_of(item_device_X, group_X))
    dest_Nk = resolve_homes_np(sample_Nk, table, num_devices)
    item_at_ED = np.full((num_experts, num_devices), -1, dtype=np.int64)
    item_at_ED[group_X, item_device_X] = np.arange(len(group_X))
    ct = _distinct_total(dest_Nk)
    if devices_per_node is not None and devices_per_node < num_devices:
        most = float(sample_Nk.shape[0] * min(sample_Nk.shape[1], num_devices))
        ct += (most + 1.0) * _distinct_total(dest_Nk // devices_per_node)
    return item_at_ED[sample_Nk, dest_Nk], ct


def _distinct_total(values_Nk: np.ndarray) -> float:
    """The distinct values of each row, summed over rows."""
    sorted_Nk = np.sort(values_Nk, axis=1)
    return float((1 + (sorted_Nk[:, 1:] != sorted_Nk[:, :-1]).sum(1)).sum())


def _rule_score(item_device_X, group_X, sample_Nk, scaled_rows_of, num_devices, devices_per_node):
    """`((worst overload, total overload, CT), items_Nk, scaled_YX)` of the item devices under the replica rule:
    the rule's `[N, k]` serving items, their `[Y, X]` load rows `scaled_rows_of(items_Nk, X)` (each scaled to its
    limit 1), how far the busiest device of the worst row ends above 1 and the sum of every device's excess over
    the rows (0: every limit holds), and the CT (`_rule_items`)."""
    items_Nk, ct = _rule_items(item_device_X, group_X, sample_Nk, num_devices, devices_per_node)
    scaled_YX = scaled_rows_of(items_Nk, len(group_X))
    one_hot_XD = np.zeros((len(group_X), num_devices))
    one_hot_XD[np.arange(len(group_X)), item_device_X] = 1.0
    excess_YD = np.maximum(scaled_YX @ one_hot_XD - 1.0, 0.0)
    return (round(float(excess_YD.max()), 9), round(float(excess_YD.sum()), 9), ct), items_Nk, scaled_YX


def _replica_rounds(best_X, sample_Nk, scaled_rows_of, group_X, coactivation, capacities_D, num_devices, options, rng):
    """Re-plan the copies on the loads the replica rule really gives (a token goes to a copy on a device it
    already visits, not to copy `n mod copies`), `replica_rounds` times; keep the map with the lowest
    overload, then the lowest CT, under the rule. Returns `(item devices, its `_rule_score` key)`."""
    best_key, items_Nk, scaled_YX = _rule_score(best_X, group_X, sample_Nk, scaled_rows_of, num_devices, options.devices_per_node)
    current = best_X
    for _ in range(options.replica_rounds):
        current, _, _, _ = _search(coactivation, items_Nk, scaled_YX, current, capacities_D, group_X, num_devices, options, rng)
        key, items_Nk, scaled_YX = _rule_score(current, group_X, sample_Nk, scaled_rows_of, num_devices, options.devices_per_node)
        if key < best_key:
            best_key, best_X = key, current
    return best_X, best_key


#: steps each `_rule_repair` round scores under the replica rule: those the copy model ranks best
RULE_REPAIR_TRIES = 32


def _stepped(item_device_X: np.ndarray, step: int, num_swaps: int, num_devices: int) -> np.ndarray:
    """The item devices after `step`: an index into the flattened `[X, X]` swaps, then the `[X, D]` moves."""
    trial_X = item_device_X.copy()
    if step < num_swaps:
        first, second = divmod(step, len(trial_X))
        trial_X[first], trial_X[second] = item_device_X[second], item_device_X[first]
    else:
        item, device = divmod(step - num_swaps, num_devices)
        trial_X[item] = device
    return trial_X


def _rule_repair(item_device_X, group_X, sample_Nk, scaled_rows_of, coactivation, capacities_D, num_devices, options):
    """Swaps and moves that lower the overload of the loads the replica rule gives, until no device is over its
    limit or no step lowers it: each round the `RULE_REPAIR_TRIES` steps the copy model ranks best (most relief of
    the total overload with the pairs on the copies that serve them now, then the best objective) are scored under
    the rule, and the best of them (`_rule_score`: worst overload, total overload, CT) is taken if it lowers the
    overload. The model alone misleads: a moved copy changes the devices its tokens visit, and the rule moves
    their pairs with it. Returns `(item devices, key)`."""

    def score(trial_X):
        return _rule_score(trial_X, group_X, sample_Nk, scaled_rows_of, num_devices, options.devices_per_node)

    current = score(item_device_X)
    while current[0][0] > 0:
        key, items_Nk, scaled_YX = current
        objective = make_objective(items_Nk, coactivation, item_device_X, num_devices, options)
        swap_EE, swap_relief_EE, move_ED, move_relief_ED = _Search(objective, scaled_YX, capacities_D, group_X).overload_steps()
        swap_relief_EE[np.tril_indices_from(swap_relief_EE)] = np.inf  # each swap once
        relief = np.concatenate([swap_relief_EE.ravel(), move_relief_ED.ravel()])
        delta = np.concatenate([swap_EE.ravel(), move_ED.ravel()])
        steps = [step for step in np.lexsort((delta, relief))[:RULE_REPAIR_TRIES] if np.isfinite(relief[step])]
        trials = (_stepped(item_device_X, step, swap_EE.size, num_devices) for step in steps)
        best = min(((score(trial_X), trial_X) for trial_X in trials), key=lambda pair: pair[0][0], default=None)
        if best is None or best[0][0][:2] >= key[:2]:
            break
        current, item_device_X = best
    return item_device_X, current[0]


def _items_of(device_of_E: np.ndarray, replicas: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`([X] device of each item, [X] expert of each item)` of a primary map plus extra homes: item e is expert
    e's primary home, the copies follow (as `copy_items` orders them)."""
    extra = [(expert, device) for expert, devices in sorted(replicas.items()) for device in devices]
    device_X = np.array([*device_of_E, *(device for _, device in extra)], dtype=np.int64)
    group_X = np.array([*range(len(device_of_E)), *(expert for expert, _ in extra)], dtype=np.int64)
    return device_X, group_X


def _rule_fallback(best_X, group_X, key, inputs, scaled_rows_of, num_devices, slots, options):
    """`(item devices, expert of each item, key)`: the replicated map when the rule's loads on it hold the limit,
    else the least overloaded, then lowest-CT, of it and two fallbacks: the plan without redundant slots, and
    that plan plus the copies that lower its busiest device under the rule (`rebalance.replan_layer_replicas`,
    on the loads the metrics measure; added only while each lowers it, they never balance the plan worse than
    it is without them). `inputs`: the layer's `(coactivation_EE, counts_E, sample_Nk, membership_PN)`."""
    if key[0] == 0:
        return best_X, group_X, key
    coactivation_EE, counts_E, sample_Nk, membership_PN = inputs
    without = replace(options, num_redundant_experts=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its own limit is not the one judged here
        primary_E = refine_layer(
            coactivation_EE, counts_E, sample_Nk, num_devices, without, membership_PN=membership_PN
        ).device_of_E
    copies = replan_layer_replicas(primary_E, counts_E, sample_Nk, num_devices, options.num_redundant_experts, slots)
    candidates = [(best_X, group_X, key)]
    for replicas in ({}, copies):
        device_X, expert_X = _items_of(primary_E, replicas)
        score = _rule_score(device_X, expert_X, sample_Nk, scaled_rows_of, num_devices, options.devices_per_node)[0]
        candidates.append((device_X, expert_X, score))
    return min(candidates, key=lambda candidate: candidate[2])


def _slowest_with_replicas(item_device_X, sample_Nk, loads_of, group_X, limit_Y, costs, num_devices):
    """Objective "slowest" with replicas: descend on the copies, each pair on the copy the replica rule serves it
    on now; keep the result when the rule's own times confirm a lower slowest device and the rule's loads stay
    within the limits (or no further above them than before). Returns `(item devices, total CT under the rule)`."""

    def under_rule(devices_X):
        items_Nk, total_ct = _rule_items(devices_X, group_X, sample_Nk, num_devices)
        table = home_table_from(*_homes_of(devices_X, group_X))
        load_YD = loads_of(items_Nk, len(group_X)) @ np.eye(num_devices)[devices_X]
        slowest = float(device_times(sample_Nk, table[:, 0], num_devices, costs, table).max())
        return items_Nk, total_ct, slowest, float((load_YD / limit_Y[:, None]).max())

    items_Nk, ct, slowest, over = under_rule(item_device_X)
    scaled_YX = loads_of(items_Nk, len(group_X)) / limit_Y[:, None]
    trial_X = slowest_descent(items_Nk, item_device_X, num_devices, costs, scaled_YX, group_E=group_X)
    _, trial_ct, trial_slowest, trial_over = under_rule(trial_X)
    if trial_slowest < slowest and trial_over <= max(over, 1.0) + 1e-12:
        return trial_X, trial_ct
    return item_device_X, ct


#: the shrinkage factors `load_reliability="auto"` chooses among (largest first: ties keep the least shrinkage)
AUTO_RELIABILITIES = (1.0, 0.75, 0.5, 0.25)
#: the single-home margins `shed_margin="auto"` chooses among (the default first: ties keep it)
AUTO_SHED_MARGINS = (0.15, 0.2, 0.1)
#: the load limits `max_load_ratio="auto"` chooses among (the default first: ties keep it)
AUTO_LOAD_RATIOS = (1.10, 1.06, 1.03)
#: the pin slacks `pin_slack="auto"` chooses among (the most CT saved first: a later one only where it is needed)
AUTO_PIN_SLACKS = (PIN_SLACK, 0.01, 0.0)
#: seeds of the cross-validation plans: one plan's balance on new tokens is a draw, so each value is scored by
#: the mean over these (fixed, so that the choice is the profile's, not the final plan's seed's)
AUTO_SEEDS = (0, 1, 2)
#: a later candidate must beat an earlier one's cross-validated worst balance by this much to be chosen
AUTO_MARGIN = 0.005


def _trial_planner(options: "RefinedOptions", num_devices: int, name: str):
    """`plan_on` for `in_time.choose_in_time`: `refine_layer` with `name` set to the candidate, at most 8 search
    rounds, one time window fewer (the trial part holds all of the final plan's windows but the last), and any other
    "auto" setting at its default (each is chosen on its own)."""
    defaults = {
        "load_reliability": 1.0, "shed_margin": RefinedOptions.shed_margin, "max_load_ratio": RefinedOptions.max_load_ratio,
        "pin_slack": PIN_SLACK,
    }
    resolved = {key: default if getattr(options, key) == "auto" else getattr(options, key) for key, default in defaults.items()}

    def plan_on(value, seed, coactivation_EE, counts_E, train_Nk, membership_PN):
        trial = replace(
            options, **{**resolved, name: value}, search_rounds=min(options.search_rounds, 8), seed=seed,
            time_windows=max(options.time_windows - 1, 1),  # the earlier windows; `choose_in_time` measures the last
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unreachable limit on a half is part of what is measured
            return refine_layer(coactivation_EE, counts_E, train_Nk, num_devices, trial, membership_PN=membership_PN)

    return plan_on


def _served_balance(plan, later_Nk: np.ndarray, num_devices: int, replica_choice: str) -> float:
    """Max / mean device load of `later_Nk`'s pairs served by `plan`'s homes under the runtime's replica rule
    (`replica_choice`; the load-aware rule routes them as one batch, with the plan's pin slack). Without replicas
    both rules are the map."""
    table = home_table_from(plan.device_of_E, plan.replicas)
    if replica_choice == "load_aware":
        slack = PIN_SLACK if plan.pin_slack is None else plan.pin_slack
        dest_Nk = load_aware_homes(torch.from_numpy(later_Nk), torch.from_numpy(table), num_devices, pin_slack=slack).numpy()
    else:
        dest_Nk = resolve_homes_np(later_Nk, table, num_devices)
    load_D = np.bincount(np.asarray(dest_Nk).ravel(), minlength=num_devices)
    return float(load_D.max() / load_D.mean())


#: the options chosen among candidates by cross-validation in time (`cross_validated`): option -> (its
#: candidates, the replica rule the plans' later tokens are served under; None: the options' `replica_choice`)
CROSS_VALIDATED = {
    "load_reliability": (AUTO_RELIABILITIES, "static"),
    "max_load_ratio": (AUTO_LOAD_RATIOS, None),
    "shed_margin": (AUTO_SHED_MARGINS, "load_aware"),
}


def cross_validated(
    option: str, sample_Nk: np.ndarray, membership_PN: np.ndarray, num_experts: int, num_devices: int, options: "RefinedOptions"
) -> float:
    """The value of `option` among its candidates (`CROSS_VALIDATED`) whose plan holds best on later tokens, from the
    profile alone (`in_time.choose_in_time`: plans on the first half of each profile's tokens, measured on the second
    halves, each routed as one batch under the option's replica rule; the largest value within `AUTO_MARGIN` of the
    best wins). The load reliability is measured under the static rule, the load ratio under the rule the replicas
    are planned for (without replicas both are the map), the shed margin under the load-aware one
    (`replicas.routing.load_aware_homes`)."""
    candidates, rule = CROSS_VALIDATED[option]
    rule = rule or options.replica_choice
    return choose_in_time(
        sample_Nk, membership_PN, num_experts, candidates, _trial_planner(options, num_devices, option),
        lambda plan, later_Nk: _served_balance(plan, later_Nk, num_devices, rule), AUTO_SEEDS, AUTO_MARGIN,
        windows=options.time_windows,
    )


def cross_validated_pin_slack(
    sample_Nk: np.ndarray, membership_PN: np.ndarray, num_experts: int, num_devices: int, options: "RefinedOptions"
) -> float:
    """The largest pin slack of `AUTO_PIN_SLACKS` whose plans keep the worst profile's later tokens within
    `options.max_load_ratio` under the load-aware rule, else the one that balances them best
    (`in_time.choose_in_time` with `enough`). The slack does not change the plan, only how the runtime splits
    its replicas' pairs, so each seed's trial plan is made once and replayed under every candidate."""
    plan_on, plans = _trial_planner(options, num_devices, "pin_slack"), {}

    def same_plan(value, seed, *inputs):
        if seed not in plans:
            plans[seed] = plan_on(value, seed, *inputs)
        return replace(plans[seed], pin_slack=value)

    return choose_in_time(
        sample_Nk, membership_PN, num_experts, AUTO_PIN_SLACKS, same_plan,
        lambda plan, later_Nk: _served_balance(plan, later_Nk, num_devices, "load_aware"), AUTO_SEEDS, AUTO_MARGIN,
        enough=float(options.max_load_ratio), windows=options.time_windows,
    )


@dataclass(frozen=True)
class _Items:
    """What the search places, kept apart from the experts because redundant slots make each copy an item of its
    own: the experts themselves (`group_X` None) or their copies (`copy_items`)."""

    coactivation_XX: np.ndarray
    load_YX: np.ndarray
    sample_Nk: np.ndarray | None  # the item serving each pair (copy n mod copies of its expert)
    capacities_D: np.ndarray
    group_X: np.ndarray | None = None  # expert of each item
    copies_X: np.ndarray | None = None  # copies of each item's expert
    slots: int | None = None  # item slots per device


def _check_layer_options(sample_Nk: np.ndarray | None, num_devices: int, options: RefinedOptions) -> None:
    """Reject the options this layer cannot serve before any work is done on it."""
    if options.devices_per_node is not None:
        check_devices_per_node(options.devices_per_node, num_devices, "refined option devices_per_node")
    use_sample = options.objective in ("ct", "slowest") or (options.objective == "auto" and sample_Nk is not None)
    if use_sample and sample_Nk is None:
        raise ValueError(
            f"refined option objective={options.objective!r} needs a profile layer with a top-k sample; "
            "use 'cut' or 'auto'"
        )


def _sample_scenarios(sample_Nk, membership_PN, num_experts, num_devices, options, rng):
    """Load scenarios from the token sample, per time window and bootstrap resample, with the "auto" load
    reliability and ratio chosen on them by cross-validation; `(scenarios, options with those chosen)`."""
    membership_PN = checked_membership(membership_PN, len(sample_Nk))
    sample_Nk, membership_PN = planned_tokens(sample_Nk, membership_PN, options.max_sample_tokens, rng)
    windows_PN = time_window_membership(membership_PN, options.time_windows)
    weights_YN = token_scenarios(windows_PN, options.robust_resamples, options.robust_blocks, rng)
    for name in ("load_reliability", "max_load_ratio"):  # what is chosen holds from here on
        if getattr(options, name) == "auto":
            chosen = cross_validated(name, sample_Nk, membership_PN, num_experts, num_devices, options)
            options = replace(options, **{name: chosen})
    reliability = float(options.load_reliability)
    return sample_scenarios(sample_Nk, membership_PN, weights_YN, reliability, num_experts), options


def _placed_items(
    coactivation_EE: np.ndarray, scenarios: Scenarios, num_devices: int, options: RefinedOptions
) -> _Items:
    """The experts, or with redundant slots their copies with the loads and co-activation shared among them, since
    the search places items, not experts."""
    sample_Nk, load_YE, redundant = scenarios.sample_Nk, scenarios.load_YE, options.num_redundant_experts
    num_experts = load_YE.shape[1]
    if not redundant:
        return _Items(coactivation_EE, load_YE, sample_Nk, balanced_capacities(num_experts, num_devices))
    if redundant > num_experts * (num_devices - 1):  # at most one home per device
        raise ValueError(
            f"refined option num_redundant_experts={redundant} exceeds the "
            f"{num_experts * (num_devices - 1)} redundant copies {num_experts} experts can have on "
            f"{num_devices} devices"
        )
    copies_E = replication_counts(load_YE, redundant, num_devices)
    item_of_EM, group_X = copy_items(copies_E)
    if sample_Nk is not None:
        # copy (n mod copies) of an expert serves token n: the rule's balanced pick, up to the order of homes
        sample_Nk = item_of_EM[sample_Nk, np.arange(len(sample_Nk))[:, None] % copies_E[sample_Nk]]
        load_YX = scenarios.loads_of(sample_Nk, len(group_X))
    else:
        load_YX = load_YE[:, group_X] / copies_E[group_X]
    coactivation_XX = coactivation_EE[np.ix_(group_X, group_X)] / np.outer(copies_E[group_X], copies_E[group_X])
    capacities_D = balanced_capacities(len(group_X), num_devices)
    slots = -(-(num_experts + redundant) // num_devices)
    return _Items(coactivation_XX, load_YX, sample_Nk, capacities_D, group_X, copies_E[group_X], slots)


def _load_aware_settings(scenarios: Scenarios, num_devices: int, options: RefinedOptions) -> tuple[float, float]:
    """`(shed_margin, pin_slack)` of the load-aware rule, each "auto" chosen by cross-validation in time on the sample
    (the defaults without one), since the plan is made for and recorded with them."""
    sample_Nk, membership_PN, num_experts = scenarios.sample_Nk, scenarios.membership_PN, scenarios.load_YE.shape[1]
    shed_margin = options.shed_margin
    if shed_margin == "auto":
        shed_margin = RefinedOptions.shed_margin if sample_Nk is None else cross_validated(
            "shed_margin", sample_Nk, membership_PN, num_experts, num_devices, options
        )
    pin_slack = options.pin_slack
    if pin_slack == "auto":
        pin_slack = PIN_SLACK if sample_Nk is None else cross_validated_pin_slack(
            sample_Nk, membership_PN, num_experts, num_devices, replace(options, shed_margin=shed_margin)
        )
    return shed_margin, pin_slack


def _load_limits(items: _Items, scenarios: Scenarios, num_devices: int, options: RefinedOptions) -> Limits:
    """The limits on the items' loads (`refined_scenarios.load_limits`), and with the load-aware rule also on each
    device's single-home load, so that every device keeps room to shed load through its copies."""
    limits = load_limits(items.load_YX, items.capacities_D, options.max_load_ratio, num_devices)
    if items.group_X is None or options.replica_choice != "load_aware":
        return limits
    shed_margin, pin_slack = _load_aware_settings(scenarios, num_devices, options)
    return with_single_home_rows(limits, items.load_YX, items.copies_X, num_devices, shed_margin, pin_slack)


def _under_replica_rule(best_X, factor, items, scenarios, limits, inputs, num_devices, options, rng):
    """Re-plan the copies on the loads the replica rule really gives, and for the static rule bring the devices
    under the limit on them (falling back to fewer copies where they cannot be): the copy model alone misjudges
    them. `inputs`: the layer's `(coactivation_EE, counts_E)`. Returns `(item devices, expert of each item, cost,
    factor the limit is raised by)`; the load-aware rule keeps the search's `factor`."""
    sample_Nk, group_X, limit_Y = scenarios.sample_Nk, items.group_X, limits.limit_Y
    coactivation, capacities_D, load_aware = items.coactivation_XX, items.capacities_D, limits.shed_margin is not None
    if load_aware:  # the rows do not depend on which copy serves a pair: the runtime splits by load
        rows_of = lambda items_Nk, num_items: limits.scaled_YX  # noqa: E731
    else:
        rows_of = lambda items_Nk, num_items: scenarios.loads_of(items_Nk, num_items) / limit_Y[:, None]  # noqa: E731
    best_X, rule_key = _replica_rounds(
        best_X, sample_Nk, rows_of, group_X, coactivation, capacities_D, num_devices, options, rng
    )
    if load_aware:
        return best_X, group_X, rule_key[2], factor
    # the limit holds on the loads the static rule gives, as the metrics measure them
    best_X, rule_key = _rule_repair(
        best_X, group_X, sample_Nk, rows_of, coactivation, capacities_D, num_devices, options
    )
    layer = (*inputs, sample_Nk, scenarios.membership_PN)
    best_X, group_X, rule_key = _rule_fallback(
        best_X, group_X, rule_key, layer, rows_of, num_devices, items.slots, options
    )
    return best_X, group_X, rule_key[2], 1.0 + rule_key[0]


def _linked(best_X, best_cost, items, sample_Nk, scaled_YX, num_devices, options):
    """The load-aware plan with its copies joined into one linked group (`shedding.link_groups`), so that any
    device's excess can reach every other through them; `(item devices, cost)`."""
    group_X = items.group_X
    rule_sample = None if sample_Nk is None else _rule_items(best_X, group_X, sample_Nk, num_devices)[0]
    objective = make_objective(rule_sample, items.coactivation_XX, best_X, num_devices, options)
    search = _Search(objective, scaled_YX, items.capacities_D, group_X)
    link_groups(search, group_X, num_devices)
    best_X = search.device_of_E.copy()
    if sample_Nk is not None:
        best_cost = _rule_items(best_X, group_X, sample_Nk, num_devices, options.devices_per_node)[1]
    return best_X, best_cost


def _slowest_of(best_X, group_X, items, scenarios, limit_Y, num_devices, options):
    """Objective "slowest": the CT plan descended on the slowest device's modelled time, within the limits it
    reached; `(item devices, total CT of the sample)`."""
    costs = StepCosts(options.pair_cost_s, options.byte_cost_s, options.row_bytes)
    sample_Nk = scenarios.sample_Nk
    if group_X is None:
        best_X = slowest_descent(sample_Nk, best_X, num_devices, costs, items.load_YX / limit_Y[:, None])
        return best_X, float(communication_cost(sample_Nk, best_X, num_devices).sum())  # the sample's total CT
    return _slowest_with_replicas(best_X, sample_Nk, scenarios.loads_of, group_X, limit_Y, costs, num_devices)


def _place(items, scenarios, limits, inputs, num_devices, options, rng):
    """The search's phases in order: greedy start, local search, the replica rule's rounds and repair, the linking
    of the load-aware copies, the slowest-device descent. Returns `(item devices, expert of each item (None: the
    items are the experts), cost, objective name, factor the limit had to be raised by (1.0: reached))`."""
    coactivation, capacities_D, group_X = items.coactivation_XX, items.capacities_D, items.group_X
    start_X = initial_assignment(coactivation, limits.scaled_YX, capacities_D, group_X, options.devices_per_node)
    best_X, best_cost, name, factor = _search(
        coactivation, items.sample_Nk, limits.scaled_YX, start_X, capacities_D, group_X, num_devices, options, rng
    )
    if group_X is not None and scenarios.sample_Nk is not None:
        best_X, group_X, best_cost, factor = _under_replica_rule(
            best_X, factor, items, scenarios, limits, inputs, num_devices, options, rng
        )
    if limits.shed_margin is not None:  # the load-aware rule
        scaled_YX = limits.scaled_YX / factor
        best_X, best_cost = _linked(best_X, best_cost, items, scenarios.sample_Nk, scaled_YX, num_devices, options)
    if options.objective == "slowest":
        limit_Y = limits.limit_Y * factor
        best_X, best_cost = _slowest_of(best_X, group_X, items, scenarios, limit_Y, num_devices, options)
        name = "slowest"
    return best_X, group_X, best_cost, name, factor


def _warn_limit_raised(factor: float, limit: float, limits: Limits, options: RefinedOptions) -> None:
    """Say that the requested limit was out of reach and which one the plan holds instead (attributed to the
    caller of `refine_layer`)."""
    single_rule = "" if limits.shed_margin is None else (
        f" and its single-home load under (1 - shed_margin) x the mean (shed_margin={limits.shed_margin})"
    )
    warnings.warn(
        f"refined placement: could not bring every device under max_load_ratio={options.max_load_ratio} x the "
        f"load floor{single_rule} in all {len(limits.limit_Y)} load scenario(s); keeping the max load reached, "
        f"{factor:.3f}x the limits ({limit:.6g} on the profile, balance {limit / limits.mean_Y[0]:.3f}), as the limit",
        stacklevel=3,
    )


@register_planner(
    "refined",
    RefinedOptions,
    "exact CT (or pairwise cut) by local search under a load-balance limit, robust and replicated on request (default)",
    multi_profile=True,
)
def refine_layer(
    coactivation_EE: np.ndarray,
    expert_counts_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    options: RefinedOptions = RefinedOptions(),
    *,
    membership_PN: np.ndarray | None = None,
    counts_PE: np.ndarray | None = None,
) -> LayerPlan:
    """Run the refined search on one layer (see the module docstring) and report the result.

    Several profiles (pooled into the co-activation, counts and sample given): `membership_PN`
    `[P, N]` marks each profile's tokens in the pooled sample, or, without a sample, `counts_PE`
    `[P, E]` gives each profile's expert counts. The load limit then holds for each of them (and
    their resamples), not only for the pooled mean.
    """
    coactivation, load_E, sample = check_layer_inputs(coactivation_EE, expert_counts_E, topk_sample_Nk, num_devices)
    _check_layer_options(sample, num_devices, options)
    rng = np.random.default_rng(options.seed)
    if sample is not None:
        scenarios, options = _sample_scenarios(sample, membership_PN, len(load_E), num_devices, options, rng)
    else:
        scenarios = counts_scenarios(load_E, counts_PE, membership_PN, options.robust_resamples, rng)
        if options.max_load_ratio == "auto":  # nothing to cross-validate on
            options = replace(options, max_load_ratio=RefinedOptions.max_load_ratio)
    items = _placed_items(coactivation, scenarios, num_devices, options)
    limits = _load_limits(items, scenarios, num_devices, options)
    inputs = (coactivation_EE, expert_counts_E)
    best_X, group_X, cost, name, factor = _place(items, scenarios, limits, inputs, num_devices, options, rng)
    limit_reached = factor == 1.0
    limit = float(limits.limit_Y[0]) * factor
    if not limit_reached:
        _warn_limit_raised(factor, limit, limits, options)
    replicas = {}
    if group_X is not None:  # items -> homes
        primary, replicas = _homes_of(best_X, group_X)
        best_X = np.array(primary, dtype=np.int64)
    return LayerPlan(
        device_of_E=best_X,
        objective=name,
        cost=float(cost),
        load_limit=float(limit),
        balance_bound=float(limits.balance_bound),
        balance_bound_loose=bool(limits.balance_bound > 1.0 + 1e-12),
        limit_reached=limit_reached,
        replicas=replicas,
        slots_per_device=items.slots,
        scenarios=len(items.load_YX),
        load_reliability=float(options.load_reliability) if sample is not None else 1.0,
        shed_margin=limits.shed_margin,
        pin_slack=None if limits.pin_slack is None else float(limits.pin_slack),
    )
