"""Past one node, in the planner and the metrics (issue 35): the placement file's node layout, CT_node and the
rows crossing nodes, the node-aware objective's incremental deltas, and node-aware `refined` against flat
`refined` and contiguous, held out.

- `Placement.devices_per_node`: written and read back, strict (an integer dividing D; errors name the file).
- `metrics.node_traffic`: CT_node and the rows crossing nodes (flat: one per (token, device) on another node;
  hierarchical: one per (token, node) other than the token's own) against a literal loop over tokens.
- `objectives.NodesFirst`: move and swap deltas equal the recomputed lexicographic cost, on samples and on
  pair counts.
- `plan_placement(devices_per_node=G)`: a lower CT_node than flat `refined` and contiguous held out (synthetic
  routing here; the real Qwen1.5 trace where `../shared` holds it), within the load limit, with replicas too;
  one node (G = D) is the flat plan itself.
- `occult place --devices-per-node` records the layout; `occult report` prints CT_node and the bytes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from occult_hf.cli import main
from occult_hf.eval.studies.placement_study import profile_from_topk, qwen_halves, structured_topk
from occult_hf.metrics import evaluate_placement, node_traffic, token_ranks
from occult_hf.placement import Placement, plan_placement
from occult_hf.placement.objectives import NodesFirst, PairwiseCut, SampleCT

ROUTING = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing"
QWEN_TRACE = ROUTING / "qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
FAST = {"search_rounds": 6}


def halves(num_experts=64, top_k=8, tokens=3000, seed=1):
    ids_Nk = structured_topk(tokens, num_experts, top_k, num_groups=8, seed=seed)
    half = tokens // 2
    return profile_from_topk({0: ids_Nk[:half]}, num_experts, "plan"), profile_from_topk({0: ids_Nk[half:]}, num_experts, "held")


# ----- the placement file ----------------------------------------------------------------------------
def test_placement_records_its_node_layout_and_reads_it_back(tmp_path):
    placement = Placement.contiguous(16, 8, [0, 1])
    placement.devices_per_node = 4
    path = tmp_path / "p.json"
    placement.save(path)
    assert json.loads(path.read_text())["devices_per_node"] == 4
    loaded = Placement.load(path)
    assert loaded.devices_per_node == 4 and loaded.num_nodes == 2 and loaded == placement
    assert "devices_per_node" not in Placement.contiguous(16, 8, [0]).to_dict()  # one node: the format as before


@pytest.mark.parametrize(
    "value, message",
    [(3, r"devices_per_node is 3, which does not divide num_devices=8"), (2.0, r"devices_per_node must be an integer"),
     (True, r"devices_per_node must be an integer"), (0, r"devices_per_node must be >= 1")],
)  # fmt: skip
def test_a_bad_node_layout_in_a_file_names_the_file(tmp_path, value, message):
    data = Placement.contiguous(16, 8, [0]).to_dict()
    data["devices_per_node"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"placement '{path}': \$\.{message}"):
        Placement.load(path)
    with pytest.raises((ValueError, TypeError), match="devices_per_node"):
        Placement(16, 8, {0: [0] * 2 + list(range(8)) * 1 + [7] * 6}, devices_per_node=value)


# ----- the metrics -------------------------------------------------------------------------------------
def test_node_traffic_matches_a_literal_loop():
    rng = np.random.default_rng(0)
    num_experts, top_k, num_devices, per_node = 24, 4, 8, 4
    ids_Nk = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(101)])
    device_of_E = rng.permutation(np.arange(num_experts) * num_devices // num_experts)
    traffic = node_traffic(ids_Nk, device_of_E, num_devices, per_node)
    ranks = token_ranks(len(ids_Nk), num_devices)
    ct_node, flat, hierarchical = [], [], []
    sent_flat, sent_hier = np.zeros(num_devices), np.zeros(num_devices)
    for n, ids in enumerate(ids_Nk):
        devices = {int(device_of_E[e]) for e in ids}
        nodes = {d // per_node for d in devices}
        own = ranks[n] // per_node
        ct_node.append(len(nodes))
        flat.append(sum(d // per_node != own for d in devices))
        hierarchical.append(len(nodes - {own}))
        sent_flat[ranks[n]] += flat[-1]
        sent_hier[ranks[n]] += hierarchical[-1]
    assert traffic.ct_node_mean == pytest.approx(np.mean(ct_node))
    assert traffic.cross_rows_flat == pytest.approx(np.mean(flat))
    assert traffic.cross_rows_hierarchical == pytest.approx(np.mean(hierarchical))
    assert traffic.sent_cross_flat_D.tolist() == sent_flat.tolist()
    assert traffic.sent_cross_hierarchical_D.tolist() == sent_hier.tolist()
    with pytest.raises(ValueError, match="devices_per_node=3 does not divide num_devices=8"):
        node_traffic(ids_Nk, device_of_E, num_devices, 3)


# ----- the objective --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ct", "cut"])
def test_nodes_first_deltas_equal_the_recomputed_cost(kind):
    rng = np.random.default_rng(1)
    num_experts, num_devices, per_node = 16, 8, 2
    routing = profile_from_topk({0: structured_topk(200, num_experts, 4, 4, seed=3)}, num_experts, "t").layer(0)
    if kind == "ct":
        make = lambda device_of_E, n: SampleCT(routing.topk_sample, device_of_E, n)  # noqa: E731
    else:
        make = lambda device_of_E, n: PairwiseCut(routing.coactivation, device_of_E, n)  # noqa: E731
    weight = 1000.0

    def cost_of(device_of_E):
        return weight * make(device_of_E // per_node, num_devices // per_node).cost + make(device_of_E, num_devices).cost

    objective = NodesFirst(make, rng.permutation(np.arange(num_experts) % num_devices), num_devices, per_node, weight)
    for _ in range(25):
        device_E = objective.device_of_E.copy()
        assert objective.cost == pytest.approx(cost_of(device_E))
        moves_ED, correction_EE = objective.move_delta_ED(), objective.swap_correction_EE()
        first, second = rng.choice(num_experts, 2, replace=False)
        if device_E[first] == device_E[second] or rng.random() < 0.3:
            target = int(rng.choice([d for d in range(num_devices) if d != device_E[first]]))
            moved = device_E.copy()
            moved[first] = target
            assert moves_ED[first, target] == pytest.approx(cost_of(moved) - cost_of(device_E))
            objective.apply_move(int(first), target, float(moves_ED[first, target]))
        else:
            swapped = device_E.copy()
            swapped[[first, second]] = swapped[[second, first]]
            delta = moves_ED[first, device_E[second]] + moves_ED[second, device_E[first]] + correction_EE[first, second]
            assert delta == pytest.approx(cost_of(swapped) - cost_of(device_E))
            objective.apply_swap(int(first), int(second), float(delta))


# ----- node-aware planning ----------------------------------------------------------------------------------
def _held_out(plan_half, held, num_devices, per_node, **options):
    placement = plan_placement(plan_half, num_devices, progress=False, **options)
    placement.devices_per_node = per_node  # measured on the same cluster whatever it was planned for
    return placement, evaluate_placement(held, placement)[0]


@pytest.mark.parametrize("num_devices", [16, 32])
def test_node_aware_refined_crosses_fewer_nodes_held_out(num_devices):
    plan_half, held = halves()
    _, contiguous = _held_out(plan_half, held, num_devices, 8, method="contiguous")
    _, flat = _held_out(plan_half, held, num_devices, 8, **FAST)
    placement, aware = _held_out(plan_half, held, num_devices, 8, devices_per_node=8, **FAST)
    assert placement.meta["options"]["devices_per_node"] == 8
    assert aware.nodes.ct_node_mean < flat.nodes.ct_node_mean < contiguous.nodes.ct_node_mean
    assert aware.nodes.cross_rows_hierarchical < flat.nodes.cross_rows_hierarchical
    planned = evaluate_placement(plan_half, placement)[0]
    assert planned.balance <= 1.10 * planned.balance_floor + 1e-9  # the load limit holds where it was planned


def test_node_aware_with_replicas_and_one_node_is_the_flat_plan():
    plan_half, held = halves(tokens=2000, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        placement, aware = _held_out(plan_half, held, 16, 8, devices_per_node=8, num_redundant_experts=8, **FAST)
        _, flat = _held_out(plan_half, held, 16, 8, num_redundant_experts=8, **FAST)
    assert placement.has_replicas and aware.nodes.ct_node_mean < flat.nodes.ct_node_mean
    one_node = plan_placement(plan_half, 8, progress=False, devices_per_node=8, **FAST)
    assert one_node.layers == plan_placement(plan_half, 8, progress=False, **FAST).layers
    with pytest.raises(ValueError, match="plan_placement devices_per_node=3 does not divide num_devices=16"):
        plan_placement(plan_half, 16, progress=False, devices_per_node=3)
    with pytest.raises(ValueError, match="objective='slowest' does not model nodes"):
        plan_placement(plan_half, 16, progress=False, devices_per_node=8, objective="slowest")


@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason="needs ../shared/data/routing (the real Qwen1.5-MoE trace)")
def test_node_aware_on_the_real_qwen_trace_held_out():
    plan_half, held = qwen_halves(ROUTING)
    _, flat = _held_out(plan_half, held, 16, 8)
    _, aware = _held_out(plan_half, held, 16, 8, devices_per_node=8)
    assert aware.nodes.ct_node_mean < flat.nodes.ct_node_mean


# ----- the command line -----------------------------------------------------------------------------------
def test_place_and_report_with_devices_per_node(tmp_path, capsys):
    plan_half, _ = halves(tokens=1200)
    plan_half.save(tmp_path / "p.safetensors")
    out = tmp_path / "placement.json"
    argv = ["place", str(tmp_path / "p.safetensors"), "--num-devices", "16", "--devices-per-node", "8", "--out", str(out),
            "--cross-validate", "0", "--option", "search_rounds=2", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert Placement.load(out).devices_per_node == 8
    assert "CT_node" in capsys.readouterr().out
    argv = ["report", str(tmp_path / "p.safetensors"), str(out), "--hidden-size", "2048", "--no-plots", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "x-node bytes hier." in printed and "rows of 4144 B" in printed
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "p.safetensors"), str(out), "--devices-per-node", "3", "--no-plots"])
    assert "--devices-per-node=3 does not divide num_devices=16" in capsys.readouterr().err
