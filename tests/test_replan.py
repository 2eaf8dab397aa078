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
