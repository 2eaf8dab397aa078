"""The calibrated cost model (`occult_hf.scale`, `occult plan-cluster`; docs/scale.md).

- The equations on hand-computable cases: a layer's time from its traffic and round parameters (flat and
  hierarchical exchange, forward and forward+backward, FSDP2's gathers), and the traffic a small routing replays
  (CT, CT_node, pairs, bytes on each link, node-limited pruning and the weight it removes).
- The measurements: the shipped file equals what the benchmark files in docs/ hold, its replayed splits reproduce the
  CT each `bench paper` row recorded, and the calibration from it predicts the measured two-GPU rows within 15%,
  except the rows docs/scale.md names as misses (a change that moves a row across the line fails here, so the page
  stays true); the spread analysis finds the other measurements of a row's work.
- The model specs agree with the configurations `occult bench paper` builds; the synthetic 256-expert routing keeps
  the real one's co-activation between experts.
- `occult plan-cluster` on the study trace that ships; bad input (method, D, files) ends in one clear line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from occult_hf.cli import main
from occult_hf.scale.calibration import calibrate, fit_host_overlap
from occult_hf.scale.parameters import Calibration, HostOverlap, Line
from occult_hf.scale.cost import FWD, FWD_BWD, Cluster, ep_layer_ms, exchange_ms, gathered_ms, stock_layer_ms
from occult_hf.scale.measurements import STUDY_TRACE_NAME, load_measurements, paper_tokens, read_measurements
from occult_hf.benchmarks.paper_replay import replayed_split
from occult_hf.placement.placement import contiguous_devices
from occult_hf.scale import report
from occult_hf.scale.projection import ep_group_size
from occult_hf.scale.routing import fit_to_model, load_routing
from occult_hf.scale.specs import MODEL_SPECS, ModelSpec
from occult_hf.scale.synthetic import split_experts
from occult_hf.scale.traffic import LayerTraffic, replay_traffic, row_bytes
from occult_hf.scale.spread import spreads
from occult_hf.scale.validation import Checked, validate

DOCS = Path(__file__).resolve().parents[1] / "docs"
STUDY_TRACE = DOCS / "quality_results" / "study_routing_h200.npz"

#: round parameters: kernels 1 ms + GFLOP / 500 TFLOP/s (2 ms forward+backward + GFLOP / 250), dispatcher host 4 ms,
#: gap 2 ms, 1 ms per 1000 rows (forward+backward 6, 4, 2), NVLink 0.05 ms per call + MB / 200 GB/s, dense 400 TFLOP/s
ROUND = Calibration(
    kernels={"occult/fwd": Line(1.0, 1 / 500), "occult/fwd_bwd": Line(2.0, 1 / 250),
             "transformers/fwd": Line(1.0, 1 / 250), "transformers/fwd_bwd": Line(2.0, 1 / 125)},
    dispatchers={"occult/fwd": HostOverlap(4.0, 2.0, 1.0), "occult/fwd_bwd": HostOverlap(6.0, 4.0, 2.0)},
    nvlink=Line(0.05, 1 / 200), dense_tflops=400.0, rest_ms_per_ktoken={}, optimizer_ms_per_bparam=10.0,
)  # fmt: skip
#: H = 1000, I = 500 (an expert: 1.5 M weights), E = 8, k = 2, a shared expert of width 1000
SPEC = ModelSpec("toy", 1000, 500, 8, 2, 1000, 2, 0, 0, 100, 4_000_000, None)


# ----- the equations, by hand --------------------------------------------------------------------------------
def test_a_flat_layer_is_the_sum_of_its_parts_by_hand():
    traffic = LayerTraffic("dedup", tokens=1000, pairs=2000, rows=1500, nvlink_bytes=40e6, internode_bytes=10e6, ct=1.5, ct_node=1.2)
    cluster = Cluster(devices_per_node=4, internode_gbs=50.0, internode_latency_us=10.0)
    # NVLink: 2 calls x 0.05 + 40 MB / 200 GB/s = 0.3 ms; inter-node: 2 x 10 us + 10 MB / 50 GB/s + 2 calls x 0.05
    # = 0.32 ms; the two links at once: the slower
    assert exchange_ms(ROUND, cluster, traffic) == pytest.approx(0.32)
    # experts: 2 x 1.5 M x 2000 = 6 GFLOP -> 1 + 6 / 500 = 1.012 ms; shared: 2 x 3 M x 1000 = 6 GFLOP at 400 -> 0.015 ms
    assert ep_layer_ms(ROUND, cluster, SPEC, traffic, FWD) == pytest.approx(2.0 + 1.5 + 1.012 + 0.015 + 0.32)
    # forward+backward: 18 GFLOP -> 2 + 18 / 250; shared 0.045; dispatcher 4 + 3; the exchange twice
    assert ep_layer_ms(ROUND, cluster, SPEC, traffic, FWD_BWD) == pytest.approx(4.0 + 3.0 + 2.072 + 0.045 + 0.64)


def test_a_small_layer_takes_the_hosts_time_and_a_large_one_the_gap_plus_the_work():
    cluster = Cluster(devices_per_node=4)

    def layer(rows: int) -> float:
        traffic = LayerTraffic("dedup", tokens=10, pairs=20, rows=rows, nvlink_bytes=0.0, internode_bytes=0.0, ct=1.5, ct_node=1.0)
        return ep_layer_ms(ROUND, cluster, SPEC, traffic, FWD)

    # work: gap 2 + rows / 1000 + experts 1 + 0.06 GFLOP / 500 + shared 0.06 GFLOP / 400 + exchange 2 x 0.05 ms
    assert layer(1000) == pytest.approx(2.0 + 1.0 + 1.00012 + 0.00015 + 0.1)
    # 15 rows: 3.1 ms of work, less than the host's 4 ms
    assert layer(15) == ROUND.dispatchers["occult/fwd"].host_ms == 4.0


def test_the_host_overlap_fit_recovers_the_parameters_that_made_its_points():
    truth = HostOverlap(4.0, 1.5, 0.04)
    krows = np.array([0.1, 0.5, 1.0, 8.0, 16.0, 32.0, 64.0, 128.0])
    device = np.array([0.3, 0.4, 0.5, 1.5, 2.5, 4.0, 7.0, 13.0])
    measured = np.array([truth(k, d) for k, d in zip(krows, device)])
    line, error = fit_host_overlap(krows, device, measured, "toy")
    assert (line.host_ms, line.gap_ms, line.per_krow_ms) == pytest.approx((4.0, 1.5, 0.04)) and error < 1e-9
    with pytest.raises(ValueError, match="toy: the host-overlap fit needs at least 3 measured points"):
        fit_host_overlap(krows[:2], device[:2], measured[:2], "toy")


def test_the_hierarchical_exchange_pays_its_four_calls_and_runs_its_hops_in_turn_and_the_flat_one_its_links_at_once():
    cluster = Cluster(devices_per_node=4, internode_gbs=50.0, internode_latency_us=10.0)
    slow = dict(tokens=1000, pairs=2000, rows=1500, nvlink_bytes=20e6, internode_bytes=50e6, ct=2.0, ct_node=2.0)
    # flat: one all-to-all per direction, 2 calls x 0.05 ms; NVLink 0.1 ms of bytes, inter-node 1.0 ms + 2 x 10 us
    assert exchange_ms(ROUND, cluster, LayerTraffic("dedup", **slow)) == pytest.approx(0.1 + max(0.1, 1.02))
    # hierarchical (dispatch/hierarchical.py): the inter-node hop's all-to-all and the intra-node hop's, in dispatch
    # and in combine: 4 calls x 0.05 ms, the inter-node pair's latency, both hops' bytes in turn
    assert exchange_ms(ROUND, cluster, LayerTraffic("hierarchical", **slow)) == pytest.approx(4 * 0.05 + 0.02 + 1.0 + 0.1)


def test_one_node_sends_no_inter_node_byte_and_pays_no_inter_node_latency():
    """At D = G every flat row stays on NVLink: exactly 0 bytes (not a float residue), so the network settings cannot
    change a one-node figure."""
    ids = load_routing(STUDY_TRACE).ids_NLk[:, 0]
    spec = MODEL_SPECS["olmoe-1b-7b"]
    for dispatch in ("dedup", "per_expert", "hierarchical"):
        traffic = replay_traffic(ids, None, contiguous_devices(64, 8), 8, 8, tokens=16, dispatch=dispatch, hidden=spec.hidden)
        assert traffic.internode_bytes == 0.0, dispatch
        near, far = (Cluster(internode_latency_us=us) for us in (10.0, 1000.0))
        assert exchange_ms(ROUND, near, traffic) == exchange_ms(ROUND, far, traffic), dispatch


def test_fsdp2_gathers_its_parameters_once_forward_and_three_times_forward_and_backward():
    cluster = Cluster(devices_per_node=8, internode_gbs=50.0)
    # 100 M bf16 parameters over 4 GPUs of one node: 3/4 x 200 MB at NVLink's 200 GB/s = 0.75 ms per collective
    assert gathered_ms(ROUND, cluster, 100e6, 4, FWD) == pytest.approx(0.75)
    assert gathered_ms(ROUND, cluster, 100e6, 4, FWD_BWD) == pytest.approx(2.25)
    # across nodes at the node's NICs together (8 x 50 = 400 GB/s), capped at NVLink's 200: 15/16 x 200 MB / 200 GB/s
    assert gathered_ms(ROUND, cluster, 100e6, 16, FWD) == pytest.approx(0.9375)
    # one GPU's layer: transformers' kernel on T k pairs and the shared expert
    assert stock_layer_ms(ROUND, SPEC, 1000, FWD) == pytest.approx(1 + 6 / 250 + 0.015)


def test_replayed_traffic_by_hand():
    # E = D = 4 (expert e on device e), G = 2: nodes {0, 1} and {2, 3}; k = 2
    ids = np.array([[0, 1], [0, 2], [2, 3], [1, 3]])
    devices = np.arange(4)
    flat = replay_traffic(ids, None, devices, 4, 2, tokens=100, dispatch="dedup", hidden=10)
    assert (flat.ct, flat.ct_node) == (2.0, pytest.approx(1.5))
    # every device holds 2 of the 8 pairs: 100 tokens x 4 ranks x 2/4 pairs per token
    assert flat.pairs == pytest.approx(200)
    # p_d = 1/2 on every device: a rank sends 100 x 1/2 rows to its node's other device and 100 x (1/2 + 1/2) to the
    # other node; a device receives 100 x 1/2 from its node's other rank and 100 x 2 x 1/2 from the other node
    per_row = row_bytes("dedup", 10, 2)
    assert flat.nvlink_bytes == pytest.approx(50 * per_row) and flat.internode_bytes == pytest.approx(100 * per_row)
    hierarchical = replay_traffic(ids, None, devices, 4, 2, tokens=100, dispatch="hierarchical", hidden=10)
    # q_m = 3/4 for both nodes: one copy per other node, 100 x 3/4 rows each way; NVLink: N = 2 times the flat rows
    assert hierarchical.internode_bytes == pytest.approx(75 * per_row)
    assert hierarchical.nvlink_bytes == pytest.approx(100 * per_row)
    per_expert = replay_traffic(ids, None, devices, 4, 2, tokens=100, dispatch="per_expert", hidden=10)
    assert per_expert.rows == pytest.approx(200) and flat.rows == pytest.approx(200)  # distinct experts: pairs = rows


def test_node_limited_pruning_keeps_one_node_and_reports_the_weight_it_removes():
    ids = np.array([[0, 2], [1, 3], [0, 1]])
    weights = np.array([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]], dtype=np.float32)
    traffic = replay_traffic(ids, weights, np.arange(4), 4, 2, tokens=10, dispatch="hierarchical", hidden=10, max_nodes_per_token=1)
    assert traffic.ct_node == 1.0
    # tokens 0 and 1 lose one expert each (weights 0.3 and 0.2 of a total 3.0); token 2 spans one node already
    assert traffic.removed_slots == pytest.approx(2 / 6)
    assert traffic.removed_weight == pytest.approx(0.5 / 3.0)
    # the pruned pairs move to the token's kept device: device 0 serves 3 of the 6 pairs (10 tokens x 4 ranks x 3/3)
    assert traffic.pairs == pytest.approx(40)


@pytest.mark.parametrize("devices, experts, expected", [(8, 60, 8), (64, 60, 32), (256, 64, 64), (256, 256, 256), (4, 64, 4)])
def test_the_ep_group_fills_whole_nodes_and_holds_an_expert_per_device(devices, experts, expected):
    assert ep_group_size(devices, experts, 8) == expected


# ----- measurements, calibration, validation --------------------------------------------------------------------
def test_the_shipped_measurements_are_what_docs_holds():
    shipped = load_measurements()
    splits = shipped.pop("replayed_splits")
    assert shipped == read_measurements(DOCS)
    # every split replays the routing its rows ran: the CT it finds is the CT they recorded
    recorded = {}
    for row in shipped["whole_models"]:
        if row["ct"] is not None and row["placement"] is not None:
            key = (row["model"], row["trace"], paper_tokens(row), row["placement"], row["max_devices_per_token"] or None)
            recorded.setdefault(key, set()).add(round(row["ct"], 2))
    assert {STUDY_TRACE_NAME, "qwen_trace.npz"} == {s["trace"] for s in splits}
    for split in splits:
        key = (split["model"], split["trace"], split["tokens"], split["placement"], split["max_devices_per_token"])
        assert recorded.get(key, {round(split["ct"], 2)}) == {round(split["ct"], 2)}, key


def test_the_replayed_split_of_olmoes_fine_tuning_is_the_benchs_routing():
    """The refined placement `bench paper` planned, redone: the CT of call 2's exact row to the last digit, and the
    busier rank's share of the pairs the shipped file holds (N_d = 1 loads one rank more than exact routing)."""
    trace = DOCS / "quality_results" / STUDY_TRACE_NAME
    exact = replayed_split(trace, "olmoe-1b-7b", 4096, "refined")
    pruned = replayed_split(trace, "olmoe-1b-7b", 4096, "refined", max_devices_per_token=1)
    assert exact.ct == 1.8941650390625 and pruned.ct == 1.0
    shipped = {(s["placement"], s["max_devices_per_token"]): s["busiest_share"] for s in load_measurements()["replayed_splits"]
               if (s["model"], s["tokens"]) == ("olmoe-1b-7b", 4096)}  # fmt: skip
    assert (exact.busiest_share, pruned.busiest_share) == (shipped[("refined", None)], shipped[("refined", 1)])
    assert 0.5 < exact.busiest_share < pruned.busiest_share < 0.6


