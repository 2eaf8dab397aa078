"""The load scenarios and load limits of one `refined` layer: what the search holds under its limit.

`refined.refine_layer` builds these before its search and keeps them for the replica rule's own loads; they do
not depend on the search, only on the profile and the options, and the choices made by cross-validation
(`refined.cross_validated`) come in as values.

Shape legend (docs/conventions.md): E experts, D devices, N sampled tokens, k experts per token, Y load
scenarios, P profiles; local to `refined`: X items (the experts' copies, E plus the replicas).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..metrics import load_floor
from .robust import count_scenarios, scenario_loads, shrink_toward_mean
from .shedding import single_home_rows


@dataclass(frozen=True)
class Scenarios:
    """A layer's `[Y, E]` load scenarios with what made them, kept together because the replicas and the replica
    rule's repair re-count loads the same way on other items (`loads_of`)."""

    sample_Nk: np.ndarray | None  # the tokens planned on (a seeded subset past max_sample_tokens); None: counts only
    membership_PN: np.ndarray | None  # each profile's tokens of `sample_Nk`
    load_YE: np.ndarray
    loads_of: Callable[[np.ndarray, int], np.ndarray] | None  # `[Y, X]` loads of items serving the sample's pairs


def checked_membership(membership_PN: np.ndarray | None, num_tokens: int) -> np.ndarray:
    """`[P, N]` profiles of the sample's tokens (one profile when not given), so that each profile's limit holds."""
    if membership_PN is None:
        return np.ones((1, num_tokens), dtype=bool)
    membership_PN = np.asarray(membership_PN, dtype=bool)
    if membership_PN.ndim != 2 or membership_PN.shape[1] != num_tokens:
        raise ValueError(f"membership_PN must be [P, N={num_tokens}], got shape {list(membership_PN.shape)}")
    return membership_PN


def planned_tokens(
    sample_Nk: np.ndarray, membership_PN: np.ndarray, max_tokens: int | None, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`(sample, membership)` of at most `max_tokens` tokens (a seeded uniform subset, in sample order), to bound
    the search's time and memory on very large samples."""
    if max_tokens is not None and len(sample_Nk) > max_tokens:
        keep = np.sort(rng.choice(len(sample_Nk), max_tokens, replace=False))
        sample_Nk, membership_PN = sample_Nk[keep], membership_PN[:, keep]
    return sample_Nk, membership_PN


def sample_scenarios(
    sample_Nk: np.ndarray, membership_PN: np.ndarray, weights_YN: np.ndarray, reliability: float, num_experts: int
) -> Scenarios:
    """The sample's scenarios: its pairs weighted by each `[Y, N]` token-weight row, pulled toward the mean by
    `reliability` (`robust.shrink_toward_mean`)."""
    reliability_Y = np.full(len(weights_YN), reliability)

    def loads_of(items_Nk: np.ndarray, num_items: int) -> np.ndarray:
        """`[Y, X]` scenario loads of the items serving the sample's pairs (shrunk on request)."""
        return shrink_toward_mean(scenario_loads(items_Nk, weights_YN, num_items), reliability_Y)

    return Scenarios(sample_Nk, membership_PN, loads_of(sample_Nk, num_experts), loads_of)


def counts_scenarios(
    load_E: np.ndarray, counts_PE: np.ndarray | None, membership_PN: np.ndarray | None, resamples: int,
    rng: np.random.Generator,
) -> Scenarios:
    """Scenarios from expert counts alone, for a profile without a sample: each profile's counts (`counts_PE`, else
    the pooled `load_E`) and their resamples (`robust.count_scenarios`)."""
    load_YE = count_scenarios(load_E if counts_PE is None else counts_PE, resamples, rng)
    return Scenarios(None, membership_PN, load_YE, None)


@dataclass(frozen=True)
class Limits:
    """The load limits the search holds, with the load-aware rule's settings, which its single-home limit uses."""

    mean_Y: np.ndarray
    limit_Y: np.ndarray  # each scenario's max device load allowed
    balance_bound: float  # max(mean, load floor) / mean of the first scenario: the best balance any map reaches
    scaled_YX: np.ndarray  # the rows held under 1: the loads over limit_Y, and the single-home rows over theirs
    shed_margin: float | None = None  # None unless the replicas are planned for the load-aware rule
    pin_slack: float | None = None


def load_limits(load_YX: np.ndarray, capacities_D: np.ndarray, max_load_ratio: float, num_devices: int) -> Limits:
    """Each scenario's limit, `max_load_ratio` x its load floor (`metrics.load_floor`), with the loads scaled to it
    so that the search holds every row under 1."""
    mean_Y = load_YX.sum(1) / num_devices
    attainable_Y = np.array([load_floor(row, capacities_D) for row in load_YX])
    balance_bound = float(attainable_Y[0] / mean_Y[0]) if mean_Y[0] > 0 else 1.0
    limit_Y = np.where(attainable_Y > 0, max_load_ratio * attainable_Y, 1.0)  # no load: any map is balanced
    return Limits(mean_Y, limit_Y, balance_bound, load_YX / limit_Y[:, None])


def with_single_home_rows(
    limits: Limits, load_YX: np.ndarray, copies_X: np.ndarray, num_devices: int, shed_margin: float, pin_slack: float
) -> Limits:
    """`limits` for the load-aware rule: each device's single-home load also held within `1 - shed_margin` x the
    mean (`shedding.single_home_rows`), the room through which it sheds load to its copies' other homes."""
    single_YX, single_limit_Y = single_home_rows(load_YX, copies_X, num_devices, shed_margin)
    scaled_YX = np.concatenate([limits.scaled_YX, single_YX / single_limit_Y[:, None]])
    return Limits(limits.mean_Y, limits.limit_Y, limits.balance_bound, scaled_YX, shed_margin, pin_slack)
