"""`occult` placement: the Occult paper's Algorithm 1 (arXiv 2505.13345), reproduced as a baseline.

Groups are filled one device at a time from the co-activation ("collaboration") matrix C:

1. device 0 is seeded with the most collaborating pair `argmax_{i != j} C[i, j]`;
2. every further device is seeded with the unplaced expert that collaborates least with all
   experts placed so far (`argmin_i sum_{j placed} C[i, j]`);
3. a device's group grows greedily: add the unplaced expert with the largest mean collaboration
   with the group's current members, until the group holds its capacity.

The paper uses equal groups (D divides E). For D not dividing E we keep the fill order and give
the first `E % D` devices one expert more (capacities differ by at most one). Ties go to the lower
expert id. Load is ignored, as in the paper: on skewed real routing one device can end with 2x the
mean load, which is why `refined` exists.
"""

from __future__ import annotations

import numpy as np

from .registry import NoOptions, balanced_capacities, check_layer_inputs, register_planner


@register_planner("occult", NoOptions, "the paper's Algorithm 1: greedy collaboration groups, equal sizes, no load balance")
def plan_occult_layer(
    coactivation_EE: np.ndarray,
    expert_counts_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    options: NoOptions,
) -> np.ndarray:
    """`[E]` int64 device map from Algorithm 1 on `coactivation_EE` (the counts and sample are not used)."""
    coactivation, _, _ = check_layer_inputs(coactivation_EE, expert_counts_E, topk_sample_Nk, num_devices)
    collaboration_EE = coactivation.astype(np.float64)
    num_experts = len(collaboration_EE)
    capacities_D = balanced_capacities(num_experts, num_devices)
    device_of_E = np.full(num_experts, -1, dtype=np.int64)
    for device, capacity in enumerate(capacities_D):
        placed_E = device_of_E >= 0
        if device == 0:
            pairs_EE = collaboration_EE.copy()
            np.fill_diagonal(pairs_EE, -np.inf)
            first, second = np.unravel_index(int(np.argmax(pairs_EE)), pairs_EE.shape)
            group = [int(first), int(second)][: int(capacity)]
        else:
            with_placed_E = collaboration_EE[:, placed_E].sum(axis=1)
            with_placed_E[placed_E] = np.inf
            group = [int(np.argmin(with_placed_E))]
        device_of_E[group] = device
        while len(group) < capacity:
            mean_with_group_E = collaboration_EE[:, group].mean(axis=1)
            mean_with_group_E[device_of_E >= 0] = -np.inf
            newcomer = int(np.argmax(mean_with_group_E))
            group.append(newcomer)
            device_of_E[newcomer] = device
    return device_of_E