#: rows docs/scale.md names as the model's misses (|error| > 15%): host-bound T = 128 rows whose measurements of the
#: same work spread more than 15%, one T = 4096 row, and the pruned fine-tuning steps of the call-2 rerun
KNOWN_MISSES = {
    ("bench ep fwd", "qwen1.5-moe-a2.7b T=128 Qwen1.5 trace: all_to_all per_expert+contiguous (CT 1.93)"),
    ("bench ep fwd+bwd", "qwen1.5-moe-a2.7b T=128 Qwen1.5 trace: all_to_all per_expert+contiguous (CT 1.93)"),
    ("bench ep fwd", "qwen1.5-moe-a2.7b T=128 Qwen1.5 trace: all_to_all dedup+contiguous (CT 1.93)"),
    ("bench ep fwd+bwd", "qwen1.5-moe-a2.7b T=128 Qwen1.5 trace: all_to_all dedup+contiguous (CT 1.93)"),
    ("bench ep fwd", "qwen1.5-moe-a2.7b T=128 Qwen1.5 trace: all_to_all dedup+refined (CT 1.65)"),
    ("bench ep fwd", "qwen1.5-moe-a2.7b T=128 own router: transformers_ep all_to_all"),
    ("bench ep fwd", "olmoe-1b-7b T=128 random router: all_to_all per_expert+contiguous (CT 2.00)"),
    ("bench ep fwd", "olmoe-1b-7b T=128 random router: all_to_all dedup+contiguous (CT 2.00)"),
    ("bench ep fwd+bwd", "olmoe-1b-7b T=128 random router: all_to_all dedup+refined (CT 1.96)"),
    ("bench ep fwd", "olmoe-1b-7b T=4096 random router: all_to_all per_expert+contiguous (CT 2.00)"),
    ("bench paper fine-tuning", "olmoe-1b-7b occult_pruned (CT 1.00)"),
    ("bench paper fine-tuning", "qwen1.5-moe-a2.7b occult_pruned (CT 1.00)"),
}


