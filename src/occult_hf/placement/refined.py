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

Shape legend: E experts, D devices, N sampled tokens, k experts per token.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..metrics import load_floor
from .objectives import PairwiseCut, SampleCT
from .registry import balanced_capacities, check_layer_inputs, register_planner

#: objective values are integers held in float64: a step must gain at least this much
_MIN_GAIN = 0.5

OBJECTIVES = ("auto", "ct", "cut")


@dataclass(frozen=True)
class RefinedOptions:
    """Options of the `refined` planner.

    Attributes:
        max_load_ratio: largest allowed max device load / max(mean load, load floor) (>= 1).
        seed: seed of the perturbations (same inputs and seed -> same placement).
        objective: "ct" (exact CT on the sample), "cut" (pairwise cut of co-activation counts) or
            "auto" (ct when the profile has a sample, else cut).
        search_rounds: perturbation rounds of the iterated local search (0: one descent only).
        kick_swaps: random swaps per perturbation.
        max_sample_tokens: use at most this many sample tokens (a seeded uniform subset) to bound time
            and memory on very large samples; None: all.
    """

    max_load_ratio: float = 1.10
    seed: int = 0
    objective: str = "auto"
    search_rounds: int = 40
    kick_swaps: int = 8
    max_sample_tokens: int | None = 16384

    def __post_init__(self) -> None:
        if not isinstance(self.max_load_ratio, (int, float)) or not self.max_load_ratio >= 1.0:
            raise ValueError(f"refined option max_load_ratio must be a number >= 1.0, got {self.max_load_ratio!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"refined option objective must be one of {OBJECTIVES}, got {self.objective!r}")
        for name in ("seed", "search_rounds", "kick_swaps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"refined option {name} must be an integer >= 0, got {value!r}")
        if self.max_sample_tokens is not None and (
            not isinstance(self.max_sample_tokens, int) or self.max_sample_tokens < 1
        ):
            raise ValueError(f"refined option max_sample_tokens must be None or an integer >= 1, got {self.max_sample_tokens!r}")


class _Search:
    """Device map, loads and objective of one layer's search, with the feasible steps.

    Expert loads come scaled so that the device-load limit is 1: a step is feasible when no device
    it touches ends above 1.
    """

    def __init__(self, objective, load_E: np.ndarray, capacities_D: np.ndarray) -> None:
        self.objective = objective
        self.load_E = np.asarray(load_E, dtype=np.float64)
        self.num_devices = len(capacities_D)
        self.small, self.large = int(capacities_D.min()), int(capacities_D.max())
        self.sync()

    @property
    def device_of_E(self) -> np.ndarray:
        return self.objective.device_of_E

    def sync(self) -> None:
        self.load_D = np.bincount(self.device_of_E, weights=self.load_E, minlength=self.num_devices)
        self.count_D = np.bincount(self.device_of_E, minlength=self.num_devices)

    def swap_deltas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`[E, E]` objective deltas of swaps, and loads of e's and of f's device after them."""
        device_E = self.device_of_E
        move_ED = self.objective.move_delta_ED()
        toward_EE = move_ED[:, device_E]  # [e, f]: e moves to f's device
        delta_EE = toward_EE + toward_EE.T + self.objective.swap_correction_EE()
        delta_EE[device_E[:, None] == device_E[None, :]] = np.inf
        own_EE = self.load_D[device_E][:, None] - self.load_E[:, None] + self.load_E[None, :]
        return delta_EE, own_EE, own_EE.T

    def move_deltas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`[E, D]` objective deltas of moves from a larger to a smaller device; `[E, D]` target
        loads and `[E]` source loads after them."""
        delta_ED = self.objective.move_delta_ED().astype(np.float64, copy=True)
        allowed_ED = (self.count_D[self.device_of_E] == self.large)[:, None] & (self.count_D == self.small)[None, :]
        delta_ED[~allowed_ED] = np.inf
        if self.small == self.large:
            delta_ED[:] = np.inf
        return delta_ED, self.load_D[None, :] + self.load_E[:, None], self.load_D[self.device_of_E] - self.load_E

    def apply_swap(self, first: int, second: int, delta: float) -> None:
        self.objective.apply_swap(first, second, delta)
        self.sync()

    def apply_move(self, expert: int, device: int, delta: float) -> None:
        self.objective.apply_move(expert, device, delta)
        self.sync()

    def feasible_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """Swap `[E, E]` and move `[E, D]` objective deltas, infinite where a step breaks a load limit."""
        swap_EE, load_a_EE, load_b_EE = self.swap_deltas()
        swap_EE[(load_a_EE > 1.0) | (load_b_EE > 1.0)] = np.inf
        move_ED, target_load_ED, _ = self.move_deltas()
        move_ED[target_load_ED > 1.0] = np.inf
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

    def repair(self) -> bool:
        """Reduce the total overload above the limits; True when no device is left over one."""
        while self.overload(self.load_D).sum() > 0:
            swap_EE, load_a_EE, load_b_EE = self.swap_deltas()
            before_E = self.overload(self.load_D[self.device_of_E])
            swap_relief_EE = self.overload(load_a_EE) + self.overload(load_b_EE) - before_E[:, None] - before_E[None, :]
            swap_relief_EE[~np.isfinite(swap_EE)] = np.inf
            move_ED, target_load_ED, source_load_E = self.move_deltas()
            move_relief_ED = (
                self.overload(target_load_ED) - self.overload(self.load_D)[None, :]
                + (self.overload(source_load_E) - before_E)[:, None]
            )
            move_relief_ED[~np.isfinite(move_ED)] = np.inf
            best_relief = min(swap_relief_EE.min(), move_relief_ED.min())
            if best_relief >= 0:
                return False
            # among the steps with the largest relief, the best for the objective
            self._take(
                np.where(swap_relief_EE == best_relief, swap_EE, np.inf),
                np.where(move_relief_ED == best_relief, move_ED, np.inf),
            )
        return True

    def accept_reached_load(self) -> float:
        """Raise the limit to the largest load now reached (after a failed repair); return the factor."""
        factor = float(max(self.load_D.max(), 1.0))
        self.load_E = self.load_E / factor
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


def initial_assignment(coactivation_EE: np.ndarray, load_E: np.ndarray, capacities_D: np.ndarray) -> np.ndarray:
    """Balanced greedy by co-activation: heaviest expert first, to the device it collaborates with most.

    `load_E` is scaled so that a device's load limit is 1. Among devices with room left that stay
    within the limit (if none: the lightest device with room; `repair` fixes it), pick the largest
    co-activation with the experts already there; ties to the lighter, then lower-id device. With
    zero co-activation this is longest-processing-time-first balancing under capacities.
    """
    num_experts, num_devices = len(load_E), len(capacities_D)
    device_of_E = np.full(num_experts, -1, dtype=np.int64)
    affinity_ED = np.zeros((num_experts, num_devices))
    load_D = np.zeros(num_devices)
    count_D = np.zeros(num_devices, dtype=np.int64)
    for expert in np.argsort(-load_E, kind="stable"):
        room_D = count_D < capacities_D
        fits_D = room_D & (load_D + load_E[expert] <= 1.0)
        if fits_D.any():
            # lexicographic: most affinity, then least load, then lowest id
            order = np.lexsort((np.arange(num_devices), load_D, -affinity_ED[expert]))
            device = int(next(d for d in order if fits_D[d]))
        else:
            device = int(np.flatnonzero(room_D)[np.argmin(load_D[room_D])])
        device_of_E[expert] = device
        load_D[device] += load_E[expert]
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
        limit_reached: False when repair could not bring every device under the requested limit.
    """

    device_of_E: np.ndarray
    objective: str
    cost: float
    load_limit: float
    balance_bound: float
    balance_bound_loose: bool
    limit_reached: bool


def refine_layer(
    coactivation_EE: np.ndarray,
    expert_counts_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    options: RefinedOptions = RefinedOptions(),
) -> LayerPlan:
    """Run the refined search on one layer (see the module docstring) and report the result."""
    coactivation, load_E, sample = check_layer_inputs(coactivation_EE, expert_counts_E, topk_sample_Nk, num_devices)
    num_experts = len(load_E)
    rng = np.random.default_rng(options.seed)
    capacities_D = balanced_capacities(num_experts, num_devices)
    use_sample = options.objective == "ct" or (options.objective == "auto" and sample is not None)
    if use_sample and sample is None:
        raise ValueError("refined option objective='ct' needs a profile layer with a top-k sample; use 'cut' or 'auto'")
    if sample is not None and options.max_sample_tokens is not None and len(sample) > options.max_sample_tokens:
        sample = sample[np.sort(rng.choice(len(sample), options.max_sample_tokens, replace=False))]
    mean_load = load_E.sum() / num_devices
    attainable = load_floor(load_E, capacities_D)
    balance_bound = attainable / mean_load if mean_load > 0 else 1.0
    limit = options.max_load_ratio * attainable if attainable > 0 else 1.0  # no load at all: any map is balanced
    scaled_load_E = load_E / limit
    start_E = initial_assignment(coactivation, scaled_load_E, capacities_D)
    if use_sample:
        objective = SampleCT(sample, start_E, num_devices)
    else:
        objective = PairwiseCut(coactivation, start_E, num_devices)
    search = _Search(objective, scaled_load_E, capacities_D)
    limit_reached = search.repair()
    if not limit_reached:
        limit *= search.accept_reached_load()
        warnings.warn(
            f"refined placement: could not bring every device under max_load_ratio={options.max_load_ratio} x the "
            f"load floor {attainable:.6g}; keeping the max load reached, {limit:.6g} (balance "
            f"{limit / mean_load:.3f}), as the limit",
            stacklevel=2,
        )
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
    return LayerPlan(
        device_of_E=best_E,
        objective=objective.name,
        cost=float(best_cost),
        load_limit=float(limit),
        balance_bound=float(balance_bound),
        balance_bound_loose=bool(balance_bound > 1.0 + 1e-12),
        limit_reached=limit_reached,
    )


@register_planner("refined", RefinedOptions, "exact CT (or pairwise cut) by local search under a load-balance limit (default)")
def plan_refined_layer(
    coactivation_EE: np.ndarray,
    expert_counts_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    options: RefinedOptions,
) -> np.ndarray:
    """`[E]` int64 device map from `refine_layer`."""
    return refine_layer(coactivation_EE, expert_counts_E, topk_sample_Nk, num_devices, options).device_of_E
