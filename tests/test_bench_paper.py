"""`occult bench paper --scale tiny` on 2 gloo ranks, in one world: every row of both experiments runs or
says why for one model (Qwen1.5-MoE, on its real trace when ../shared has it), and the rows where the
other two families differ run for them (DeepSeek-MoE: the native class under transformers' EP and
under DDP; OLMoE: its routing source and the placed and pruned rows). The exact rows give the stock
model's logits (timings themselves are not asserted: CPU times say nothing about NVLink)."""

import argparse
import json
from pathlib import Path

import pytest
from distributed import run_world

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"

#: per run in the world: (models, extra arguments); the first runs every row
RUNS = (
    ("qwen1.5-moe-a2.7b", ["--experiment", "all"]),
    ("deepseek-moe-16b", ["--rows", "stock_1gpu", "hf_ep_all_to_all", "hf_ep_all_reduce", "occult_placed", "occult_exact", "ddp"]),
    ("olmoe-1b-7b", ["--experiment", "prefill", "--rows", "stock_1gpu", "occult_placed", "occult_nd1"]),
)


def _bench(rank, world_size, out: str, trace: str | None) -> list:
    from occult_hf.benchmarks import paper

    parser = argparse.ArgumentParser()
    paper.add_arguments(parser)
    codes = []
    for model, extra in RUNS:
        argv = ["--scale", "tiny", "--models", model, "--out", f"{out}/{model}", "--trace", f"qwen1.5-moe-a2.7b={trace or 'none'}", *extra]
        codes.append(paper.run(parser.parse_args(argv)))
    return codes


def _rows(out: Path) -> dict:
    by_key = {}
    for row in json.loads((out / "paper_comparison_2xcpu.json").read_text())["rows"]:
        assert (row["experiment"], row["key"]) not in by_key, row
        assert (row["ms"] > 0 and row["reason"] == "") or row["reason"], row  # a row ran (a time) or says why not
        by_key[row["experiment"], row["key"]] = row
    return by_key


@pytest.mark.world_size(2)
def test_paper_bench_tiny_every_row_runs_or_says_why(tmp_path):
    from occult_hf.benchmarks.paper import FINETUNE_ROWS, PREFILL_ROWS
    from occult_hf.hf_ep import transformers_ep_available

    trace = str(TRACE) if TRACE.is_file() else None
    assert run_world(_bench, 2, str(tmp_path), trace, timeout_s=600) == [[0] * len(RUNS)] * 2

    # Qwen1.5-MoE: every row of both experiments
    out = tmp_path / "qwen1.5-moe-a2.7b"
    table = (out / "paper_comparison_2xcpu.md").read_text()
    assert (out / "paper_comparison_2xcpu.png").stat().st_size > 0
    assert "paper (4x A6000 PCIe)" in table and "machine kind" in table and "transformers" in table
    qwen = _rows(out)
    assert set(qwen) == {("prefill", k) for k, _ in PREFILL_ROWS} | {("finetune", k) for k, _ in FINETUNE_ROWS}
    prefill = {k: qwen["prefill", k] for k, _ in PREFILL_ROWS}
    must_run = ["stock_1gpu", "device_map_auto", "occult_per_expert", "occult_contiguous", "occult_placed", "occult_nd2", "occult_nd1"]
    assert all(prefill[k]["reason"] == "" for k in must_run), {k: prefill[k]["reason"] for k in must_run}
    # exact rows: the stock model's last-position logits on the same batch and routing (fp32)
    for key in ("device_map_auto", "occult_per_expert", "occult_contiguous", "occult_placed", "occult_nd2"):
        assert prefill[key]["max_rel_err"] <= 1e-5, (key, prefill[key]["max_rel_err"])
    assert prefill["occult_nd1"]["ct"] == 1.0  # pruned to one device per token
    assert prefill["occult_per_expert"]["ct"] == prefill["occult_contiguous"]["ct"] > 1.0
    for key in ("hf_ep_all_to_all", "hf_ep_all_reduce", "hf_ep_occult"):
        if prefill[key]["reason"] == "":
            assert prefill[key]["max_rel_err"] <= 1e-5, (key, prefill[key]["max_rel_err"])
        elif transformers_ep_available():
            pytest.fail(f"qwen {key} did not run: {prefill[key]['reason']}")
    assert prefill["megablocks"]["reason"]
    finetune = {k: qwen["finetune", k] for k, _ in FINETUNE_ROWS}
    for key in ("occult_exact", "occult_pruned", "fsdp2", "ddp"):
        assert finetune[key]["reason"] == "" and finetune[key]["tokens_per_s"] > 0, (key, finetune[key]["reason"])
    # step 1 starts from the same weights, data and routing everywhere: exact EP, FSDP2 and DDP agree
    for key in ("occult_exact", "fsdp2"):
        assert abs(finetune[key]["loss"] - finetune["ddp"]["loss"]) < 5e-3, key
    assert finetune["occult_pruned"]["ct"] == 1.0
    if trace is not None:  # on real routing the planned placement keeps more collaboration on one device
        assert prefill["occult_placed"]["ct"] < prefill["occult_contiguous"]["ct"]
        assert prefill["occult_placed"]["routing"].startswith("trace qwen15moe")

    # DeepSeek-MoE (native class): the rows asked for, and only those
    deepseek = _rows(tmp_path / "deepseek-moe-16b")
    assert set(deepseek) == {("prefill", k) for k in ("stock_1gpu", "hf_ep_all_to_all", "hf_ep_all_reduce", "occult_placed")} | {
        ("finetune", k) for k in ("occult_exact", "ddp")
    }
    assert deepseek["prefill", "occult_placed"]["max_rel_err"] <= 1e-5
    assert abs(deepseek["finetune", "occult_exact"]["loss"] - deepseek["finetune", "ddp"]["loss"]) < 5e-3

    # OLMoE: placed and pruned rows on its routing source
    olmoe = _rows(tmp_path / "olmoe-1b-7b")
    assert set(olmoe) == {("prefill", k) for k in ("stock_1gpu", "occult_placed", "occult_nd1")}
    assert olmoe["prefill", "occult_placed"]["max_rel_err"] <= 1e-5 and olmoe["prefill", "occult_nd1"]["ct"] == 1.0
    assert olmoe["prefill", "stock_1gpu"]["routing"].startswith("own router")
