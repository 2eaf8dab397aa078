"""Cross-validation in time: a planner setting chosen from the profile alone, by how its plans hold later.

A setting that trades balance on the profile for balance on later tokens (the shrinkage of `load_reliability`,
the single-home margin of `shed_margin`) cannot be chosen on the profile's own balance: every trade looks bad
there. So each profile's tokens, in sample order, are cut in two; plans are made on the first halves (all
profiles together, each candidate value, a few fixed seeds) and measured on each profile's second half; a
value's score is the worst profile's balance, averaged over the seeds, and the first value (the candidates
come in order of preference) within `margin` of the best score wins. A setting that buys balance with
something else (the pin slack of the load-aware rule buys it with CT) states the balance that is `enough`:
then the first value whose score reaches it wins, and the others are not scored. Time order, not random halves: the
tokens a placement serves come later, and a drift inside the profile is what the setting must absorb.

A plan made with W time windows per profile (`RefinedOptions.time_windows`) is judged the way it is planned:
each profile's tokens are cut into W windows (two when W = 1), the trial plans are made on all windows but the
last, each bounded as a profile of its own (the caller plans them with W - 1 windows), and measured on the
last. Trial plans that cut their part into W windows again would bound windows smaller than the final plan's,
and balance worse on the later tokens than the final plan will.

The planner and the measure come from the caller (`refined.cross_validated`), so this module imports no planner.

Shape legend (docs/conventions.md): N sampled tokens, k experts per token, E experts, P profiles.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


def choose_in_time(
    sample_Nk: np.ndarray,
    membership_PN: np.ndarray,
    num_experts: int,
    candidates: Sequence[Any],
    plan_on: Callable[..., Any],
    balance_on: Callable[[Any, np.ndarray], float],
    seeds: Sequence[int],
    margin: float,
    enough: float | None = None,
    windows: int = 1,
) -> Any:
    """The candidate whose plans hold best on each profile's later tokens (module docstring).

    Args:
        sample_Nk: `[N, k]` the pooled token sample, in sample order.
        membership_PN: `[P, N]` bool tokens of each profile.
        num_experts: `E`.
        candidates: the values, in order of preference (a later one must win by more than `margin`).
        plan_on: `plan_on(value, seed, coactivation_EE, counts_E, train_Nk, membership_PN)` -> a plan made
            on the first halves.
        balance_on: `balance_on(plan, later_Nk)` -> max / mean device load of the plan on those tokens.
        seeds: seeds of the trial plans (fixed, so that the choice is the profile's, not the final plan's).
        margin: how much a later candidate's score must beat the best so far by.
        enough: a score at or below which a candidate wins at once (the earliest such); None: the best wins.
        windows: the time windows per profile the final plan bounds: the trial plans get the first `W - 1` of
            `W` windows of each profile's tokens (with W = 1: the first half), and are measured on the last.

    Returns the first candidate when a profile has fewer than 8 tokens.
    """
    membership_PN = np.asarray(membership_PN, dtype=bool)
    index_P = [np.flatnonzero(member_N) for member_N in membership_PN]
    if min(len(index) for index in index_P) < 8:
        return candidates[0]
    parts = max(int(windows), 2)
    first_N = np.zeros(len(sample_Nk), dtype=bool)
    for index in index_P:
        first_N[index[: len(index) * (parts - 1) // parts]] = True
    train_Nk = sample_Nk[first_N]
    one_hot_NE = np.zeros((len(train_Nk), num_experts))
    np.put_along_axis(one_hot_NE, train_Nk, 1.0, axis=1)
    coactivation_EE = one_hot_NE.T @ one_hot_NE
    np.fill_diagonal(coactivation_EE, 0.0)
    counts_E = np.bincount(train_Nk.ravel(), minlength=num_experts)
    later_P = [sample_Nk[index[len(index) * (parts - 1) // parts :]] for index in index_P]
    best = None
    for value in candidates:
        scores = []
        for seed in seeds:
            plan = plan_on(value, seed, coactivation_EE, counts_E, train_Nk, membership_PN[:, first_N])
            scores.append(max(balance_on(plan, later_Nk) for later_Nk in later_P))
        score = float(np.mean(scores))
        if enough is not None and score <= enough:
            return value
        if best is None or score < best[0] - margin:
            best = (score, value)
    return best[1]


__all__ = ["choose_in_time"]