def test_the_calibration_predicts_the_measured_rows_within_15_percent_but_the_named_misses():
    measurements = load_measurements()
    checked = validate(calibrate(measurements), measurements)
    assert {c.table for c in checked} == {"bench ep fwd", "bench ep fwd+bwd", "bench paper prefill", "bench paper fine-tuning"}
    assert len(checked) == 126
    misses = {(c.table, c.label) for c in checked if abs(c.error) > 0.15}
    assert misses == KNOWN_MISSES
    at_scale = [c for c in checked if "T=16384" in c.label or c.table.startswith("bench paper")]
    assert np.median([abs(c.error) for c in at_scale]) < 0.06


def test_the_spread_finds_the_same_configuration_in_other_calls_and_the_same_work_in_one():
    def row(source, mode, measured, predicted, work):
        return Checked("bench ep fwd", source, mode, measured, predicted, False, ("toy", 128, "trace", "all_to_all", mode), work)

    host = ("occult", "host-bound")
    checked = [row("a", "dedup", 2.0, 2.5, host), row("a", "per_expert", 3.0, 2.5, host), row("b", "dedup", 2.4, 2.5, host),
               row("a", "dedup+refined", 9.0, 8.0, ("occult", "dedup", 1.6))]  # fmt: skip
    first, second, third, alone = spreads(checked)
    assert first.repeats == (("b", 2.4),) and first.same_work == (("per_expert, same call", 3.0),)
    assert first.spread == pytest.approx(0.5) and first.nearest_error == pytest.approx(2.5 / 2.4 - 1)
    assert second.repeats == () and [ms for _, ms in second.same_work] == [2.0]
    assert third.same_work == () and alone.others == () and alone.spread is None and alone.nearest_error is None


