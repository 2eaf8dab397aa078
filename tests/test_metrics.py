"""Metrics on hand-checkable cases, brute-force cross-checks, real routing and bad inputs."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from occult_hf import metrics
from occult_hf.drift import profile_drift
from occult_hf.placement import Placement, balanced_capacities
from occult_hf.profile import LayerRouting, RoutingProfile
from occult_hf.eval.studies.placement_study import profile_from_topk, structured_topk

ROUTING = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "routing"
QWEN_TRACE = ROUTING / "qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


def random_sets(num_tokens: int, num_experts: int, top_k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])


# ----- CT and its bounds -------------------------------------------------------------------------
def test_ct_hand_case():
    devices_E = np.array([0, 0, 1, 1])
    topk_Nk = np.array([[0, 1], [0, 2], [2, 3], [1, 3]])
    assert metrics.communication_cost(topk_Nk, devices_E, 2).tolist() == [1, 2, 1, 2]
    assert metrics.mean_ct(topk_Nk, devices_E, 2) == 1.5
    assert metrics.device_hits(topk_Nk, devices_E, 2).tolist() == [[2, 0], [1, 1], [0, 2], [1, 1]]


@pytest.mark.parametrize(
    "top_k, capacities, expected",
    [
        (4, [8, 8, 8, 8, 7, 7, 7, 7], (1, 4)),  # Qwen1.5 on 8 devices: 8 experts fit on one device
        (4, [2, 2, 2, 2], (2, 4)),  # paper's ceil(k*D/E) = ceil(4*4/8)
        (8, [16] * 8, (1, 8)),  # OLMoE-like
        (6, [4, 3, 3], (2, 3)),  # upper bound capped by D
        (1, [1, 1], (1, 1)),
    ],
)
def test_ct_bounds(top_k, capacities, expected):
    assert metrics.ct_bounds(top_k, np.array(capacities)) == expected


def test_ct_lies_within_bounds_and_lower_bound_is_reached():
    E, D, k = 12, 3, 4
    devices_E = np.arange(E) * D // E  # capacities 4, 4, 4
    lower, upper = metrics.ct_bounds(k, balanced_capacities(E, D))
    ct_N = metrics.communication_cost(random_sets(500, E, k, seed=0), devices_E, D)
    assert ct_N.min() >= lower and ct_N.max() <= upper
    # a token whose experts fill one device reaches the lower bound; one spread over all devices the upper
    assert metrics.communication_cost(np.array([[0, 1, 2, 3], [0, 4, 8, 9]]), devices_E, D).tolist() == [lower, upper]


# ----- remote copies -----------------------------------------------------------------------------
def test_token_ranks_are_contiguous_equal_chunks():
    assert metrics.token_ranks(6, 3).tolist() == [0, 0, 1, 1, 2, 2]
    chunk_sizes = np.bincount(metrics.token_ranks(7, 3))
    assert chunk_sizes.max() - chunk_sizes.min() <= 1 and chunk_sizes.sum() == 7


def test_remote_copies_hand_case():
    # one expert per device; tokens 0,1 on rank 0, 2,3 on rank 1, 4,5 on rank 2
    topk_Nk = np.array([[1, 2], [0, 1], [0, 2], [1, 2], [1, 2], [0, 1]])
    volume = metrics.communication_volume(topk_Nk, np.array([0, 1, 2]), 3)
    # remote copies per token: 2, 1, 2, 1, 1, 2
    assert volume.remote_copies_mean == pytest.approx(9 / 6)
    assert volume.ct_mean == 2.0
    assert volume.sent_rows_D.tolist() == [3, 3, 3]
    assert volume.received_rows_D.tolist() == [2, 4, 3]
    assert (volume.max_sent_rows, volume.max_received_rows) == (3, 4)


def test_remote_copies_match_a_python_loop():
    E, D, k = 10, 4, 3
    topk_Nk = random_sets(101, E, k, seed=3)
    devices_E = np.random.default_rng(4).integers(D, size=E)
    source_N = np.random.default_rng(5).integers(D, size=101)
    sent, received = np.zeros(D, int), np.zeros(D, int)
    for row, source in zip(topk_Nk, source_N):
        for device in set(devices_E[row].tolist()) - {source}:
            sent[source] += 1
            received[device] += 1
    volume = metrics.communication_volume(topk_Nk, devices_E, D, source_rank_N=source_N)
    assert volume.sent_rows_D.tolist() == sent.tolist() and volume.received_rows_D.tolist() == received.tolist()
    assert volume.remote_copies_mean == pytest.approx(sent.sum() / 101)


# ----- load --------------------------------------------------------------------------------------
def test_device_load_and_balance_hand_case():
    load_E = np.array([10, 0, 5, 5])
    load_D = metrics.device_load(load_E, np.array([0, 0, 1, 1]), 2)
    assert load_D.tolist() == [10.0, 10.0] and metrics.load_balance(load_D) == 1.0
    load_D = metrics.device_load(load_E, np.array([0, 1, 0, 1]), 2)
    assert load_D.tolist() == [15.0, 5.0] and metrics.load_balance(load_D) == 1.5
    assert metrics.expert_load(np.array([[0, 2], [0, 3]]), 4).tolist() == [2, 0, 1, 1]


def test_load_floor_with_a_giant_expert_is_tight():
    load_E = np.array([100, 1, 1, 1, 1, 1, 1, 1])  # one expert carries most of the load
    capacities_D = balanced_capacities(8, 4)
    floor = metrics.load_floor(load_E, capacities_D)
    assert floor == 101.0  # the giant expert plus the lightest companion; the mean is 26.75
    assert metrics.load_balance(metrics.device_load(load_E, np.array([0, 0, 1, 1, 2, 2, 3, 3]), 4)) == pytest.approx(
        floor / 26.75
    )


def test_load_floor_with_uneven_capacities():
    """Ten equal experts on 3 devices: one device must hold 4 of them, 4/3.33 of the mean."""
    load_E = np.full(10, 30.0)
    assert metrics.load_floor(load_E, balanced_capacities(10, 3)) == 120.0


@pytest.mark.parametrize("num_experts, seed", [(6, 0), (6, 1), (6, 2), (7, 3), (7, 4)])
def test_load_floor_bounds_every_placement(num_experts, seed):
    """Brute force over every capacity-respecting placement on 3 devices (seed 2: a giant expert)."""
    rng = np.random.default_rng(seed)
    load_E = rng.integers(0, 50, size=num_experts) * (rng.random(num_experts) < 0.8)
    load_E[0] += 500 * (seed == 2)
    capacities = sorted(balanced_capacities(num_experts, 3).tolist())
    best = min(
        metrics.device_load(load_E, np.array(devices), 3).max()
        for devices in itertools.product(range(3), repeat=num_experts)
        if sorted(np.bincount(devices, minlength=3).tolist()) == capacities
    )
    assert metrics.load_floor(load_E, balanced_capacities(num_experts, 3)) <= best + 1e-9


# ----- co-activation metrics ---------------------------------------------------------------------
def test_pairwise_cut_and_intra_ratio_hand_case():
    coactivation = np.zeros((4, 4), dtype=np.int64)
    for (i, j), count in {(0, 1): 5, (0, 2): 2, (1, 3): 1, (2, 3): 4}.items():
        coactivation[i, j] = coactivation[j, i] = count
    devices_E = np.array([0, 0, 1, 1])
    assert metrics.pairwise_cut(coactivation, devices_E, 2) == 3
    assert metrics.intra_device_ratio(coactivation, devices_E, 2) == pytest.approx(9 / 12)


def test_pairwise_cut_counts_split_pairs_of_tokens():
    """cut = sum over tokens of (k^2 - sum_d n_d^2) / 2, with n_d the token's experts on device d."""
    E, D, k = 12, 3, 4
    topk_Nk = random_sets(300, E, k, seed=7)
    routing = profile_from_topk({0: topk_Nk}, E, "test").layer(0)
    devices_E = np.random.default_rng(8).integers(D, size=E)
    hits_ND = metrics.device_hits(topk_Nk, devices_E, D)
    expected = int(((k * k - (hits_ND**2).sum(axis=1)) // 2).sum())
    assert metrics.pairwise_cut(routing.coactivation, devices_E, D) == expected


# ----- drift -------------------------------------------------------------------------------------
def test_coactivation_spearman():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 100, size=(8, 8))
    a = a + a.T
    assert metrics.coactivation_spearman(a, a) == pytest.approx(1.0)
    assert metrics.coactivation_spearman(a, 1000 - a) == pytest.approx(-1.0)
    b = a + rng.integers(0, 60, size=(8, 8))
    stats = pytest.importorskip("scipy.stats")
    upper = np.triu_indices(8, k=1)
    assert metrics.coactivation_spearman(a, b) == pytest.approx(stats.spearmanr(a[upper], b[upper]).statistic)


def test_profile_drift_same_and_shifted_routing():
    E, k, D = 16, 4, 4
    first = profile_from_topk({0: structured_topk(1500, E, k, D, seed=1)}, E, "a")
    shifted = profile_from_topk({0: structured_topk(1500, E, k, D, seed=2)}, E, "b")  # other hidden groups
    same = profile_drift(first, first, D, search_rounds=2)[0]
    assert same.spearman == pytest.approx(1.0) and same.transferred == same.native and same.cost_name == "ct"
    drift = profile_drift(first, shifted, D, search_rounds=2)[0]
    assert drift.spearman < 0.5
    assert drift.native < drift.transferred  # the placement planned on other routing pays for it


def test_profile_drift_refuses_profiles_of_another_top_k_or_model():
    """Only the expert count was compared: a top-2 profile against a top-4 one (another model) gave a Spearman and costs
    as if one model's routing had drifted."""
    import dataclasses

    E, D = 16, 4
    top4 = profile_from_topk({0: structured_topk(300, E, 4, D, seed=1)}, E, "a")
    top2 = profile_from_topk({0: structured_topk(300, E, 2, D, seed=1)}, E, "b")
    with pytest.raises(ValueError, match="profiles differ in top_k: 4 vs 2: drift compares one model's routing"):
        profile_drift(top4, top2, D, search_rounds=2)
    olmoe, qwen = (dataclasses.replace(top4, model_type=name) for name in ("olmoe", "qwen3_moe"))
    with pytest.raises(ValueError, match="profiles differ in model_type: 'olmoe' vs 'qwen3_moe'"):
        profile_drift(olmoe, qwen, D, search_rounds=2)


# ----- evaluation of a placement -----------------------------------------------------------------
def test_evaluate_placement_at_e128_48_layers_is_consistent():
    E, k, D = 128, 8, 8
    profile = profile_from_topk({l: random_sets(64, E, k, seed=l) for l in range(48)}, E, "random")
    placement = Placement.contiguous(E, D, range(48))
    per_layer = metrics.evaluate_placement(profile, placement)
    assert sorted(per_layer) == list(range(48))
    for m in per_layer.values():
        assert m.ct_lower <= m.ct <= m.ct_upper == 8
        assert m.load_D.sum() == 64 * k and m.balance >= m.balance_floor - 1e-12
    summary = metrics.summarize(per_layer)
    assert summary["ct"] == pytest.approx(np.mean([m.ct for m in per_layer.values()]))


def test_evaluate_layer_without_sample_reports_cut_only():
    coactivation = np.array([[0, 3], [3, 0]])
    routing = LayerRouting(coactivation=coactivation, expert_counts=np.array([3, 3]), token_count=3)
    m = metrics.evaluate_layer(routing, np.array([0, 1]), 2, top_k=2)
    assert m.ct is None and m.remote_copies is None and m.max_received_rows is None
    assert m.cut_per_token == 1.0 and m.intra_device_ratio == 0.0 and m.balance == 1.0


@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason=f"real routing data not found at {QWEN_TRACE}")
def test_real_qwen_trace_metrics_are_consistent():
    profile = RoutingProfile.from_trace(QWEN_TRACE)
    routing = profile.layer(0)
    assert routing.topk_sample.shape == (4384, 4)
    placement = Placement.contiguous(60, 8, [0])
    m = metrics.evaluate_placement(profile, placement)[0]
    volume = metrics.communication_volume(routing.topk_sample, np.array(placement.device_of(0)), 8)
    assert m.ct_lower == 1 and m.ct_upper == 4 and 1 <= m.ct <= 4
    assert volume.received_rows_D.sum() == volume.sent_rows_D.sum() == round(m.remote_copies * 4384)
    assert m.remote_copies < m.ct  # tokens whose own rank holds one of their experts save a copy
    assert m.load_D.sum() == 4384 * 4


