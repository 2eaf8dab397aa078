"""The refined planner leaves every device with a primary home when it replicates experts.

The runtime routes by an expert's homes, but some code reads the primary map alone: `OccultCallback`'s drift
check builds a `Placement` of the layouts' primary devices, which `Placement` refuses when a device holds none
(the lowest home as primary gave this plan primaries `[8, 8, 0, 0]`).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from occult_hf.eval.studies.placement_study import structured_topk
from occult_hf.metrics import evaluate_placement
from occult_hf.placement import Placement, plan_placement
from occult_hf.placement.validation import profile_from_sample

NUM_EXPERTS, NUM_DEVICES = 16, 4


@pytest.fixture(scope="module")
def planned():
    profile = profile_from_sample({0: structured_topk(800, NUM_EXPERTS, 4, NUM_DEVICES, seed=0)}, NUM_EXPERTS, "structured")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        placement = plan_placement(profile, NUM_DEVICES, progress=False, num_redundant_experts=16, search_rounds=2)
    return profile, placement


def test_every_device_holds_a_primary(planned):
    _, placement = planned
    assert placement.replicas.get(0), "the plan should replicate experts"
    assert np.bincount(placement.device_of(0), minlength=NUM_DEVICES).min() >= 1


def test_the_primary_map_alone_is_a_placement_the_metrics_evaluate(planned):
    """What the drift check does with the primaries of a replicated model."""
    profile, placement = planned
    primaries = Placement(NUM_EXPERTS, NUM_DEVICES, {0: placement.device_of(0)})
    assert evaluate_placement(profile, primaries)[0].ct > 0
