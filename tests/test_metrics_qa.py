"""Metrics and `occult report` against hand counts, and their refusal of inputs that would give a wrong number.

Every figure is compared with a plain Python count over tokens (the definitions of docs/design.md §2 and the
replica rule of §6), on the shipped tiny OLMoE routing; hostile inputs must raise an error naming the problem
instead of returning NaN or a number of the wrong meaning.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

from occult_hf import metrics
from occult_hf.cli import main
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile


def _tiny_profile() -> RoutingProfile:
    path = resources.files("occult_hf") / "data" / "tiny_olmoe_routing.npz"
    with resources.as_file(path) as trace:
        return RoutingProfile.from_trace(trace)


def _hand_layer(ids_Nk: np.ndarray, homes: list[list[int]], num_devices: int, devices_per_node: int) -> dict:
    """Every per-token figure counted token by token: the replica rule, ranks `t * D // N`, rows, loads, nodes."""
    num_tokens, G = len(ids_Nk), devices_per_node
    ct, remote, nodes, flat, hier = [], [], [], [], []
    received, load = [0] * num_devices, [0] * num_devices
    for t, row in enumerate(ids_Nk.tolist()):
        visited = {homes[e][0] for e in row if len(homes[e]) == 1}
        served = [min(set(homes[e]) & visited) if set(homes[e]) & visited else homes[e][t % len(homes[e])] for e in row]
        rank, devices = t * num_devices // num_tokens, set(served)
        ct.append(len(devices))
        remote.append(len(devices - {rank}))
        nodes.append(len({d // G for d in devices}))
        flat.append(sum(d // G != rank // G for d in devices))
        hier.append(len({d // G for d in devices} - {rank // G}))
        for d in devices - {rank}:
            received[d] += 1
        for d in served:
            load[d] += 1
    return {
        "ct": np.mean(ct), "remote": np.mean(remote), "max_received": max(received),
        "balance": max(load) / np.mean(load), "ct_node": np.mean(nodes), "flat": np.mean(flat), "hier": np.mean(hier),
    }  # fmt: skip


def test_evaluate_placement_matches_hand_counts_with_replicas_and_nodes():
    profile = _tiny_profile()
    rng = np.random.default_rng(0)
    layers = {l: rng.permutation(np.arange(32) * 8 // 32).tolist() for l in profile.layers}
    replicas = {0: {3: [1, 6], 17: [2]}, 2: {0: [4, 5, 7]}}
    for layer, extra in replicas.items():
        for expert in extra:
            extra[expert] = [d for d in extra[expert] if d != layers[layer][expert]]
    placement = Placement(32, 8, layers, replicas=replicas, devices_per_node=4)
    for layer, m in metrics.evaluate_placement(profile, placement).items():
        hand = _hand_layer(profile.layer(layer).topk_sample, placement.homes(layer), 8, 4)
        got = {
            "ct": m.ct, "remote": m.remote_copies, "max_received": m.max_received_rows, "balance": m.balance,
            "ct_node": m.nodes.ct_node_mean, "flat": m.nodes.cross_rows_flat, "hier": m.nodes.cross_rows_hierarchical,
        }  # fmt: skip
        assert got == pytest.approx(hand), layer


@pytest.mark.parametrize(
    "loads", [[1.0, np.nan, 2.0], [np.inf, 1.0, 1.0], [-1.0, 3.0, 1.0], []], ids=["nan", "inf", "negative", "empty"]
)
def test_load_balance_refuses_loads_that_are_not_counts(loads):
    with pytest.raises(ValueError, match="finite, non-negative device loads"):
        metrics.load_balance(np.array(loads))


def test_load_floor_refuses_an_empty_device_instead_of_a_floor_above_every_placement():
    # capacities [0, 2, 2] of four unit experts: every placement reaches a max load of 2, the old floor said 4
    with pytest.raises(ValueError, match="integer array of positive counts"):
        metrics.load_floor(np.ones(4), np.array([0, 2, 2]))
    with pytest.raises(ValueError, match="finite, non-negative expert loads"):
        metrics.load_floor(np.array([1.0, np.nan, 1.0, 1.0]), np.array([2, 2]))


@pytest.mark.parametrize("function", [metrics.mean_ct, lambda ids, dev, d: metrics.served_ct(dev[ids], d)])
def test_mean_ct_of_no_tokens_is_an_error_not_nan(function):
    with pytest.raises(ValueError, match="at least one token"):
        function(np.zeros((0, 2), dtype=np.int64), np.array([0, 0, 1, 1]), 2)


@pytest.mark.parametrize(
    "ranks", [np.array([0, 7]), np.array([0, -1]), np.array([0]), np.array([0.5, 3.5])],
    ids=["past D", "negative", "short", "float"],
)  # fmt: skip
def test_node_traffic_checks_the_source_ranks(ranks):
    with pytest.raises(ValueError, match=r"source_rank_N must be an integer array \[N=2\] of ranks in \[0, 4\)"):
        metrics.node_traffic(np.array([[0, 2], [1, 3]]), np.arange(4), 4, 2, source_rank_N=ranks)


def test_communication_volume_refuses_float_ranks_instead_of_truncating_them():
    # rank 0.9 was read as rank 0: token 0 then counted its own device 0 as local
    with pytest.raises(ValueError, match="source_rank_N must be an integer array"):
        metrics.communication_volume(np.array([[0, 2], [1, 3]]), np.array([0, 0, 1, 1]), 2, np.array([0.9, 1.9]))


@pytest.mark.parametrize("top_k", [0, -1, 5])
def test_ct_bounds_refuses_a_top_k_no_token_can_have(top_k):
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 4\]"):
        metrics.ct_bounds(top_k, np.array([2, 2]))


def test_pairwise_cut_refuses_a_one_triangle_or_nan_coactivation():
    devices = np.array([0, 1])
    with pytest.raises(ValueError, match=r"symmetric .* C\[0, 1\] = 3 and C\[1, 0\] = 0"):
        metrics.pairwise_cut(np.array([[0, 3], [0, 0]]), devices, 2)  # was 1 (3 // 2); sum_{i<j} is 3
    with pytest.raises(ValueError, match="finite, non-negative"):
        metrics.intra_device_ratio(np.array([[0.0, np.nan], [np.nan, 0.0]]), devices, 2)


@pytest.mark.parametrize(
    "meta, named",
    [
        ({"expected_held_out": {"folds": 2}}, "expected_held_out"),
        ({"worst_profile": {"0": 3}}, "worst_profile"),
        ({"worst_profile": [1, 2]}, "worst_profile"),
    ],
)
def test_report_prints_its_table_when_a_placement_meta_is_hand_made(tmp_path, capsys, meta, named):
    profile = _tiny_profile()
    profile.save(tmp_path / "p.safetensors")
    placement = Placement.contiguous(32, 4, profile.layers)
    placement.meta = {"method": "handmade", **meta}
    placement.save(tmp_path / "place.json")
    assert main(["report", str(tmp_path / "p.safetensors"), str(tmp_path / "place.json"), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "| worst " in printed and f"handmade: meta {named!r} is not in the form the planners write" in printed
    json.loads((tmp_path / "place.json").read_text())  # the file itself is untouched and valid


def test_whole_counts_held_as_floats_are_capacities():
    """The capacity check took only integer arrays: `ct_bounds(2, [4.0, 4.0])` and `load_floor` of float counts,
    which worked before it, were refused."""
    from occult_hf.metrics import ct_bounds, load_floor

    assert ct_bounds(2, np.array([4.0, 4.0])) == (1, 2)
    assert load_floor(np.ones(8), np.array([4.0, 4.0])) == 4.0
    with pytest.raises(ValueError, match="integer array of positive counts"):
        ct_bounds(2, np.array([4.5, 3.5]))