def test_the_model_specs_are_the_benchmarked_configurations():
    from occult_hf.benchmarks.paper_models import PAPER_MODELS

    for name, model in PAPER_MODELS.items():
        spec, config = MODEL_SPECS[name], model.config("full")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = getattr(text, "num_experts", None) or text.n_routed_experts
        assert (spec.hidden, spec.num_experts, spec.top_k, spec.layers, spec.vocab) == (
            text.hidden_size, experts, text.num_experts_per_tok, text.num_hidden_layers, text.vocab_size
        )
        assert spec.expert_width == (getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    assert [round(MODEL_SPECS[n].params / 1e9, 2) for n in PAPER_MODELS] == [6.92, 14.32, 16.38]


def test_split_experts_keeps_the_tokens_choices_between_experts():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, size=4, replace=False) for _ in range(400)])[:, None, :]
    split = split_experts(ids, 16, 4, seed=3)
    assert split.shape == ids.shape and split.min() >= 0 and split.max() < 64
    assert all(len(set(row)) == 4 for row in split[:, 0])
    # the shuffle is one permutation: undo it and each child's parent is the real expert
    parents = {}
    for child, parent in zip(split.ravel(), ids.ravel()):
        assert parents.setdefault(int(child), int(parent)) == parent


# ----- the command line ---------------------------------------------------------------------------------------
def test_plan_cluster_runs_on_the_shipped_study_trace(tmp_path, capsys):
    argv = ["plan-cluster", "--devices", "8", "16", "--tokens-per-rank", "16384", "2048", "--trace-layers", "0",
            "--methods", "transformers_ep", "fsdp2", "dedup+contiguous", "hierarchical+node_refined",
            "hierarchical+node_refined+Nn=1", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MODEL, not a measurement" in out and "50 GB/s per GPU with 10 us" in out
    assert "| hierarchical+node_refined+Nn=1" in out and "olmoe-1b-7b, routing study_routing_h200.npz" in out
    assert "at T = 16384 tokens per GPU" in out and "at T = 2048 tokens per GPU" in out
    assert {p.name for p in tmp_path.iterdir()} == {"plan_cluster.md", "plan_cluster.json", "plan_cluster.png"}
    assert (tmp_path / "plan_cluster.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cluster_validate_prints_the_calibration_and_the_rows(capsys):
    assert main(["plan-cluster", "--validate", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "## Calibration" in out and "NVLink all-to-all" in out and "bench paper prefill" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "dedup+magic"], "placement 'magic' is not one of contiguous, occult, refined, node_refined"),
        (["--methods", "ring_allreduce"], "method 'ring_allreduce': expected <dispatch>+<placement>"),
        (["--devices", "12"], "D=12 is not a multiple of the devices per node G=8"),
        (["--case", "olmoe-1b-7b=NOPE.npz"], "routing trace 'NOPE.npz' not found"),
        (["--case", "mixtral=x.npz"], "unknown model 'mixtral'"),
        (["--measurements", "NOPE.json"], "measurements 'NOPE.json': no such file"),
        (["--case", f"qwen1.5-moe-a2.7b={STUDY_TRACE}"], "does not fit qwen1.5-moe-a2.7b"),
        (["--case", f"olmoe-1b-7b={DOCS}"], f"routing trace '{DOCS}' is a directory"),
        (["--case", f"olmoe-1b-7b={STUDY_TRACE}", "--case", f"olmoe-1b-7b={STUDY_TRACE}"], "repeats --case"),
        (["--validate"], "--validate takes no projection argument, got --devices, --trace-layers"),
        (["--devices", "16", "16"], "--devices repeats 16: give each once"),
        (["--methods", "dedup+refined+Nd=100"], "N_d prunes nothing at any --devices (at D=8: N_d=100 >= min(GPUs=8, k=8)"),
        (["--devices", "16", "--methods", "hierarchical+node_refined+Nn=50"], "N_n prunes nothing at any --devices"),
    ],
)  # fmt: skip
def test_plan_cluster_bad_input_ends_in_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan-cluster", "--no-progress", "--devices", "8", "--trace-layers", "0", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.startswith("occult plan-cluster: error:")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flag, value, rule", [("--internode-latency-us", "inf", ">= 0"), ("--internode-gbs", "inf", "> 0"), ("--internode-gbs", "0", "> 0")]
)
def test_plan_cluster_network_assumptions_are_finite_numbers_at_parse_time(flag, value, rule, capsys):
    """`--internode-gbs inf` was taken (a network of no cost)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan-cluster", flag, value])
    assert exit_info.value.code == 2
    assert f"occult plan-cluster: error: argument {flag}: expected a finite number {rule}, got {value!r}" in capsys.readouterr().err


def _plan(argv: list[str], capsys) -> tuple[int, str]:
    """`occult plan-cluster` on the study trace's first layer, no progress bar: (exit code, stdout)."""
    code = main(["plan-cluster", "--no-progress", "--trace-layers", "0", *argv])
    return code, capsys.readouterr().out


