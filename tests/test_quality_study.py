"""The quality study's machinery on CPU: the worker supervisor (stall, failure, deadline) and the
study's stages in-process on a generated corpus with the `micro` sizes.

The supervisor is what keeps the GPU run from hanging silently (the H200 run of 2026-11-30 waited on
silent workers until the device call's limit): a worker whose log stops growing must be killed and
named with its last log line, and the deadline must cut every worker so the results come back.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from occult_hf.eval.studies.jobs import Job, run_jobs

sys.path.insert(0, str(Path(__file__).parent))
from test_training import write_corpus  # noqa: E402  (the generated three-domain corpus)


def _job(tmp_path: Path, name: str, code: str, **kwargs) -> Job:
    return Job(name, ["-c", code], tmp_path / f"log_{name}.txt", **kwargs)


def test_run_jobs_kills_a_stalled_worker_and_names_its_phase(tmp_path):
    jobs = [
        _job(tmp_path, "ok", "print('fine')"),
        _job(tmp_path, "boom", "import sys; print('phase: loading'); sys.exit(3)"),
        _job(tmp_path, "silent", "import time; print('phase: first training step', flush=True); time.sleep(120)"),
    ]
    start = time.time()
    outcomes = run_jobs(jobs, [None, None, None], deadline=time.time() + 60, stall_s=2.0, poll_s=0.2)
    assert time.time() - start < 30  # the stalled one was killed, not waited for
    by_name = {o.name: o for o in outcomes}
    assert [o.name for o in outcomes] == ["ok", "boom", "silent"]
    assert by_name["ok"].ok and by_name["ok"].status == "done"
    assert by_name["boom"].status == "failed" and by_name["boom"].returncode == 3
    assert "phase: loading" in by_name["boom"].describe()
    stalled = by_name["silent"]
    assert stalled.status == "stalled" and not stalled.ok
    assert "stalled" in stalled.describe() and "first training step" in stalled.describe()


def test_run_jobs_cuts_at_the_deadline_and_does_not_start_what_cannot_finish(tmp_path):
    busy = "import time\nfor i in range(1000):\n    print('step', i, flush=True); time.sleep(0.2)"
    jobs = [_job(tmp_path, "long", busy), _job(tmp_path, "queued", "print(1)", min_time_s=100.0)]
    start = time.time()
    outcomes = run_jobs(jobs, [None], deadline=time.time() + 2.0, stall_s=30.0, poll_s=0.2)
    assert time.time() - start < 20
    assert [o.status for o in outcomes] == ["cut", "not_started"]
    assert "step" in outcomes[0].last_line and "deadline" in outcomes[0].describe()


def test_run_jobs_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="slots"):
        run_jobs([], [], deadline=time.time(), stall_s=1.0)
    with pytest.raises(ValueError, match="stall_s"):
        run_jobs([], [None], deadline=time.time(), stall_s=0.0)


def test_quality_stages_in_process_micro(tmp_path):
    """pretrain -> base -> one pruned fine-tune and one no-fine-tune variant (the worker's own entry)."""
    from occult_hf.eval.studies import quality
    from occult_hf.training import prepare_data

    torch.set_num_threads(1)
    data = prepare_data(write_corpus(tmp_path / "corpus"), tmp_path / "data", vocab_size=300, heldout_fraction=0.25,
                        cache_dir=tmp_path / "hf_cache")  # fmt: skip
    work = tmp_path / "work"
    quality.pretrain(data, work, True)
    quality.base(data, work, True)
    assert (work / "placement_ft.json").is_file() and len(list((work / "profiles").glob("*.safetensors"))) == 6
    for name in ("router-1", "noft-router-1"):
        quality.worker(name, data, work, True, work / "variants" / f"{name}.json")
    tuned = json.loads((work / "variants" / "router-1.json").read_text())
    noft = json.loads((work / "variants" / "noft-router-1.json").read_text())
    assert "error" not in tuned and "error" not in noft
    for result in (tuned, noft):
        assert result["ct"] == pytest.approx(1.0)  # N_d = 1: every token on one device
        assert 0.0 < result["removed_weight"] < 1.0 and result["bytes_per_token"] > 0
        assert set(result["perplexity"]) == {"python_docs", "python_stdlib_code", "kernel_docs"}
    assert tuned["train"]["steps"] == quality.settings(True)["ft_steps"] and "drift" in tuned
    assert not noft["fine_tuned"] and "train" not in noft
    # a variant that fails reports its error in its result file instead of losing it
    quality.worker("router-7", data, work, True, work / "variants" / "bad.json")
    assert "error" in json.loads((work / "variants" / "bad.json").read_text())


def test_report_compares_fine_tunes_with_plain_and_no_fine_tune_with_the_base():
    from occult_hf.eval.studies.report_quality import quality_table

    def row(name, ppl_b, fine_tuned, n_d):
        mode = None if name == "plain" else name.split("-")[-2]
        return {"variant": name, "mode": mode, "max_devices_per_token": n_d, "fine_tuned": fine_tuned, "ct": 2.0,
                "remote_copies": 1.5, "bytes_per_token": 100.0, "removed_weight": 0.1,
                "perplexity": {"python_stdlib_code": ppl_b, "python_docs": 50.0, "kernel_docs": 80.0}}  # fmt: skip

    results = {
        "base": {"heldout_perplexity": {"python_stdlib_code": 100.0}},
        "variants": [row("plain", 50.0, True, None), row("router-2", 50.4, True, 2), row("router-1", 52.0, True, 1),
                     row("noft-router-2", 102.0, False, 2), {"variant": "similarity-2", "error": "stalled"}],
    }  # fmt: skip
    table, goals = quality_table(results)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]}
    assert cells["router-2"][4] == "1.0080" and cells["noft-router-2"][4] == "1.0200"  # vs plain / vs base
    assert "stalled" in cells["similarity-2"][3]  # a worker that did not deliver is a row that says so
    assert goals["router N_d=2 fine-tuned within 1% of plain fine-tuning"] == (pytest.approx(1.008), True)
    assert goals["router N_d=1 fine-tuned within 1% of plain fine-tuning"][1] is False
