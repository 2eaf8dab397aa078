"""Load scenarios for robust balance: what a placement's load limit must hold on besides the profile.

A profile is a finite sample, and the tokens a placement serves later differ from it (other
documents, decoding instead of prefill, another domain, the routing after a fine-tune). The
`refined` planner therefore bounds the device loads of several *scenarios* at once, each an `[E]`
vector of expert loads with its own limit (`max_load_ratio` x its own load floor):

* the profile itself, or each of several profiles (domains, prefill and decode, before and after
  a fine-tune): the worst of them is bounded, not their pooled mean;
* with `time_windows` W > 1, each profile's tokens in sample order cut into W consecutive windows
  (`time_window_membership`), each bounded as a profile of its own: a profile collected over time drifts,
  and the pooled mean of a part hides a drift its windows show;
* `robust_resamples` block-bootstrap resamples of each of them (`block_bootstrap_weights`): the
  sample's tokens are cut into `robust_blocks` contiguous blocks (tokens of one document or batch
  are correlated: resampling single tokens would understate the variation), and Q resamples draw
  that many blocks with replacement. A limit met on the sample and on all Q resamples is met at
  about the `1 - 1/(Q + 2)` quantile of the load a new sample of the same kind brings
  (`stated_quantile`). Without a token sample (pair counts only) the resamples are Poisson draws of
  the expert counts (independent sampling error per expert).

With `load_reliability` the planner also corrects for regression to the mean: an expert that looks hot
in a finite profile is, on average, less hot on later tokens. Each profile's loads are pulled toward
their mean by a reliability factor (`shrink_toward_mean`): how much of the spread between experts
persists on new tokens, given, or chosen by the planner from the profile alone ("auto":
`refined.cross_validated` plans on the first half of each profile's tokens with several
factors and keeps the one that holds best on the second half). `split_half_reliability` (the
correlation of the expert loads of the two halves, stepped up by Spearman-Brown) is a diagnostic only:
it shrinks too little.

A scenario is a row of token weights `[Y, N]` over the pooled sample when there is one (so the
replica rule can be applied per token), else a row of expert loads `[Y, E]`.

Shape legend (docs/conventions.md): Y load scenarios, N sampled tokens, k experts per token, E experts, P
profiles; local to this file: Q bootstrap resamples, X blocks of tokens.
"""

from __future__ import annotations

import numpy as np


def stated_quantile(resamples: int) -> float:
    """The quantile at which a limit met on the sample and on `resamples` resamples holds: `1 - 1/(Q + 2)`
    (Q + 1 draws that all stay under the limit: the next one exceeds all of them with probability 1/(Q + 2))."""
    return 1.0 - 1.0 / (resamples + 2)


