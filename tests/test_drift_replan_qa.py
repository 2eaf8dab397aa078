"""Drift and replica re-planning checked against first principles: CT and device loads counted token by token under
the static replica rule (pairs go to a home the token visits anyway, else to `homes[token % homes]`), and hostile
inputs (an empty window, NaN counts, unstated slots) refused or handled as the docstrings say."""

from __future__ import annotations

import numpy as np
import pytest

from occult_hf.drift import profile_drift
from occult_hf.placement import Placement, plan_placement
from occult_hf.placement.rebalance import replan_replicas
from occult_hf.placement.validation import profile_from_sample
from occult_hf.profile import RoutingProfile
from occult_hf.profile.stats import LayerRouting


def _served(topk_Nk, primary_E, replicas):
    """`[N, k]` serving device of each pair, the replica rule written out token by token."""
    homes = [sorted([int(d), *replicas.get(e, [])]) for e, d in enumerate(primary_E)]
    served = []
    for token, experts in enumerate(topk_Nk):
        visited = {homes[e][0] for e in experts if len(homes[e]) == 1}
        served.append([next((d for d in homes[e] if d in visited), homes[e][token % len(homes[e])]) for e in experts])
    return served


def _ct(topk_Nk, primary_E, replicas) -> float:
    return float(np.mean([len(set(row)) for row in _served(topk_Nk, primary_E, replicas)]))


def _loads(topk_Nk, primary_E, replicas, num_devices) -> np.ndarray:
    return np.bincount(np.ravel(_served(topk_Nk, primary_E, replicas)), minlength=num_devices)


def _window(seed: int, num_experts: int = 16, tokens: int = 600):
    from occult_hf.eval.studies.placement_study import structured_topk

    sample = structured_topk(tokens, num_experts, 4, 4, seed=seed)
    return profile_from_sample({0: sample}, num_experts, f"window {seed}")


def test_drift_measures_the_planned_replicas_on_the_new_routing():
    """With `num_redundant_experts` the planned placements carry copies; drift measured their primary maps alone (CT
    2.57 where the placement with its copies reaches 2.17 on the same tokens)."""
    old, new = _window(0), _window(1)
    options = dict(search_rounds=2, num_redundant_experts=8)
    drift = profile_drift(old, new, 4, **options)[0]
    sample = new.layer(0).topk_sample
    for name, planned_on in (("transferred", old), ("native", new)):
        placement = plan_placement(planned_on, 4, progress=False, **options)
        assert placement.replicas.get(0), "the plan should carry copies for this test to mean anything"
        assert getattr(drift, name) == pytest.approx(_ct(sample, placement.device_of(0), placement.replicas[0]))


def test_drift_refuses_a_window_without_tokens():
    empty = profile_from_sample({0: np.zeros((0, 4), dtype=np.int64)}, 16, "empty window")
    for a, b in ((_window(0), empty), (empty, _window(0))):
        with pytest.raises(ValueError, match="no tokens"):
            profile_drift(a, b, 4, search_rounds=1)


def test_replan_refuses_a_window_without_tokens():
    """It kept the deployed copies, 'the best choice', on no routing at all."""
    placement = Placement(16, 4, {0: list(np.arange(16) * 4 // 16)}, replicas={0: {0: [1]}})
    empty = profile_from_sample({0: np.zeros((0, 4), dtype=np.int64)}, 16, "empty window")
    with pytest.raises(ValueError, match="layer 0 .*no tokens"):
        replan_replicas(placement, empty)


@pytest.mark.parametrize("replica_choice", ["static", "load_aware"])
@pytest.mark.parametrize("bad", [np.nan, -5.0])
def test_replan_refuses_expert_counts_that_are_not_counts(bad, replica_choice):
    """A counts-only window with a NaN or negative count was planned on silently (copies of expert 0, or none)."""
    counts = np.array([bad, 3, 3, 3, 3, 3, 3, 3], dtype=np.float64)
    window = RoutingProfile(8, 2, {0: LayerRouting(np.zeros((8, 8), dtype=np.int64), counts, 12)})
    with pytest.raises(ValueError, match="layer 0 .*finite, non-negative"):
        placement = Placement(8, 4, {0: [0, 0, 1, 1, 2, 2, 3, 3]})
        replan_replicas(placement, window, num_redundant=2, replica_choice=replica_choice)


def test_replan_of_uneven_primaries_without_stated_slots():
    """Three primaries on device 0 and no `slots_per_device`: the re-plan refused, citing `slots_per_device=2`, a
    setting the placement never stated (it guessed ceil(E / D) slots for a placement that uses three)."""
    rng = np.random.default_rng(0)
    window = profile_from_sample({0: np.stack([rng.choice(8, size=2, replace=False) for _ in range(100)])}, 8, "w")
    placement = Placement(8, 4, {0: [0, 0, 0, 1, 1, 2, 3, 3]})
    replanned = replan_replicas(placement, window)
    assert replanned.layers == placement.layers and replanned.replicas == {}


def test_replan_takes_a_numpy_integer_budget():
    """`num_redundant=np.int64(2)` (a count read from an array) was refused as 'must be an integer >= 0, got 2'."""
    window = profile_from_sample({0: np.array([[0, 1], [0, 2], [0, 3], [4, 5]] * 10)}, 8, "w")
    placement = Placement(8, 4, {0: [0, 0, 1, 1, 2, 2, 3, 3]})
    expected = replan_replicas(placement, window, num_redundant=2)
    assert expected.replicas and replan_replicas(placement, window, num_redundant=np.int64(2)) == expected


def test_replan_without_stated_slots_is_never_worse_than_the_deployed_copies():
    """No `slots_per_device` stated and the deployed copies of the two hot experts both on device 1, which then holds
    4 experts, one past `ceil((E + R) / D) = 3`: the re-plan dropped them for one copy (device 1 full at 3), balancing
    the very window it planned on worse (loads 75/25 against the deployed 50/50), though the deployment shows that
    device 1 holds 4 experts."""
    sample = np.array([[0], [0], [1], [1]] * 25)
    window = profile_from_sample({0: sample}, 4, "w")
    placement = Placement(4, 2, {0: [0, 0, 1, 1]}, replicas={0: {0: [1], 1: [1]}})
    assert _loads(sample, [0, 0, 1, 1], placement.replicas[0], 2).tolist() == [50, 50]
    replanned = replan_replicas(placement, window)
    assert _loads(sample, [0, 0, 1, 1], replanned.replicas.get(0, {}), 2).max() <= 50, replanned.replicas
    assert replanned.slots_per_device == 4


def test_replan_drops_the_scores_of_the_copies_it_replaced():
    """The re-planned file kept the deployed plan's `expected_held_out` (and `profile_metrics`), so `occult report`
    printed the replaced copies' promised balance beside the new placement."""
    from occult_hf.report import evaluate_placements, format_promises

    old, new = _window(0), _window(1)
    deployed = plan_placement(old, 4, progress=False, num_redundant_experts=4, search_rounds=1, cross_validate=2)
    replanned = replan_replicas(deployed, new, num_redundant=4)
    assert replanned.replicas != deployed.replicas
    assert not {"profile_metrics", "expected_held_out"} & set(replanned.meta)
    assert "expected held-out" not in format_promises(evaluate_placements(new, {"replanned": replanned}))
    unchanged = replan_replicas(deployed, old, num_redundant=0, layers=[])
    assert unchanged.meta["expected_held_out"] == deployed.meta["expected_held_out"]