@pytest.fixture
def saved_figures(monkeypatch) -> list:
    """The figures `occult plan-cluster --out` saves, kept instead of written."""
    figures = []
    monkeypatch.setattr(report, "atomic_save_figure", lambda figure, path, **_: figures.append(figure))
    return figures


def test_the_plot_names_the_gpus_per_node_it_ran_with(tmp_path, capsys, saved_figures):
    argv = ["--devices", "4", "8", "--devices-per-node", "4", "--tokens-per-rank", "2048", "--methods", "fsdp2",
            "dedup+contiguous", "--out", str(tmp_path)]  # fmt: skip
    assert _plan(argv, capsys)[0] == 0
    assert {axis.get_xlabel() for axis in saved_figures[0].axes} == {"GPUs D (4 per node)"}


def _legend_labels(figure) -> list[str]:
    return [text.get_text() for legend in figure.legends + [a.get_legend() for a in figure.axes if a.get_legend()]
            for text in legend.get_texts()]  # fmt: skip


def test_the_plot_legend_holds_every_method_drawn_in_any_panel(tmp_path, capsys, saved_figures):
    """transformers' EP refuses Qwen1.5's 60 experts over 8 GPUs: drawn in OLMoE's panel only, it is in the legend."""
    rng = np.random.default_rng(0)
    qwen = tmp_path / "qwen.npz"
    np.savez(qwen, topk_ids=np.stack([rng.choice(60, 4, replace=False) for _ in range(512)]).astype(np.int16))
    argv = ["--case", f"olmoe-1b-7b={STUDY_TRACE}", "--case", f"qwen1.5-moe-a2.7b={qwen}", "--devices", "8",
            "--tokens-per-rank", "2048", "--methods", "transformers_ep", "fsdp2", "--out", str(tmp_path / "out")]  # fmt: skip
    assert _plan(argv, capsys)[0] == 0
    assert sorted(_legend_labels(saved_figures[0])) == ["fsdp2", "transformers_ep"]