def block_bootstrap_weights(num_tokens: int, resamples: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`[Q, N]` float64 multiplicity of each token in Q block-bootstrap resamples of N tokens.

    The tokens (in sample order) are cut into `min(blocks, N)` contiguous blocks of nearly equal
    size; a resample draws that many blocks with replacement, and a token's weight is the number
    of times its block was drawn.
    """
    num_blocks = max(1, min(int(blocks), num_tokens))
    block_of_N = np.arange(num_tokens) * num_blocks // max(num_tokens, 1)
    draws_QX = rng.integers(num_blocks, size=(resamples, num_blocks))
    times_QX = np.stack([np.bincount(row, minlength=num_blocks) for row in draws_QX]) if resamples else np.zeros((0, num_blocks))
    return times_QX[:, block_of_N].astype(np.float64)


def time_window_membership(membership_PN: np.ndarray, windows: int) -> np.ndarray:
    """`[P x W, N]` bool: each profile's tokens (in sample order) cut into `windows` consecutive windows of nearly
    equal size, profile by profile (1 window: the profiles as given; a window without tokens bounds nothing)."""
    rows = []
    for member_N in np.asarray(membership_PN, dtype=bool):
        for index in np.array_split(np.flatnonzero(member_N), windows):
            window_N = np.zeros(len(member_N), dtype=bool)
            window_N[index] = True
            rows.append(window_N)
    return np.stack(rows)


def token_scenarios(
    membership_PN: np.ndarray, resamples: int, blocks: int, rng: np.random.Generator
) -> np.ndarray:
    """`[Y, N]` token weights: each profile's indicator row, then its block-bootstrap resamples.

    `membership_PN` `[P, N]` marks the pooled sample's tokens of each profile; resamples are drawn
    within a profile (its tokens, in order, cut into `blocks` blocks). Y = P x (1 + resamples).
    """
    rows = []
    for member_N in np.asarray(membership_PN, dtype=bool):
        rows.append(member_N.astype(np.float64))
        index = np.flatnonzero(member_N)
        weights_QN = block_bootstrap_weights(len(index), resamples, blocks, rng)
        full_QN = np.zeros((resamples, len(member_N)))
        full_QN[:, index] = weights_QN
        rows.extend(full_QN)
    return np.stack(rows)


def count_scenarios(counts_PE: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`[Y, E]` expert loads: each profile's counts, then `resamples` Poisson draws of them (per profile)."""
    rows = []
    for counts_E in np.atleast_2d(np.asarray(counts_PE, dtype=np.float64)):
        rows.append(counts_E)
        rows.extend(rng.poisson(counts_E, size=(resamples, len(counts_E))).astype(np.float64))
    return np.stack(rows)


def scenario_loads(topk_ids_Nk: np.ndarray, weights_YN: np.ndarray, num_experts: int) -> np.ndarray:
    """`[Y, E]` expert loads (weighted pairs) of token-weight scenarios."""
    one_hot_NE = np.zeros((len(topk_ids_Nk), num_experts))
    np.add.at(one_hot_NE, (np.repeat(np.arange(len(topk_ids_Nk)), topk_ids_Nk.shape[1]), topk_ids_Nk.ravel()), 1.0)
    return np.asarray(weights_YN, dtype=np.float64) @ one_hot_NE


def split_half_reliability(topk_ids_Nk: np.ndarray, num_experts: int) -> float:
    """How much of a profile's spread of expert loads persists on later tokens, in [0, 1].

    The tokens in sample order are cut into their first and second half; `r` is the Pearson
    correlation of the two halves' `[E]` expert loads, and `2 r / (1 + r)` (Spearman-Brown) the
    reliability of loads measured on the whole sample: the least-squares slope of a new sample's
    loads on these ones when the noise of the halves is independent. Time order, not random halves,
    because the tokens a placement serves come later (decode steps after the profiled ones, later
    documents): a trend inside the profile lowers the figure, as it should. 1.0 when it cannot be
    estimated (fewer than 4 tokens, or no spread in a half).
    """
    ids_Nk = np.asarray(topk_ids_Nk)
    if len(ids_Nk) < 4:
        return 1.0
    half = len(ids_Nk) // 2
    first_E, second_E = (np.bincount(part.ravel(), minlength=num_experts).astype(np.float64) for part in (ids_Nk[:half], ids_Nk[half:]))
    if first_E.std() == 0 or second_E.std() == 0:
        return 1.0
    r = max(float(np.corrcoef(first_E, second_E)[0, 1]), 0.0)
    return 2.0 * r / (1.0 + r)


def shrink_toward_mean(load_YE: np.ndarray, reliability_Y: np.ndarray) -> np.ndarray:
    """`[Y, E]` loads pulled toward each row's mean: `mean + reliability x (load - mean)` (totals kept)."""
    load_YE = np.asarray(load_YE, dtype=np.float64)
    mean_Y1 = load_YE.mean(1, keepdims=True)
    return mean_Y1 + np.asarray(reliability_Y, dtype=np.float64)[:, None] * (load_YE - mean_Y1)


__all__ = [
    "block_bootstrap_weights",
    "count_scenarios",
    "scenario_loads",
    "shrink_toward_mean",
    "split_half_reliability",
    "stated_quantile",
    "time_window_membership",
    "token_scenarios",
]
