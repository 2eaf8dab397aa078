"""`replan_replicas` (`occult replan`): only the replicas of the layers asked for change; every other field of the
placement carries over (its node layout, and slots that still hold the layers left alone)."""

from __future__ import annotations

import numpy as np

from occult_hf.placement import Placement
from occult_hf.placement.rebalance import replan_replicas
from occult_hf.placement.validation import profile_from_sample


def _profile(layers: int, seed: int):
    rng = np.random.default_rng(seed)
    samples = {layer: np.stack([rng.choice(8, size=2, replace=False) for _ in range(200)]) for layer in range(layers)}
    return profile_from_sample(samples, 8, "window")


def test_the_node_layout_carries_over():
    placement = Placement(8, 4, {0: [0, 0, 1, 1, 2, 2, 3, 3]}, replicas={0: {0: [2]}}, devices_per_node=2)
    replanned = replan_replicas(placement, _profile(1, seed=3))
    assert replanned.devices_per_node == 2  # was dropped: the re-planned file lost the cluster layout it was for


def test_layers_left_alone_keep_their_replicas_within_the_stated_slots():
    """No `slots_per_device` stated: the slots the result states hold the layer not re-planned (5 experts on device 0),
    where replanning layer 0 alone had failed on layer 1, citing slots the user never set."""
    placement = Placement(8, 4, {0: [0, 0, 1, 1, 2, 2, 3, 3], 1: [0, 0, 1, 1, 2, 2, 3, 3]}, replicas={1: {2: [0], 4: [0], 6: [0]}})
    replanned = replan_replicas(placement, _profile(2, seed=3), num_redundant=0, layers=[0])
    assert replanned.replicas == {1: {2: [0], 4: [0], 6: [0]}} and replanned.slots_per_device == 5


def test_the_replan_never_balances_its_profile_worse_than_the_deployed_copies():
    """A plan with 16 copies whose primaries crowd two devices: the greedy, one copy at a time from none, stops where
    no single copy helps (balance 1.56 on the very profile it re-planned on, against the deployed 1.05); the layer now
    keeps its deployed copies, and says so in the meta. (`occult replan` had dropped every copy of a 64-copy plan.)"""
    from occult_hf import metrics
    from occult_hf.eval.studies.placement_study import structured_topk
    from occult_hf.placement import plan_placement

    profile = profile_from_sample({0: structured_topk(800, 16, 4, 4, seed=0)}, 16, "window")
    deployed = plan_placement(profile, 4, progress=False, num_redundant_experts=16, search_rounds=2)
    replanned = replan_replicas(deployed, profile)
    assert replanned.replicas == deployed.replicas and replanned.meta["replicas_kept_in_layers"] == [0]
    unstated = Placement(16, 4, dict(deployed.layers), replicas=deployed.replicas)  # no slots_per_device stated
    assert replan_replicas(unstated, profile).meta["replicas_kept_in_layers"] == [0]  # was the slot counts
    balance = {name: metrics.evaluate_placement(profile, p)[0].balance for name, p in (("deployed", deployed), ("replanned", replanned))}
    assert balance["replanned"] <= balance["deployed"] < 1.1, balance
