"""`occult bench paper --scale tiny` on 2 gloo ranks: every row of both experiments runs or says why, and
the exact rows give the stock model's logits (timings themselves are not asserted: CPU times say
nothing about NVLink)."""

import argparse
import json
from pathlib import Path

import pytest
from distributed import run_world

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


def _bench(rank, world_size, out: str, trace: str | None) -> int:
    from occult_hf.benchmarks import paper

    parser = argparse.ArgumentParser()
    paper.add_arguments(parser)
    argv = ["--scale", "tiny", "--out", out, "--trace", f"qwen1.5-moe-a2.7b={trace or 'none'}"]
    return paper.run(parser.parse_args(argv))


@pytest.mark.world_size(2)
def test_paper_bench_tiny_every_row_runs_or_says_why(tmp_path):
    from occult_hf.benchmarks.paper import FINETUNE_ROWS, PAPER_MODELS, PREFILL_ROWS
    from occult_hf.hf_ep import transformers_ep_available

    trace = str(TRACE) if TRACE.is_file() else None
    assert run_world(_bench, 2, str(tmp_path), trace, timeout_s=900) == [0, 0]
    rows = json.loads((tmp_path / "paper_comparison_2xcpu.json").read_text())["rows"]
    table = (tmp_path / "paper_comparison_2xcpu.md").read_text()
    assert (tmp_path / "paper_comparison_2xcpu.png").stat().st_size > 0
    assert "paper (4x A6000 PCIe)" in table and "machine kind" in table and "transformers" in table

    by_key = {}
    for row in rows:
        assert (row["experiment"], row["model"], row["key"]) not in by_key, row
        by_key[row["experiment"], row["model"], row["key"]] = row
    expected = {("prefill", m, k) for m in PAPER_MODELS for k, _ in PREFILL_ROWS}
    expected |= {("finetune", m, k) for m in PAPER_MODELS for k, _ in FINETUNE_ROWS}
    assert set(by_key) == expected
    for row in rows:  # a row either ran (a time) or says why it did not
        assert (row["ms"] > 0 and row["reason"] == "") or row["reason"], row

    must_run = ["stock_1gpu", "device_map_auto", "occult_per_expert", "occult_contiguous", "occult_placed", "occult_nd2", "occult_nd1"]
    for model in PAPER_MODELS:
        prefill = {k: by_key["prefill", model, k] for k, _ in PREFILL_ROWS}
        assert all(prefill[k]["reason"] == "" for k in must_run), {k: prefill[k]["reason"] for k in must_run}
        # exact rows: the stock model's last-position logits on the same batch and routing (fp32)
        for key in ("device_map_auto", "occult_per_expert", "occult_contiguous", "occult_placed", "occult_nd2"):
            assert prefill[key]["max_rel_err"] <= 1e-5, (model, key, prefill[key]["max_rel_err"])
        assert prefill["occult_nd1"]["ct"] == 1.0  # pruned to one device per token
        assert prefill["occult_per_expert"]["ct"] == prefill["occult_contiguous"]["ct"] > 1.0
        for key in ("hf_ep_all_to_all", "hf_ep_all_reduce", "hf_ep_occult"):
            if prefill[key]["reason"] == "":
                assert prefill[key]["max_rel_err"] <= 1e-5, (model, key, prefill[key]["max_rel_err"])
            elif model != "deepseek-moe-16b" and transformers_ep_available():
                pytest.fail(f"{model} {key} did not run: {prefill[key]['reason']}")
        assert prefill["megablocks"]["reason"]

        finetune = {k: by_key["finetune", model, k] for k, _ in FINETUNE_ROWS}
        for key in ("occult_exact", "occult_pruned", "fsdp2", "ddp"):
            assert finetune[key]["reason"] == "" and finetune[key]["tokens_per_s"] > 0, (model, key, finetune[key]["reason"])
        # step 1 starts from the same weights, data and routing everywhere: exact EP, FSDP2 and DDP agree (bf16 autocast)
        for key in ("occult_exact", "fsdp2"):
            assert abs(finetune[key]["loss"] - finetune["ddp"]["loss"]) < 5e-3, (model, key)
        assert finetune["occult_pruned"]["ct"] == 1.0

    if trace is not None:  # on real routing the planned placement keeps more collaboration on one device
        qwen = {k: by_key["prefill", "qwen1.5-moe-a2.7b", k] for k, _ in PREFILL_ROWS}
        assert qwen["occult_placed"]["ct"] < qwen["occult_contiguous"]["ct"]
        assert qwen["occult_placed"]["routing"].startswith("trace qwen15moe")
    assert by_key["prefill", "olmoe-1b-7b", "stock_1gpu"]["routing"].startswith("own router")
