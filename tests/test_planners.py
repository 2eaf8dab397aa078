"""Placement planners: registry, constraints (every expert once, capacities, balance), determinism,
Algorithm 1 by hand, incremental deltas against recomputation, quality on structured routing,
real routing, bad inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from occult_hf import metrics
from occult_hf.placement import (
    Placement,
    RefinedOptions,
    available_planners,
    balanced_capacities,
    get_planner,
    plan_placement,
    refine_layer,
    register_planner,
)
from occult_hf.placement.objectives import PairwiseCut, SampleCT
from occult_hf.profile import LayerRouting, RoutingProfile
from occult_hf.eval.studies.placement_study import profile_from_topk, qwen_halves, structured_topk

ROUTING = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "routing"
OLMOE_PAIRS = ROUTING / "olmoe1b7b0125__runB_2025-03-07__wikitext2_8192tok_coact.npz"
QWEN_TRACE = ROUTING / "qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
METHODS = ("contiguous", "occult", "refined")
FAST = {"search_rounds": 4}  # keeps the refined cases quick; quality is checked with the defaults below


def layer_inputs(num_experts: int, top_k: int, num_groups: int, num_tokens: int = 600, seed: int = 0, popularity=None):
    routing = profile_from_topk(
        {0: structured_topk(num_tokens, num_experts, top_k, num_groups, popularity, seed=seed)}, num_experts, "test"
    ).layer(0)
    return routing.coactivation, routing.expert_counts, routing.topk_sample


def plan(method: str, coactivation, counts, sample, num_devices: int, **options) -> np.ndarray:
    spec = get_planner(method)
    options = {**FAST, **options} if method == "refined" else options
    result = spec.plan_layer(coactivation, counts, sample, num_devices, spec.make_options(**options))
    return np.asarray(getattr(result, "device_of_E", result))


# ----- registry ----------------------------------------------------------------------------------
def test_registry_names_and_errors():
    assert set(METHODS) <= set(available_planners())
    with pytest.raises(ValueError, match=r"the placement method must be one of \['contiguous', 'occult', 'refined'.*\], got 'greedy'"):
        get_planner("greedy")
    with pytest.raises(ValueError, match="already registered"):
        register_planner("occult")
    with pytest.raises(ValueError, match="lowercase"):
        register_planner("Refined2")
    with pytest.raises(ValueError, match=r"'occult' has no option\(s\) \['seed'\]; its options are none"):
        get_planner("occult").make_options(seed=1)
    with pytest.raises(ValueError, match=r"no option\(s\) \['zzz'\]; its options are \['max_load_ratio'"):
        get_planner("refined").make_options(zzz=3)
    with pytest.raises(ValueError, match=r"no option\(s\) \['max_load_ration'\] \(did you mean 'max_load_ratio'\?\)"):
        get_planner("refined").make_options(max_load_ration=1.05)


# ----- constraints -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "num_experts, num_devices, top_k",
    [
        (60, 8, 4),  # Qwen1.5-MoE: D does not divide E, capacities 8 and 7
        (64, 8, 8),
        (10, 3, 2),  # capacities 4, 3, 3
        (8, 8, 2),  # one expert per device
        (5, 1, 2),  # one device
    ],
)
def test_every_expert_placed_once_with_balanced_capacities(method, num_experts, num_devices, top_k):
    coactivation, counts, sample = layer_inputs(num_experts, top_k, max(num_devices, 2))
    devices_E = plan(method, coactivation, counts, sample, num_devices)
    assert devices_E.shape == (num_experts,) and devices_E.dtype == np.int64
    assert devices_E.min() >= 0 and devices_E.max() < num_devices
    capacities = np.bincount(devices_E, minlength=num_devices)
    assert sorted(capacities.tolist()) == sorted(balanced_capacities(num_experts, num_devices).tolist())
    Placement(num_experts, num_devices, {0: devices_E.tolist()})  # the shared validation accepts it


def test_balanced_capacities_for_qwen():
    assert balanced_capacities(60, 8).tolist() == [8, 8, 8, 8, 7, 7, 7, 7]


@pytest.mark.parametrize("ratio", [1.02, 1.10, 1.30])
@pytest.mark.parametrize("objective", ["ct", "cut"])
def test_refined_respects_the_load_limit_on_skewed_loads(ratio, objective):
    popularity = np.random.default_rng(1).pareto(1.5, size=32) + 0.05  # heavy-tailed expert loads
    coactivation, counts, sample = layer_inputs(32, 4, 4, num_tokens=1500, popularity=popularity)
    result = refine_layer(coactivation, counts, sample, 8, RefinedOptions(max_load_ratio=ratio, objective=objective, **FAST))
    load_D = metrics.device_load(counts, result.device_of_E, 8)
    floor = metrics.load_floor(counts, balanced_capacities(32, 8))
    assert result.limit_reached
    assert load_D.max() <= ratio * floor + 1e-9
    assert result.load_limit == pytest.approx(ratio * floor)


def test_refined_balance_is_relative_to_the_floor_with_a_giant_expert():
    counts = np.array([900] + [10] * 15, dtype=np.int64)  # expert 0 alone is 3.6x a device's mean load
    coactivation, _, _ = layer_inputs(16, 2, 4)
    result = refine_layer(coactivation, counts, None, 4, RefinedOptions(**FAST))
    mean = counts.sum() / 4
    floor = metrics.load_floor(counts, balanced_capacities(16, 4))
    assert floor == 930 and result.balance_bound == pytest.approx(930 / mean) and result.balance_bound_loose
    assert metrics.device_load(counts, result.device_of_E, 4).max() <= 1.10 * floor


def test_refined_warns_and_keeps_the_reached_load_when_the_limit_cannot_be_met():
    # mean 10 and floor 10, but with capacities 3 and 2 the best split is {6, 1, 1} / {6, 6}: 12
    counts = np.array([6, 6, 6, 1, 1], dtype=np.int64)
    coactivation = np.zeros((5, 5), dtype=np.int64)
    with pytest.warns(UserWarning, match="could not bring every device under max_load_ratio=1.0"):
        result = refine_layer(coactivation, counts, None, 2, RefinedOptions(max_load_ratio=1.0, **FAST))
    assert not result.limit_reached
    assert metrics.device_load(counts, result.device_of_E, 2).max() == 12 == pytest.approx(result.load_limit)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_for_a_seed(method):
    coactivation, counts, sample = layer_inputs(60, 4, 8, seed=3)
    first = plan(method, coactivation, counts, sample, 8)
    assert np.array_equal(first, plan(method, coactivation, counts, sample, 8))
    if method == "refined":
        assert np.array_equal(plan(method, coactivation, counts, sample, 8, seed=5), plan(method, coactivation, counts, sample, 8, seed=5))


# ----- Algorithm 1 by hand -----------------------------------------------------------------------
def test_occult_follows_algorithm_1():
    """E=6, D=3. Pair (2, 4) collaborates most -> device 0 = {2, 4}. Expert 5 collaborates least with
    {2, 4} -> seeds device 1, which grows by the best mean collaboration with {5}: expert 0. Device 2
    takes the rest."""
    c = np.zeros((6, 6), dtype=np.int64)
    for (i, j), count in {(2, 4): 9, (0, 5): 4, (1, 2): 3, (0, 4): 2, (1, 3): 5, (3, 4): 1}.items():
        c[i, j] = c[j, i] = count
    devices_E = plan("occult", c, np.ones(6), None, 3)
    assert devices_E.tolist() == [1, 2, 0, 2, 0, 1]


def test_occult_grows_by_mean_collaboration_and_uneven_groups_come_first():
    """E=7, D=3: capacities 3, 2, 2 in fill order."""
    c = np.zeros((7, 7), dtype=np.int64)
    for (i, j), count in {(0, 1): 10, (1, 6): 6, (0, 6): 1, (0, 3): 5, (2, 5): 3, (4, 5): 2}.items():
        c[i, j] = c[j, i] = count
    devices_E = plan("occult", c, np.ones(7), None, 3)
    # device 0: pair (0, 1), then mean with {0, 1}: expert 6 (3.5) beats expert 3 (2.5)
    assert np.flatnonzero(devices_E == 0).tolist() == [0, 1, 6]
    assert np.bincount(devices_E).tolist() == [3, 2, 2]


# ----- incremental deltas ------------------------------------------------------------------------
@pytest.mark.parametrize("objective_name", ["ct", "cut"])
def test_incremental_deltas_match_recomputation(objective_name):
    rng = np.random.default_rng(0)
    E, D, k = 20, 6, 4
    coactivation, _, sample = layer_inputs(E, k, 5, num_tokens=300, seed=1)
    devices = np.arange(E) % D
    objective = SampleCT(sample, devices, D) if objective_name == "ct" else PairwiseCut(coactivation, devices, D)

    def true_cost(devices_E):
        if objective_name == "ct":
            return metrics.communication_cost(sample, devices_E, D).sum()
        return metrics.pairwise_cut(coactivation, devices_E, D)

    for _ in range(120):
        move_ED, correction_EE = objective.move_delta_ED(), objective.swap_correction_EE()
        e, f = (int(x) for x in rng.integers(E, size=2))
        after = devices.copy()
        if devices[e] == devices[f]:
            target = int((devices[e] + 1 + rng.integers(D - 1)) % D)
            after[e] = target
            delta = move_ED[e, target]
            objective.apply_move(e, target, delta)
        else:
            after[e], after[f] = devices[f], devices[e]
            delta = move_ED[e, devices[f]] + move_ED[f, devices[e]] + correction_EE[e, f]
            objective.apply_swap(e, f, delta)
        assert true_cost(after) - true_cost(devices) == delta
        devices = after
        assert objective.cost == true_cost(devices)
    fresh = SampleCT(sample, devices, D) if objective_name == "ct" else PairwiseCut(coactivation, devices, D)
    assert np.array_equal(objective.move_delta_ED(), fresh.move_delta_ED())
    assert np.array_equal(objective.swap_correction_EE(), fresh.swap_correction_EE())


# ----- quality on structured routing -------------------------------------------------------------
@pytest.mark.parametrize("num_experts, num_devices, top_k", [(32, 4, 4), (60, 8, 4)])
def test_refined_beats_occult_and_contiguous_on_structured_routing(num_experts, num_devices, top_k):
    coactivation, counts, sample = layer_inputs(num_experts, top_k, num_devices, num_tokens=2000, seed=11)
    ct = {
        method: metrics.mean_ct(sample, plan(method, coactivation, counts, sample, num_devices, **({"search_rounds": 10} if method == "refined" else {})), num_devices)
        for method in METHODS
    }
    assert ct["refined"] <= ct["occult"] and ct["refined"] < ct["contiguous"]


def test_refined_cut_objective_beats_occult_without_a_sample():
    coactivation, counts, _ = layer_inputs(32, 4, 4, num_tokens=2000, seed=12)
    cut = {m: metrics.pairwise_cut(coactivation, plan(m, coactivation, counts, None, 4), 4) for m in METHODS}
    assert cut["refined"] <= cut["occult"] < cut["contiguous"]


# ----- over a profile ----------------------------------------------------------------------------
def test_plan_placement_over_a_profile(tmp_path):
    profile = profile_from_topk({3: structured_topk(400, 16, 2, 4, seed=1), 7: structured_topk(400, 16, 2, 4, seed=2)}, 16, "two layers")
    placement = plan_placement(profile, 4, progress=False, **FAST)
    assert sorted(placement.layers) == [3, 7] and placement.meta["method"] == "refined"
    assert placement.meta["options"]["search_rounds"] == 4
    score = placement.meta["profile_metrics"]["3"]
    routing = profile.layer(3)
    assert score["ct"] == pytest.approx(metrics.mean_ct(routing.topk_sample, np.array(placement.device_of(3)), 4), abs=1e-4)
    assert score["slowest_device_load"] == metrics.device_load(
        metrics.expert_load(routing.topk_sample, 16), np.array(placement.device_of(3)), 4
    ).max()
    placement.save(tmp_path)
    assert Placement.load(tmp_path).layers == placement.layers
    only = plan_placement(profile, 4, "occult", layers=[7], progress=False)
    assert list(only.layers) == [7]
    with pytest.raises(ValueError, match=r"plan_placement layers=\[\] selects no layer"):
        plan_placement(profile, 4, layers=[], progress=False)  # was a placement of no layer, which save then refused


# ----- real routing ------------------------------------------------------------------------------
@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason=f"real routing data not found at {QWEN_TRACE}")
def test_real_qwen_refined_beats_occult_on_held_out_tokens():
    plan_half, held_out = qwen_halves(ROUTING)
    for num_devices in (4, 8):
        ct = {}
        for method in ("occult", "refined"):
            placement = plan_placement(plan_half, num_devices, method, progress=False)
            ct[method] = metrics.evaluate_placement(held_out, placement)[0].ct
            if method == "refined":
                balance = metrics.evaluate_placement(plan_half, placement)[0].balance
                assert balance <= 1.10 + 1e-9
        assert ct["refined"] < ct["occult"], (num_devices, ct)


@pytest.mark.skipif(not OLMOE_PAIRS.is_file(), reason=f"real routing data not found at {OLMOE_PAIRS}")
def test_real_olmoe_pair_counts_refined_cuts_and_balances():
    profile = RoutingProfile.from_trace(OLMOE_PAIRS)
    subset = RoutingProfile(64, 8, {l: profile.layer(l) for l in (0, 6)})  # layer 6 has the heaviest expert
    placements = {m: plan_placement(subset, 8, m, progress=False) for m in METHODS}
    per_method = {m: metrics.evaluate_placement(subset, p) for m, p in placements.items()}
    for layer in (0, 6):
        refined, contiguous = per_method["refined"][layer], per_method["contiguous"][layer]
        assert refined.balance <= 1.10 + 1e-9
        assert refined.cut_per_token < contiguous.cut_per_token


# ----- bad inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_bad_inputs(method):
    coactivation, counts, sample = layer_inputs(8, 2, 2)
    spec = get_planner(method)
    options = spec.make_options()
    with pytest.raises(ValueError, match=r"num_devices \(9\) exceeds num_experts \(8\): some device would hold no primary expert \(every device needs one; replicas, which could fill the others, do not count\)"):
        spec.plan_layer(coactivation, counts, sample, 9, options)
    with pytest.raises(ValueError, match="num_devices must be a positive integer, got 0"):
        spec.plan_layer(coactivation, counts, sample, 0, options)
    bad_sample = sample.copy()
    bad_sample[0, 0] = 8
    with pytest.raises(ValueError, match=r"topk_sample holds expert ids in \[\d+, 8\]; they must lie in \[0, num_experts=8\)"):
        spec.plan_layer(coactivation, counts, bad_sample, 2, options)
    with pytest.raises(ValueError, match=r"coactivation must have shape \[E, E\] = \[8, 8\], got \[7, 7\]"):
        spec.plan_layer(coactivation[:7, :7], counts, sample, 2, options)
    with pytest.raises(ValueError, match=r"expert_counts must be a non-empty \[E\] array"):
        spec.plan_layer(coactivation, counts[None, :], sample, 2, options)
    asymmetric = coactivation.copy()
    asymmetric[0, 1] += 1
    with pytest.raises(ValueError, match="symmetric"):
        spec.plan_layer(asymmetric, counts, sample, 2, options)


def test_bad_refined_options_and_profile_calls():
    with pytest.raises(ValueError, match="max_load_ratio must be a number >= 1.0 or 'auto', got 0.9"):
        RefinedOptions(max_load_ratio=0.9)
    with pytest.raises(ValueError, match=r"objective must be one of \('auto', 'ct', 'cut', 'slowest'\), got 'exact'"):
        RefinedOptions(objective="exact")
    with pytest.raises(ValueError, match="search_rounds must be an integer >= 0, got -1"):
        RefinedOptions(search_rounds=-1)
    coactivation, counts, _ = layer_inputs(8, 2, 2)
    with pytest.raises(ValueError, match="objective='ct' needs a profile layer with a top-k sample"):
        refine_layer(coactivation, counts, None, 2, RefinedOptions(objective="ct"))
    profile = RoutingProfile(8, 2, {0: LayerRouting(coactivation, counts, int(counts.sum()) // 2)})
    with pytest.raises(ValueError, match=r"num_devices \(16\) exceeds num_experts \(8\)"):
        plan_placement(profile, 16, progress=False)
    with pytest.raises(ValueError, match=r"the placement method must be one of \[.*\], got 'random'"):
        plan_placement(profile, 2, "random", progress=False)
    with pytest.raises(KeyError, match="no layer 5"):
        plan_placement(profile, 2, layers=[5], progress=False)
