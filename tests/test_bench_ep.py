"""`occult bench ep` under torchrun with 2 gloo ranks: the harness runs every mode and its figures are
consistent (timings themselves are not asserted: CPU times say nothing about NVLink)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


@pytest.mark.world_size(2)
@pytest.mark.skipif(not TRACE.is_file(), reason=f"real routing trace {TRACE} not present")
def test_bench_ep_two_gloo_ranks(tmp_path):
    from occult_hf.benchmarks.ep import MODES, TRANSFORMERS_EP
    from occult_hf.placement import Placement

    # a placement file with a replicated expert (mode dedup+file; issue 14's replicas in the benchmark)
    contiguous = Placement.contiguous(60, 2, [0])
    Placement(60, 2, {0: contiguous.device_of(0)}, replicas={0: {0: [1], 59: [0]}}).save(tmp_path / "replicated.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "occult_hf.cli",
        "bench", "ep", "--cpu", "--shapes", "qwen1.5-moe-a2.7b", "--tokens", "256", "--hidden", "32",
        "--intermediate", "16", "--iterations", "1", "--trace", str(TRACE), "--out", str(tmp_path),
        "--modes", *[m.name for m in MODES], TRANSFORMERS_EP, "dedup+replicated", "dedup+replicated+load_aware", "dedup+file",
        "--placement", str(tmp_path / "replicated.json"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"\| qwen1\.5-moe-a2\.7b +\| 256 +\| Qwen1\.5 trace +\| all_to_all: dedup\+refined +\|", done.stdout)
    results = json.loads((tmp_path / "bench_ep_2xcpu.json").read_text())["rows"]
    cases = {(r["dispatcher"], r["mode"]) for r in results}
    # every mode on the host-split dispatcher, the static fallback once, transformers' own EP; no
    # symm_mem without NVSHMEM (skipped, not failed)
    assert cases == {
        ("all_to_all", "per_expert+contiguous"), ("all_to_all", "dedup+contiguous"), ("all_to_all", "dedup+refined"),
        ("all_to_all", "dedup+refined+Nd=2"), ("all_to_all", "dedup+refined+Nd=1"), ("padded", "dedup+refined"),
        ("transformers_ep", "all_to_all"), ("all_to_all", "dedup+replicated"), ("all_to_all", "dedup+file"),
        ("all_to_all", "dedup+replicated+load_aware"),
    }  # fmt: skip
    assert all(r["note"] == "" for r in results), [r["note"] for r in results]
    rows = {r["mode"]: r for r in results if r["dispatcher"] == "all_to_all"}
    assert (tmp_path / "bench_ep_2xcpu.png").stat().st_size > 0
    # one copy per destination device sends less than one copy per expert on real routing
    assert rows["dedup+contiguous"]["sent_mb_max"] < rows["per_expert+contiguous"]["sent_mb_max"]
    # the refined placement (planned on the first half of the trace, measured on the replay) keeps more collaboration local
    assert rows["dedup+refined"]["ct"] < rows["dedup+contiguous"]["ct"]
    assert rows["dedup+refined+Nd=1"]["ct"] == 1.0
    # replicas: refined with one redundant slot per rank; the file's copies of experts 0 and 59 on both ranks
    # serve some pairs on the device the token visits anyway, so CT is below the file's primary map's
    assert rows["dedup+replicated"]["ct"] < rows["dedup+contiguous"]["ct"]
    # the load-aware rule splits a replicated expert's pairs by the batch's loads, keeping pairs on visited homes
    assert rows["dedup+replicated+load_aware"]["ct"] < rows["dedup+contiguous"]["ct"]
    assert rows["dedup+file"]["ct"] < rows["dedup+contiguous"]["ct"]
    assert 1.0 <= rows["dedup+refined+Nd=2"]["ct"] <= 2.0
    # the layer with its exchange skipped was timed for every case
    assert all(r["skipped_fwd_ms"] > 0 and r["skipped_fwd_bwd_ms"] > 0 for r in rows.values())
    # the wire alone, re-issued: the host-split exchanges and "padded"'s equal-split blocks
    padded = next(r for r in results if r["dispatcher"] == "padded")
    assert padded["wire_ms"] > 0 and rows["dedup+refined"]["wire_ms"] > 0


def test_busy_time_is_the_union_of_the_device_intervals_and_counts_the_idle_gaps():
    """A profile's GPU busy time overlaps concurrent kernels once, and the idle time within the step is the span from
    the first kernel to the last less that union. At 58750c0 a compiled training step's time (65.6 ms) against its
    profile's busy time (62.6) read as 3 ms of idle GPU; measured within the step, the device idled 0.65 ms
    (docs/compile_h200.md, 2026-12-04 19:32 UTC)."""
    from occult_hf.benchmarks.ep import busy_time, idle_gaps

    # two overlapping kernels (10-30, 20-40), one inside them (25-28), a gap, one kernel (50-60), a gap, a last one
    intervals = [(50.0, 60.0), (10.0, 30.0), (20.0, 40.0), (25.0, 28.0), (70.0, 71.0)]
    assert busy_time(intervals) == (41.0, 61.0, 2)
    assert idle_gaps(intervals) == [(40.0, 50.0, 2, 0), (60.0, 70.0, 0, 4)]  # each gap with the kernels around it
    assert busy_time([(0.0, 5.0), (5.0, 7.0)]) == (7.0, 7.0, 0)  # back to back: no gap
    assert busy_time([]) == (0.0, 0.0, 0)


def test_bench_ep_on_one_rank_runs_the_local_dispatcher(tmp_path, capsys):
    """One rank (one GPU's share of the layer, no exchange): the cases run on "local", the one dispatcher that
    serves it (every default dispatcher was skipped, and the run ended in matplotlib's "Number of rows must be a
    positive integer"); asking only for dispatchers that cannot serve it is refused before any model is built."""
    from occult_hf.cli import main

    common = ["bench", "ep", "--cpu", "--no-progress", "--shapes", "olmoe-1b-7b", "--tokens", "32", "--hidden", "32",
              "--intermediate", "16", "--iterations", "1", "--out", str(tmp_path), "--modes", "per_expert+contiguous", "dedup+contiguous"]  # fmt: skip
    assert main(common) == 0
    rows = json.loads((tmp_path / "bench_ep_1xcpu.json").read_text())["rows"]
    assert {(r["dispatcher"], r["mode"]) for r in rows} == {("local", "per_expert+contiguous"), ("local", "dedup+contiguous")}
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*common, "--dispatchers", "all_to_all", "padded"])
    assert "no dispatcher of --dispatchers all_to_all padded serves 1 rank(s)" in capsys.readouterr().err