# ----- bad inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "topk, match",
    [
        (np.array([[0, 4]]), r"\[0, num_experts=4\)"),
        (np.array([[-1, 2]]), r"\[0, num_experts=4\)"),
        (np.array([[1, 1]]), "repeats an expert"),
        (np.array([0, 1]), r"integer array \[N, k\]"),
        (np.array([[0.0, 1.0]]), r"integer array \[N, k\]"),
        (np.zeros((1, 5), dtype=int), "k=5 experts per token but num_experts=4"),
    ],
)
def test_bad_topk_ids(topk, match):
    with pytest.raises(ValueError, match=match):
        metrics.communication_cost(topk, np.array([0, 0, 1, 1]), 2)


@pytest.mark.parametrize(
    "devices, match",
    [(np.array([0, 0, 1]), r"\[E=4\]"), (np.array([0, 0, 1, 2]), r"\[0, num_devices=2\)"), (np.array([0, 0, 1, -1]), "device ids")],
)
def test_bad_device_map(devices, match):
    with pytest.raises(ValueError, match=match):
        metrics.check_device_map(devices, 4, 2)


def test_bad_shapes_and_values():
    with pytest.raises(ValueError, match=r"shape \[E, E\] = \[3, 3\]"):
        metrics.pairwise_cut(np.zeros((2, 2)), np.array([0, 1, 1]), 2)
    with pytest.raises(ValueError, match="positive counts"):
        metrics.ct_bounds(2, np.array([2, 0]))
    with pytest.raises(ValueError, match="capacities sum to 3 but there are 4 experts"):
        metrics.load_floor(np.ones(4), np.array([2, 1]))
    with pytest.raises(ValueError, match="both be"):
        metrics.coactivation_spearman(np.zeros((3, 3)), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="source_rank_N"):
        metrics.communication_volume(np.array([[0, 1]]), np.array([0, 1]), 2, source_rank_N=np.array([2]))
