"""`occult bench paper --scale tiny` on 2 gloo ranks, in one world: every row of both experiments runs or
says why for one model (Qwen1.5-MoE, on its real trace when ../shared has it), and the rows where the
other two families differ run for them (DeepSeek-MoE: the native class under transformers' EP, through
the `base_model_ep_plan` occult_hf declares for it, and under DDP; OLMoE: the study model's routing
the repository ships, and the placed and pruned rows). The exact rows give the stock model's logits
(timings themselves are not asserted: CPU times say nothing about NVLink). OLMoE's occult fine-tuning rows
also run as on the GPU: bf16 weights under bf16 autocast with CUDA's autocast policy and the Triton
kernels' dtype rule reproduced on CPU (`cuda_autocast`), where the first GPU run failed and fp32 on CPU did not."""

import argparse
import contextlib
import json
from pathlib import Path

import pytest
from cuda_autocast import cuda_autocast_on_cpu
from distributed import run_world

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
STUDY = REPO / "docs/quality_results/study_routing_h200.npz"  # ships: the OLMoE and DeepSeek rows always replay it

HF_EP_ROWS = ("hf_ep_all_to_all", "hf_ep_all_reduce", "hf_ep_occult")
#: per run in the world: (output folder, model, extra arguments); the first runs every row
RUNS = (
    ("qwen1.5-moe-a2.7b", "qwen1.5-moe-a2.7b", ["--experiment", "all"]),
    ("deepseek-moe-16b", "deepseek-moe-16b", ["--rows", "stock_1gpu", *HF_EP_ROWS, "occult_placed", "occult_exact", "ddp"]),
    ("olmoe-1b-7b", "olmoe-1b-7b", ["--experiment", "prefill", "--rows", "stock_1gpu", "occult_contiguous", "occult_placed", "occult_nd1"]),
    # the GPU's mixed precision (run under cuda_autocast_on_cpu)
    ("olmoe-bf16", "olmoe-1b-7b", ["--experiment", "finetune", "--rows", "occult_exact", "occult_pruned", "ddp", "--dtype", "bfloat16"]),
)


def _bench(rank, world_size, out: str, trace: str | None) -> list:
    from occult_hf.benchmarks import paper

    parser = argparse.ArgumentParser()
    paper.add_arguments(parser)
    codes = []
    for folder, model, extra in RUNS:
        traces = [f"qwen1.5-moe-a2.7b={trace or 'none'}", f"olmoe-1b-7b={STUDY}", f"deepseek-moe-16b={STUDY}"]
        argv = ["--scale", "tiny", "--models", model, "--out", f"{out}/{folder}", *(f"--trace={t}" for t in traces), *extra]
        with cuda_autocast_on_cpu() if "bfloat16" in extra else contextlib.nullcontext():
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
    from occult_hf.benchmarks.megablocks import megablocks_missing
    from occult_hf.benchmarks.paper_rows import FINETUNE_ROWS, PREFILL_ROWS
    from occult_hf.hf.native_ep import transformers_ep_available

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
    _check_transformers_ep(prefill, transformers_ep_available())
    # MegaBlocks is built only on the GPU machine: here both its rows say what is missing
    missing = megablocks_missing()
    assert missing and prefill["megablocks"]["reason"] == qwen["finetune", "megablocks"]["reason"] == missing
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

    # DeepSeek-MoE (native class): the rows asked for, and only those; transformers' EP runs it
    deepseek = _rows(tmp_path / "deepseek-moe-16b")
    assert set(deepseek) == {("prefill", k) for k in ("stock_1gpu", *HF_EP_ROWS, "occult_placed")} | {
        ("finetune", k) for k in ("occult_exact", "ddp")
    }
    assert deepseek["prefill", "occult_placed"]["max_rel_err"] <= 1e-5
    _check_transformers_ep({k: deepseek["prefill", k] for k in HF_EP_ROWS}, transformers_ep_available())
    assert "first 6 of its score-ordered top-8" in deepseek["prefill", "stock_1gpu"]["routing"]
    assert abs(deepseek["finetune", "occult_exact"]["loss"] - deepseek["finetune", "ddp"]["loss"]) < 5e-3

    # OLMoE: the study model's routing, on which the planned placement keeps more collaboration on one device
    olmoe = {key: row for (_, key), row in _rows(tmp_path / "olmoe-1b-7b").items()}
    assert set(olmoe) == {"stock_1gpu", "occult_contiguous", "occult_placed", "occult_nd1"}
    assert olmoe["occult_placed"]["max_rel_err"] <= 1e-5 and olmoe["occult_nd1"]["ct"] == 1.0
    assert olmoe["occult_placed"]["ct"] < olmoe["occult_contiguous"]["ct"]
    assert olmoe["stock_1gpu"]["routing"].startswith("trace study_routing_h200.npz (the project's study model")

    # OLMoE fine-tuning in bf16 under (CUDA's) autocast: the occult rows run (the first GPU run's rows failed:
    # "gate_up_proj dtype torch.bfloat16 differs from x_RH dtype torch.float32") and start from DDP's loss
    bf16 = {key: row for (_, key), row in _rows(tmp_path / "olmoe-bf16").items()}
    assert set(bf16) == {"occult_exact", "occult_pruned", "ddp"}
    assert all(row["reason"] == "" for row in bf16.values()), {k: r["reason"] for k, r in bf16.items()}
    assert abs(bf16["occult_exact"]["loss"] - bf16["ddp"]["loss"]) < 2e-2 and bf16["occult_pruned"]["ct"] == 1.0


def _check_transformers_ep(rows: dict, available: bool) -> None:
    """transformers' EP rows give the stock logits, or (transformers < 5.23 only) say why not."""
    for key in HF_EP_ROWS:
        if rows[key]["reason"] == "":
            assert rows[key]["max_rel_err"] <= 1e-5, (key, rows[key]["max_rel_err"])
        elif available:
            pytest.fail(f"{key} did not run: {rows[key]['reason']}")


def test_paper_routing_fits_a_trace_to_the_model_or_says_why():
    import numpy as np

    from occult_hf.profile.replay import fit_routing, trace_layer
    from occult_hf.profile.trace import read_trace_ids

    ids_NLk, _, meta = read_trace_ids(STUDY)
    assert ids_NLk.shape == (6144, 8, 8) and meta["score_ordered"] and int(ids_NLk.max()) == 63
    assert fit_routing(ids_NLk, meta, "study", 64, 8)[0] is ids_NLk
    top6_NLk, adapted = fit_routing(ids_NLk, meta, "study", 64, 6)
    assert np.array_equal(top6_NLk, ids_NLk[:, :, :6]) and "first 6 of its score-ordered top-8" in adapted
    with pytest.raises(ValueError, match="score_ordered"):  # a larger k from a file that does not say its order
        fit_routing(ids_NLk, {}, "unordered", 64, 6)
    with pytest.raises(ValueError, match="E=60"):
        fit_routing(ids_NLk, meta, "study", 60, 8)
    # depth in proportion: OLMoE's 16 layers read every trace layer twice, DeepSeek's 27 all 8 in order
    assert [trace_layer(i, 16, 8) for i in range(16)] == [i // 2 for i in range(16)]
    deepseek = [trace_layer(i, 27, 8) for i in range(27)]
    assert deepseek == sorted(deepseek) and set(deepseek) == set(range(8))
