"""Replicas planned for the load-aware runtime rule: every device keeps room to shed load through its copies.

Under `replica_choice="load_aware"` the runtime splits each replicated expert's pairs over its homes by the
batch's own loads (`replicas.routing.load_aware_homes`), so a device's load is at least what its single-home
experts bring: no split moves those pairs. A plan made for the static rule does not bound that part.

The planner (`refined`, `replica_choice="load_aware"`) therefore holds two kinds of load rows:

* the even split of every replicated expert over its homes (one split the runtime can reach: the fluid
  min-max split is at most its max) within `max_load_ratio` x the load floor, as before;
* each device's single-home load within `(1 - shed_margin)` x the mean (`single_home_rows`): the rest of
  a device's load is copies, which the runtime can move to the expert's other homes, so a device whose
  single-home experts run hotter on new tokens (sampling noise, prefill -> decode) by up to the margin
  still reaches the mean.

A device can shed load only to the other homes of its copies' experts, and those only to theirs: the devices
fall into *linked groups* (devices joined by a replicated expert with homes on both), and a group's load can
only be moved within it. After the search, `link_groups` therefore swaps copies, cheapest in CT first and
within the load rows, until every device is in one group, so that the excess of any device can reach every
other (a group as a whole can run hot while no device in it holds much single-home load).

The rows are load rows of the search's usual form (`[Y, X]` item loads, each row with its limit), so the local
search, the repair and the co-activation objective handle them unchanged: which experts get copies and
where is still chosen jointly with co-activation (a copy on a device the token already visits cuts CT).

Shape legend (docs/conventions.md): Y load scenarios, E experts; local to this file: X items (the experts'
copies, E plus the replicas).
"""

from __future__ import annotations

import numpy as np


def single_home_rows(
    load_YX: np.ndarray, copies_X: np.ndarray, num_devices: int, shed_margin: float
) -> tuple[np.ndarray, np.ndarray]:
    """`([Y, X] loads of the single-home items, 0 for copies of replicated experts; [Y] their limits)`.

    Args:
        load_YX: `[Y, X]` float64 item loads of each scenario (a replicated expert's load split over its copies).
        copies_X: `[X]` int number of copies of each item's expert.
        num_devices: `D`.
        shed_margin: the fraction of the mean device load each device keeps free of single-home load.
    """
    single_YX = np.where(np.asarray(copies_X)[None, :] == 1, load_YX, 0.0)
    mean_Y = load_YX.sum(1) / num_devices
    limit_Y = np.where(mean_Y > 0, (1.0 - shed_margin) * mean_Y, 1.0)  # no load: any map is balanced
    return single_YX, limit_Y


def linked_groups(device_of_X: np.ndarray, group_X: np.ndarray, num_devices: int) -> np.ndarray:
    """`[D]` int64 label of each device's linked group (devices joined through the homes of one expert)."""
    label_D = np.arange(num_devices)
    for expert in np.unique(group_X):
        homes = device_of_X[group_X == expert]
        if len(homes) > 1:
            joined = np.isin(label_D, label_D[homes])
            label_D[joined] = label_D[homes].min()
    return label_D


def link_groups(search, group_X: np.ndarray, num_devices: int) -> None:
    """Apply feasible swaps (within every load row of `search`, a `refined._Search`) that each join linked
    groups, the cheapest for its objective first, until the devices form one group or no swap joins two."""
    copies_X = np.bincount(group_X)[group_X]
    while len(np.unique(labels := linked_groups(search.device_of_E, group_X, num_devices))) > 1:
        swap_XX, _ = search.feasible_steps()
        # a swap can join groups only if it moves a copy of a replicated expert to a device of another group
        device_X = search.device_of_E
        across_XX = labels[device_X][:, None] != labels[device_X][None, :]
        replicated_XX = (copies_X > 1)[:, None] | (copies_X > 1)[None, :]
        candidates = np.flatnonzero(np.isfinite(swap_XX) & across_XX & replicated_XX)
        best = None
        for pick in candidates[np.argsort(swap_XX.flat[candidates], kind="stable")]:
            first, second = divmod(int(pick), swap_XX.shape[1])
            trial_X = device_X.copy()
            trial_X[[first, second]] = device_X[[second, first]]
            if len(np.unique(linked_groups(trial_X, group_X, num_devices))) < len(np.unique(labels)):
                best = (first, second, swap_XX.flat[pick])
                break
        if best is None:
            return
        search.apply_swap(*best)


__all__ = ["link_groups", "linked_groups", "single_home_rows"]