def test_the_plot_draws_any_number_of_methods_each_in_its_own_style(tmp_path, capsys, saved_figures):
    methods = ["transformers_ep", "fsdp2", "dedup+contiguous"] + [
        f"{dispatch}+contiguous+Nd={n}" for dispatch in ("dedup", "per_expert", "hierarchical") for n in range(1, 8)
    ]
    argv = ["--devices", "8", "--tokens-per-rank", "256", "--methods", *methods, "--out", str(tmp_path)]
    assert _plan(argv, capsys)[0] == 0
    lines = {line.get_label(): line for axis in saved_figures[0].axes for line in axis.get_lines()}
    assert sorted(lines) == sorted(methods) and sorted(_legend_labels(saved_figures[0])) == sorted(methods)
    styles = {(line.get_color(), line.get_marker(), line.get_linestyle()) for line in lines.values()}
    assert len(styles) == len(methods) == 24


def test_plan_cluster_prints_its_tables_before_it_writes_its_files(tmp_path, capsys, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(report, "atomic_save_figure", full_disk)
    argv = ["plan-cluster", "--no-progress", "--trace-layers", "0", "--devices", "8", "--tokens-per-rank", "2048",
            "--methods", "fsdp2", "dedup+contiguous", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    captured = capsys.readouterr()
    assert "| D   | EP group   | fsdp2" in captured.out and "No space left on device" in captured.err


def test_plan_cluster_projects_fsdp2_alone(capsys):
    code, out = _plan(["--devices", "8", "16", "--methods", "fsdp2"], capsys)
    assert code == 0 and "| 8   | 8          |" in out and "| 16  | 16         |" in out


def _detail_rows(out: str) -> list[list[str]]:
    """The cells of the detail table's rows (D, T, method, ..., note)."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and line.count("|") == 16 and not line.startswith("| D ")]  # fmt: skip


def test_an_ep_group_of_one_gpu_is_marked_not_modelled(capsys):
    code, out = _plan(["--devices", "1", "8", "--tokens-per-rank", "2048", "--methods", "fsdp2", "dedup+contiguous"], capsys)
    rows = {(row[0], row[2]): row for row in _detail_rows(out)}
    assert code == 0 and rows[("1", "fsdp2")][10] != "-" and rows[("8", "dedup+contiguous")][10] != "-"
    assert rows[("1", "dedup+contiguous")][10] == "-" and "an EP group of one GPU is no expert parallelism" in rows[("1", "dedup+contiguous")][-1]


def test_a_limit_that_cannot_bind_at_some_d_is_noted(capsys):
    argv = ["--devices", "8", "16", "32", "--tokens-per-rank", "256", "--methods", "hierarchical+contiguous+Nn=2"]
    code, out = _plan(argv, capsys)
    notes = {row[0]: row[-1] for row in _detail_rows(out)}
    assert code == 0 and notes == {"8": "N_n=2 >= min(nodes=1, k=8): prunes nothing",
                                   "16": "N_n=2 >= min(nodes=2, k=8): prunes nothing", "32": ""}  # fmt: skip


def test_cases_whose_traces_share_a_file_name_keep_their_own_titles(tmp_path, capsys):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "trace.npz").write_bytes(STUDY_TRACE.read_bytes())
    first, second = tmp_path / "a" / "trace.npz", tmp_path / "b" / "trace.npz"
    argv = ["--case", f"olmoe-1b-7b={first}", "--case", f"olmoe-1b-7b={second}", "--devices", "8", "--tokens-per-rank",
            "2048", "--methods", "dedup+contiguous", "--out", str(tmp_path / "out")]  # fmt: skip
    assert _plan(argv, capsys)[0] == 0
    written = json.loads((tmp_path / "out" / "plan_cluster.json").read_text())
    assert list(written) == [f"olmoe-1b-7b, routing {trace}, layers [0]" for trace in (first, second)]


def test_plan_cluster_checks_every_case_before_the_first_projection(capsys, monkeypatch):
    def project(*args, **kwargs):
        raise AssertionError("a projection ran before every case was checked")

    monkeypatch.setattr("occult_hf.scale.projection.project", project)
    argv = ["--case", f"olmoe-1b-7b={STUDY_TRACE}", "--case", "qwen1.5-moe-a2.7b=NOPE.npz", "--devices", "8"]
    with pytest.raises(SystemExit):
        _plan(argv, capsys)
    err = capsys.readouterr().err
    assert "routing trace 'NOPE.npz' not found" in err and "wheel" not in err


def test_a_malformed_measurements_file_is_refused_naming_its_field(tmp_path):
    shipped = load_measurements()
    null_time = json.loads(json.dumps(shipped))
    null_time["ep_layers"][3]["fwd_ms"] = None
    text_time = json.loads(json.dumps(shipped))
    text_time["expert_kernels"][0]["fwd_ms"] = "0.3"
    for name, data, message in (
        ("null.json", null_time, "ep_layers[3].fwd_ms is None; expected a finite number > 0"),
        ("text.json", text_time, "expert_kernels[0].fwd_ms is '0.3'; expected a finite number > 0"),
        ("empty.json", {"format": shipped["format"]}, "no 'expert_kernels' part"),
    ):  # fmt: skip
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError) as error:
            load_measurements(path)
        assert str(error.value).startswith(f"measurements {str(path)!r}: ") and message in str(error.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    with pytest.raises(ValueError) as error:
        load_measurements(broken)
    assert str(error.value).count(str(broken)) == 1


def test_a_trace_without_tokens_or_with_an_inferred_e_says_so(tmp_path):
    empty, short_of_e = tmp_path / "empty.npz", tmp_path / "e63.npz"
    np.savez(empty, topk_ids=np.zeros((0, 8), dtype=np.int16))
    np.savez(short_of_e, topk_ids=np.stack([np.arange(8) + 8 * (i % 7) for i in range(300)]).astype(np.int16))
    with pytest.raises(ValueError, match="holds no routed token"):
        load_routing(empty)
    with pytest.raises(ValueError, match="E is its largest expert id \\+ 1: its file records no n_experts"):
        fit_to_model(load_routing(short_of_e), MODEL_SPECS["olmoe-1b-7b"])


def test_validate_on_a_docs_folder_says_its_splits_are_even(capsys):
    assert main(["plan-cluster", "--no-progress", "--validate", "--measurements", str(DOCS)]) == 0
    assert "these measurements hold no replayed splits" in capsys.readouterr().out


def test_plan_cluster_help_describes_the_held_out_split_and_the_latency(capsys):
    with pytest.raises(SystemExit):
        main(["plan-cluster", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "alternate 128-token windows" in text and "first half" not in text
    assert "latency per collective call that crosses nodes" in text and "per message" not in text


def test_plan_cluster_into_a_closed_pipe_ends_quietly(tmp_path):
    """`occult plan-cluster ... | head`: the reader closes the pipe; no error line, the status a shell gives a tool
    that SIGPIPE ended, and the files --out asks for still written."""
    argv = [sys.executable, "-m", "occult_hf.cli", "plan-cluster", "--no-progress", "--trace-layers", "0", "--devices", "8",
            "--methods", "fsdp2", "--out", str(tmp_path)]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    process.stdout.close()
    assert process.wait(timeout=120) == 141 and process.stderr.read() == b""
    assert (tmp_path / "plan_cluster.md").is_file()