def test_bench_ep_on_one_rank_runs_pruning_on_local_and_says_which_modes_have_no_row(tmp_path, capsys):
    """A pruned mode ran only on "all_to_all", so on one rank ("local") `--modes dedup+refined+Nd=1` left no row and
    no word; a mode that prunes to more devices than there are ranks is named before the run."""
    from occult_hf.cli import main

    argv = ["bench", "ep", "--cpu", "--no-progress", "--shapes", "olmoe-1b-7b", "--tokens", "32", "--hidden", "32",
            "--intermediate", "16", "--iterations", "1", "--out", str(tmp_path),
            "--modes", "dedup+refined+Nd=1", "dedup+refined+Nd=2"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((tmp_path / "bench_ep_1xcpu.json").read_text())["rows"]
    assert {(r["dispatcher"], r["mode"]) for r in rows} == {("local", "dedup+refined+Nd=1")}
    assert "--modes dedup+refined+Nd=2: prunes to 2 devices per token, more than the 1 rank(s): no row" in capsys.readouterr().out


def test_bench_ep_refuses_modes_that_leave_no_case_before_building_a_model(tmp_path, capsys):
    from occult_hf.cli import main

    argv = ["bench", "ep", "--cpu", "--no-progress", "--shapes", "olmoe-1b-7b", "--tokens", "32", "--hidden", "32",
            "--intermediate", "16", "--iterations", "1", "--out", str(tmp_path), "--modes", "dedup+refined+Nd=2"]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    assert "no requested mode runs on 1 rank(s): dedup+refined+Nd=2: prunes to 2 devices" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_pruned_modes_run_on_the_first_dispatcher_that_is_not_static():
    """`--dispatchers padded hierarchical` gave no pruned rows (they went to "padded", which runs only dedup+refined)
    where `hierarchical padded` gave them."""
    from argparse import Namespace

    from occult_hf.benchmarks.ep import cases, modes_without_cases

    modes = ["dedup+refined", "dedup+refined+Nd=1"]
    for order in (["padded", "hierarchical"], ["hierarchical", "padded"]):
        chosen = {(name, mode.name) for name, mode in cases(Namespace(dispatchers=order, modes=modes), world=2)}
        assert chosen == {("padded", "dedup+refined"), ("hierarchical", "dedup+refined"),
                          ("hierarchical", "dedup+refined+Nd=1")}
    only_static = Namespace(dispatchers=["padded"], modes=modes)
    assert modes_without_cases(only_static, 2) == ["dedup+refined+Nd=1: --dispatchers padded run only dedup+refined"]
