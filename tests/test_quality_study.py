"""The quality study on CPU: the worker supervisor (stall, failure, deadline), the variant grid, the
multiple-choice task builders, the whole pipeline at the `micro` size on generated text (base job,
supervised workers, lm-eval through occult-hf, resuming, the report) and the report's arithmetic.

The supervisor is what keeps the GPU run from hanging silently (the H200 run of 2026-11-30 waited on
silent workers until the device call's limit): a worker whose log stops growing must be killed and
named with its last log line, and the deadline must cut every worker so the results come back.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import time
from pathlib import Path

import pytest

from occult_hf.eval.studies.jobs import Job, run_jobs
from occult_hf.eval.studies.variants import Variant, study_variants
from occult_hf.training.data import RECORD_SEPARATOR

#: one pytest worker runs this module, so the micro pipeline (`micro_run`, about a minute) runs once
pytestmark = pytest.mark.xdist_group("quality_study")

NAMES = "value total items offset buffer count index result parser stream handle config".split()
PROSE = {
    "python_docs": "the function returns a list of values when called with an argument see also module class".split(),
    "kernel_docs": "the driver registers a device interrupt memory page kernel module bus clock power".split(),
}


def write_corpus(directory: Path, docs: int = 24, seed: int = 0) -> Path:
    """Three domains like ../shared/data/corpus: two of prose, one of Python-like code (identifiers for the cloze)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for domain in ("python_docs", "python_stdlib_code", "kernel_docs"):
        documents = []
        for d in range(docs):
            if domain == "python_stdlib_code":
                lines = [f"def compute_{d}({rng.choice(NAMES)}, {rng.choice(NAMES)}):"]
                for _ in range(rng.randint(8, 14)):
                    a, b, c = rng.sample(NAMES, 3)
                    lines.append(rng.choice([f"    {a} = {b} + {c}", f"    if {a} > {b}:", f"        return {c}({a})", f"    {a}.append({b}, {c})"]))
            else:
                lines = [f"{domain} document {d}"] + [" ".join(rng.choice(PROSE[domain]) for _ in range(rng.randint(4, 10)))
                                                      for _ in range(rng.randint(6, 10))]  # fmt: skip
            documents.append("\n".join(lines))
        with gzip.open(directory / f"{domain}.txt.gz", "wt", encoding="utf-8") as f:
            f.write(f"\n{RECORD_SEPARATOR}\n".join(documents) + "\n")
    return directory


# ----- the supervisor ------------------------------------------------------------------------------
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


def test_run_jobs_status_counts_a_job_left_for_lack_of_time_apart_from_finished_ones(tmp_path, capsys):
    busy = "import time\nfor i in range(1000):\n    print('step', i, flush=True); time.sleep(0.2)"
    jobs = [_job(tmp_path, "long", busy), _job(tmp_path, "queued", "print(1)", min_time_s=100.0)]
    run_jobs(jobs, [None, None], deadline=time.time() + 1.5, stall_s=30.0, poll_s=0.2, status_every_s=0.3)
    assert "0 finished, 1 left for lack of time, 0 waiting, running: long" in capsys.readouterr().out


def test_run_jobs_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="slots"):
        run_jobs([], [], deadline=time.time(), stall_s=1.0)
    with pytest.raises(ValueError, match="stall_s"):
        run_jobs([], [None], deadline=time.time(), stall_s=0.0)
    with pytest.raises(ValueError, match=r"\['huge'\] need more GPU memory"):
        run_jobs([_job(tmp_path, "huge", "print(1)", memory_gib=12.0)], ["0"], deadline=time.time() + 10, stall_s=1.0,
                 capacity_gib={"0": 10.0})  # fmt: skip


def test_run_jobs_starts_a_job_only_where_its_gpu_memory_fits(tmp_path):
    """Three free slots on one 10 GiB GPU: two 6 GiB jobs never run together; the 3 GiB job behind the second
    starts in the room the first leaves."""
    spans = tmp_path / "spans"
    spans.mkdir()
    code = "import sys, time; s = time.time(); time.sleep(0.8); open(sys.argv[1], 'w').write(f'{s} {time.time()}')"
    jobs = [_job(tmp_path, name, code, memory_gib=gib) for name, gib in (("a", 6.0), ("b", 6.0), ("c", 3.0))]
    for job in jobs:
        job.argv.append(str(spans / job.name))
    outcomes = run_jobs(jobs, ["0", "0", "0"], deadline=time.time() + 60, stall_s=30.0, poll_s=0.05, capacity_gib={"0": 10.0})
    assert all(o.ok for o in outcomes)
    (a0, a1), (b0, b1), (c0, c1) = (map(float, (spans / n).read_text().split()) for n in "abc")
    assert b0 >= a1  # b did not fit beside a
    assert c0 < a1  # c did, without waiting for b


def test_a_job_needs_as_long_as_the_longest_variant_of_its_kind_took(tmp_path):
    """The time a job needs left to start is learnt from the work directory's results, per kind, above or below the
    size's figure, which serves until a variant of the kind finished; a failed variant's time does not count. The
    estimate is made when the job could start, so a run learns from the variants it finished itself."""
    from occult_hf.eval.studies.quality import JOB_START_S, pack_jobs, variant_need_s

    results = tmp_path / "variants"
    results.mkdir()
    jobs = pack_jobs(["plain-s2", "noft-d4-router-1"], ["-m", "x"], tmp_path, "study")
    assert [j.time_needed() for j in jobs] == [JOB_START_S + 110.0, JOB_START_S + 50.0]  # nothing measured yet
    for name, tuned, wall, error in (("plain-s0", True, 170.0, None), ("plain-s1", True, 150.0, None),
                                     ("noft-d4-router-2", False, 100.0, None), ("d4-router-2-s0", True, 900.0, "oom")):
        (results / f"{name}.json").write_text(json.dumps({"fine_tuned": tuned, "wall_s": wall, **({"error": error} if error else {})}))
    assert variant_need_s(tmp_path, True, 120.0) == 170.0
    assert variant_need_s(tmp_path, False, 40.0) == 100.0
    assert variant_need_s(tmp_path, False, 200.0) == 100.0  # measured shorter than the size's figure: the measurement
    assert variant_need_s(tmp_path / "fresh", True, 120.0) == 120.0  # nothing measured yet: the size's figure
    assert [j.time_needed() for j in jobs] == [JOB_START_S + 170.0, JOB_START_S + 100.0]  # the same jobs, learnt since
    pairs = pack_jobs(["plain-s2", "d4-router-2-s1"], ["-m", "x"], tmp_path, "study")
    assert [j.time_needed() for j in pairs] == [JOB_START_S + 2 * 170.0]


def test_run_jobs_asks_a_job_for_the_time_it_needs_when_it_could_start(tmp_path):
    """A job whose estimate grows while it waits for a slot is left for lack of time; one whose estimate shrinks
    starts."""
    needs = {"grows": 0.0, "shrinks": 100.0}
    first = _job(tmp_path, "first", "import time; time.sleep(0.6); print(1)")
    waiting = [_job(tmp_path, name, "print(1)", min_time_s=lambda n=name: needs[n]) for name in needs]
    needs.update(grows=100.0, shrinks=0.0)  # what the first job's result would teach
    outcomes = run_jobs([first, *waiting], [None], deadline=time.time() + 30, stall_s=30.0, poll_s=0.1)
    assert [o.status for o in outcomes] == ["done", "not_started", "done"]


# ----- the variants ----------------------------------------------------------------------------------
def test_study_grid_is_the_issues_and_names_round_trip():
    from occult_hf.eval.studies import quality

    grid = quality.variants_of("study")
    tuned = [v for v in grid if v.fine_tuned]
    # 3 seeds x (plain + D=4: N_d 1-3 + D=8: N_d 1-4, two modes); base + the 14 pruned base models
    assert len(tuned) == 3 * (1 + 2 * (3 + 4)) and len(grid) - len(tuned) == 1 + 2 * (3 + 4)
    assert len({v.name for v in grid}) == len(grid)
    assert all(Variant.parse(v.name) == v for v in grid)
    # most wanted first: every seed's plain and N_d=2 at both D, then the cheap ones, then the rest
    first = grid[: 3 * 5]
    assert all(v.fine_tuned and (not v.pruned or v.max_devices_per_token == 2) for v in first)
    assert grid[15] == Variant(False) and all(not v.fine_tuned for v in grid[15:30])
    assert Variant.parse("d8-similarity-2-s1").reference == Variant.parse("plain-s1")
    assert Variant.parse("noft-d4-router-3").reference == Variant.parse("base")
    assert Variant.parse("d8-router-4-s2").row == "router N_d=4"
    # the stronger base model: study's architecture, 42.6M tokens, the fine-tuning domain never in pre-training
    recipe = quality.study_recipe("study")
    assert recipe.name == "study_long" and recipe.max_steps * recipe.batch_size * recipe.seq_len == 42_598_400
    assert all(quality.study_recipe(size).time_budget_s is None for size in quality.SIZES)  # steps, not the machine's speed
    assert quality.FT_DOMAIN not in recipe.train_domains and quality.FT_DOMAIN not in quality.study_recipe("micro").train_domains


@pytest.mark.parametrize("name, message", [("router-2", "is not base"), ("d4-router-4-s0", r"N_d \(4\) must be in \[1, D=4\)"),
                                           ("d4-topk-2-s0", "mode 'topk'")])  # fmt: skip
def test_bad_variant_names_say_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        Variant.parse(name)


def test_study_variants_order_for_a_small_grid():
    names = [v.name for v in study_variants({4: (1, 2)}, ("router",), (0, 1))]
    assert names == ["plain-s0", "d4-router-2-s0", "plain-s1", "d4-router-2-s1", "base", "noft-d4-router-2",
                     "noft-d4-router-1", "d4-router-1-s0", "d4-router-1-s1"]  # fmt: skip


# ----- the multiple-choice tasks --------------------------------------------------------------------------
CODE = ["def load(path, mode):\n    handle = open(path, mode)\n    data = handle.read()\n    lines = data.split()\n"
        f"    count = len(lines)\n    result = lines[count - 1]\n    return result, handle, data\n# doc {d}\n" for d in range(6)]  # fmt: skip


def test_nextline_items_hold_the_true_next_line_among_three_lines_of_other_documents():
    from occult_hf.eval.studies.lmeval_tasks import nextline_items

    texts = [f"document {d}\n" + "\n".join(f"line {i} of document {d} with some words" for i in range(12)) for d in range(5)]
    items = nextline_items(texts, 20, random.Random(0))
    assert items == nextline_items(texts, 20, random.Random(0))  # deterministic from the seed
    for item in items:
        answer = item["choices"][item["label"]]
        document = next(t for t in texts if item["context"].rstrip("\n") in t)
        assert item["context"].rstrip("\n") + "\n" + answer in document  # the true next line
        assert len(set(item["choices"])) == 4
        own = re.search(r"of document (\d+)", answer)[1]
        assert all(re.search(r"of document (\d+)", c)[1] != own for c in item["choices"] if c != answer)
    assert {item["label"] for item in items} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="nextline_items: .* 500 items asked for"):
        nextline_items(texts, 500, random.Random(0))


def test_cloze_items_ask_for_an_identifier_of_the_context_among_three_others_of_it():
    from occult_hf.eval.studies.lmeval_tasks import cloze_items

    items = cloze_items(CODE, 12, random.Random(1))
    for item in items:
        answer = item["choices"][item["label"]]
        assert re.fullmatch(r"[A-Za-z_]\w{2,}", answer) and answer not in ("def", "return")
        context_names = set(re.findall(r"\b[A-Za-z_]\w*\b", item["context"]))
        assert set(item["choices"]) <= context_names and len(set(item["choices"])) == 4
        assert any(doc.startswith(item["context"]) and doc[len(item["context"]) :].startswith(answer) for doc in CODE)
    with pytest.raises(ValueError, match="cloze_items: .* 400 items asked for"):
        cloze_items(CODE, 400, random.Random(0))


# ----- the whole pipeline, micro -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    """The quality command at `--size micro` on generated text: base job, 2 seeds, D=4, 8-item tasks."""
    from occult_hf.eval.studies import quality
    from occult_hf.training import prepare_data

    root = tmp_path_factory.mktemp("quality")
    data = prepare_data(write_corpus(root / "corpus"), root / "data", vocab_size=300, heldout_fraction=0.25,
                        separator=RECORD_SEPARATOR, cache_dir=root / "hf_cache")  # fmt: skip
    argv = ["--data", str(data), "--work", str(root / "work"), "--out", str(root / "out"), "--size", "micro", "--budget", "300"]
    start = time.time()
    status = quality.main(argv)
    return root, argv, status, time.time() - start


def test_micro_pipeline_runs_every_variant_through_lm_eval(micro_run):
    root, _, status, _ = micro_run
    out = root / "out"
    assert status == 0
    for name in ("quality_results.json", "loss_curve.png", "profiles_train.tar.gz", "profiles_heldout.tar.gz", "placements.tar.gz",
                 "tasks.tar.gz", "logs.tar.gz"):
        assert (out / name).is_file(), name
    results = json.loads((out / "quality_results.json").read_text())
    assert results["missing"] == [] and results["problems"] == [] and results["base_kernels"] == "deterministic"
    assert set(results["software"]) == {"torch", "transformers", "pyarrow", "datasets", "lm_eval"}
    assert results["tasks"]["items"] == {"occ_nextline_code": 8, "occ_cloze_code": 8, "occ_nextline_docs": 8}
    rows = {v["variant"]: v for v in results["variants"]}
    assert sorted(rows) == sorted(["plain-s0", "plain-s1", "d4-router-2-s0", "d4-router-2-s1", "base", "noft-d4-router-2"])
    for name, row in rows.items():
        variant = Variant.parse(name)
        assert "error" not in row, row
        assert set(row["perplexity"]) == {"python_docs", "python_stdlib_code", "kernel_docs"}
        comm = row["communication"]["4"]
        assert 1.0 <= comm["ct"] <= (2.0 if variant.pruned else 4.0) and comm["bytes_per_token"] > 0
        assert (row["removed_weight"] > 0) == variant.pruned
        for task, acc in row["accuracy"].items():
            assert 0.0 <= acc["acc"] <= 1.0 and acc["acc_stderr"] > 0, (name, task)
        ran = row["lm_eval_occult_config"]  # lm-eval scored the model as the variant runs
        assert (ran["prune"], ran["max_devices_per_token"], ran["num_devices"]) == (variant.mode, variant.max_devices_per_token, 4)
        assert ("train" in row) == variant.fine_tuned and ("drift" in row) == (variant.fine_tuned and not variant.pruned)
    # the seed is the data order: the two plain fine-tunes differ, a pruned one follows its own seed's
    assert rows["plain-s0"]["perplexity"]["python_stdlib_code"] != rows["plain-s1"]["perplexity"]["python_stdlib_code"]
    assert rows["plain-s0"]["train"]["loss_history"][0]["loss"] == pytest.approx(rows["d4-router-2-s0"]["train"]["loss_history"][0]["loss"], rel=0.05)
    assert not list((root / "work" / "checkpoints").iterdir())  # each fine-tune's checkpoint is gone once scored


def test_micro_pipeline_resumes_without_redoing_finished_work(micro_run):
    from occult_hf.eval.studies import quality

    root, argv, _, _ = micro_run
    stamps = {p.name: p.stat().st_mtime_ns for p in (root / "work" / "variants").iterdir()}
    assert quality.main(argv) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (root / "work" / "variants").iterdir()} == stamps
    (root / "work" / "variants" / "d4-router-2-s1.json").unlink()  # a variant the last run did not deliver
    assert quality.main([*argv, "--variants", "d4-router-2-s1,base"]) == 0
    assert (root / "work" / "variants" / "d4-router-2-s1.json").is_file()
    assert (root / "work" / "variants" / "base.json").stat().st_mtime_ns == stamps["base.json"]
    with pytest.raises(ValueError, match=r"variant\(s\) \['d8-router-2-s0'\] are not part of the micro study"):
        quality.main([*argv, "--variants", "d8-router-2-s0"])
    # a worker's variant that raises is a result naming the error (the next run does it again), not a lost job
    quality.worker(["d8-router-2-s0"], root / "data", root / "work", "micro")
    assert "is not part of the micro study" in json.loads((root / "work" / "variants" / "d8-router-2-s0.json").read_text())["error"]
    assert not quality.finished(root / "work", "d8-router-2-s0")


def test_micro_report_writes_the_tables_goals_drift_and_transfer(micro_run):
    from occult_hf.eval.studies import report_quality

    root, _, _, _ = micro_run
    assert report_quality.main([str(root / "out"), "--out-dir", str(root / "report")]) == 0
    text = (root / "report" / "quality_tables.md").read_text()
    for needle in ("### Quality at D=4", "occ_cloze_code acc", "D=4, router N_d=2 + fine-tune within 1% of plain fine-tuning on every seed",
                   "### Drift (plain fine-tunes)", "Goal (CT on an unseen domain within 10% of the oracle)",
                   ": every variant below ran on them"):  # fmt: skip
        assert needle in text, needle
    for name in ("quality_ppl.png", "transfer.json", "transfer.md", "transfer.png"):
        assert (root / "report" / name).is_file()


def test_micro_base_job_repeats_bit_for_bit_and_another_run_takes_the_earlier_variants(micro_run, tmp_path):
    """A second machine's run (a new work directory) trains the very same base model and, given the first run's results,
    takes its variants instead of running them."""
    from occult_hf.eval.studies import quality

    root, _, _, _ = micro_run
    earlier = root / "out" / "quality_results.json"
    first = json.loads(earlier.read_text())
    argv = ["--data", str(root / "data"), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--size", "micro",
            "--budget", "300", "--earlier", str(earlier)]  # fmt: skip
    assert quality.main(argv) == 0
    assert quality.base_fingerprint(tmp_path / "work") == quality.base_fingerprint(root / "work") == first["base_fingerprint"]
    again = json.loads((tmp_path / "out" / "quality_results.json").read_text())
    assert again["missing"] == [] and again["variants"] == first["variants"]
    assert [p.name for p in (tmp_path / "work" / "logs").iterdir()] == ["base.txt"]  # no variant ran


def test_default_kernels_pretrain_a_base_model_of_this_machine_alone(micro_run, tmp_path):
    """--default-kernels: the base job runs without deterministic algorithms and the results say so; with --earlier
    (another machine's variants, which need the repeatable base model) it is an error before any job starts; a base
    job started with one kind of kernels does not go on with the other."""
    from occult_hf.eval.studies import quality

    root, _, _, _ = micro_run
    argv = ["--data", str(root / "data"), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--size", "micro",
            "--budget", "300", "--default-kernels"]  # fmt: skip
    with pytest.raises(ValueError, match="leave out --default-kernels or --earlier"):
        quality.main([*argv, "--earlier", str(root / "out" / "quality_results.json")])
    assert not (tmp_path / "work").exists()
    assert quality.main([*argv, "--variants", "base"]) == 0
    results = json.loads((tmp_path / "out" / "quality_results.json").read_text())
    assert results["base_kernels"] == "default" and [v["variant"] for v in results["variants"]] == ["base"]
    with pytest.raises(ValueError, match="started with default kernels; it cannot go on with deterministic ones"):
        quality.base_job(root / "data", tmp_path / "work", "micro", deterministic=True)


def test_earlier_results_join_only_the_same_study_on_the_same_base_model(tmp_path):
    from occult_hf.eval.studies.quality import adopt, base_parts, read_earlier

    for mark in base_parts(tmp_path / "work").values():  # a finished base job, its fingerprint known
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text("{}")
    (tmp_path / "work" / "base" / "fingerprint.txt").write_text("a" * 64)
    row = {"variant": "plain-s0", "base_fingerprint": "a" * 64}
    path = tmp_path / "quality_results.json"
    for results, message in (({"variants": [row], "settings": {"size": "cpu"}, "base_fingerprint": "a" * 64}, "is a 'cpu' study's results, this is the 'micro' study"),
                             ({"variants": [row], "settings": {"size": "micro"}, "base_fingerprint": None}, "names no base model"),
                             ({"variants": {}, "settings": {"size": "micro"}}, "is not a quality_results.json")):  # fmt: skip
        path.write_text(json.dumps(results))
        with pytest.raises(ValueError, match=re.escape(message)):
            read_earlier(path, "micro")
    path.write_text(json.dumps({"variants": [row, {**row, "variant": "plain-s1", "error": "oom"}], "settings": {"size": "micro"}, "base_fingerprint": "b" * 64}))
    with pytest.raises(ValueError, match=f"was run on another base model \\(fingerprint {'b' * 16}, this work directory's {'a' * 16}\\)"):
        adopt(read_earlier(path, "micro"), path, tmp_path / "work", "micro")
    path.write_text(json.dumps({"variants": [row, {**row, "variant": "plain-s1", "error": "oom"}], "settings": {"size": "micro"}, "base_fingerprint": "a" * 64}))
    assert adopt(read_earlier(path, "micro"), path, tmp_path / "work", "micro") == ["plain-s0"]  # a failed variant runs again
    assert json.loads((tmp_path / "work" / "variants" / "plain-s0.json").read_text()) == row


def test_pipeline_names_a_data_directory_that_is_not_prepared_data(tmp_path):
    from occult_hf.eval.studies import quality

    with pytest.raises(FileNotFoundError, match=re.escape(f"'{tmp_path / 'nope'}' is not a prepared data directory (no data.json)")):
        quality.main(["--data", str(tmp_path / "nope"), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--size", "micro"])
    assert not (tmp_path / "w").exists()


# ----- the report's arithmetic ---------------------------------------------------------------------------
def _row(name: str, ppl_b: float, acc: float = 0.5) -> dict:
    v = Variant.parse(name)
    return {"variant": name, "fine_tuned": v.fine_tuned, "seed": v.seed, "mode": v.mode, "devices": v.devices,
            "max_devices_per_token": v.max_devices_per_token, "removed_weight": 0.1 if v.pruned else 0.0,
            "perplexity": {"python_stdlib_code": ppl_b, "python_docs": 50.0, "kernel_docs": 80.0},
            "communication": {"4": {"ct": 2.0, "remote_copies": 1.5, "bytes_per_token": 100.0}},
            "accuracy": {"occ_nextline_code": {"acc": acc, "acc_stderr": 0.02, "acc_norm": acc, "acc_norm_stderr": 0.02}}}  # fmt: skip


def _results(variants: list[dict]) -> dict:
    return {"settings": {"device_limits": {"4": [1, 2]}, "seeds": [0, 1], "modes": ["router", "similarity"]},
            "tasks": {"tasks": {"occ_nextline_code": ["nextline", "python_stdlib_code"]}}, "variants": variants}  # fmt: skip


def test_report_pairs_each_seed_with_its_own_plain_fine_tune():
    from occult_hf.eval.studies.report_quality import Study, failures, goals, quality_table

    results = _results([_row("plain-s0", 50.0), _row("plain-s1", 60.0), _row("d4-router-2-s0", 50.4), _row("d4-router-2-s1", 60.9),
                        _row("d4-similarity-2-s0", 50.2), _row("d4-similarity-2-s1", 60.3), _row("d4-router-1-s0", 52.0, 0.4),
                        {"variant": "d4-router-1-s1", "error": "stalled"}, _row("base", 100.0), _row("noft-d4-router-2", 102.0)])  # fmt: skip
    study = Study(results)
    table = quality_table(study, 4)
    cells = {(c := [x.strip() for x in line.split("|")[1:-1]])[0] + " " + c[1]: c for line in table.splitlines()[2:]}
    # paired: seed 0 +0.80%, seed 1 +1.50% (unpaired means would give 55.65 / 55.0 = +1.18%)
    assert cells["router N_d=2 yes"][3] == "55.650 (50.400-60.900)" and cells["router N_d=2 yes"][4] == "+1.15% (+0.80..+1.50%)"
    assert cells["router N_d=2 no"][4] == "+2.00%"  # against the base model
    assert cells["router N_d=1 yes"][2] == "1" and cells["router N_d=1 yes"][6] == "0.400 ±0.020"
    assert cells["similarity N_d=1 yes"][2:4] == ["0", "not run"]  # a row with no result says so
    results["variants"].append({"variant": "d4-similarity-1-s0", "error": "OutOfMemoryError: CUDA out of memory. " + "Process 1 has 19 GiB. " * 40})
    failed = quality_table(Study(results), 4).splitlines()
    assert next(line for line in failed if line.startswith("| similarity N_d=1 ") and "| yes " in line).split("|")[4].strip() == (
        "failed (OutOfMemoryError), not run")  # the error's kind in the table; the whole error in the report's list
    assert failures(Study(results)).splitlines()[:2] == ["- d4-router-1-s1: stalled", "- d4-similarity-1-s0: OutOfMemoryError: CUDA out of memory. "
                                                          + ("Process 1 has 19 GiB. " * 40)[:262]]  # fmt: skip
    lines = goals(study)
    assert "- D=4, router N_d=2 + fine-tune within 1% of plain fine-tuning on every seed: **not met** (seed 0 +0.80%, seed 1 +1.50%)." in lines
    assert "- D=4, similarity N_d=2 + fine-tune within 1% of plain fine-tuning on every seed: **met** (seed 0 +0.40%, seed 1 +0.50%)." in lines
    assert any("N_d=2, fine-tuned: similarity against router" in g and "similarity lower on every seed" in g for g in lines)
    assert any(g.startswith("- N_d=1, D=4, router, fine-tuned: +4.00% against plain fine-tuning (not within 1%)") for g in lines)
    # a seed that did not deliver leaves the goal open rather than met
    del study.rows["d4-similarity-2-s1"]
    assert any("similarity N_d=2 + fine-tune within 1% of plain fine-tuning on every seed: not established (1 of 2 seeds measured)" in g
               for g in goals(study))  # fmt: skip
    # ... but one measured seed already outside 1% decides it
    del study.rows["d4-router-2-s0"]
    assert "- D=4, router N_d=2 + fine-tune within 1% of plain fine-tuning on every seed: **not met** (1 of 2 seeds measured) (seed 1 +1.50%)." in goals(study)


def test_micro_base_job_cut_by_the_deadline_resumes_to_the_same_base_model(micro_run, tmp_path):
    """A call whose deadline cuts the base job asks to be run again (status 2); the next run resumes the pre-training
    from its last checkpoint and ends at the very base model of an uninterrupted run."""
    from transformers import TrainerCallback

    from occult_hf.eval.studies import quality
    from occult_hf.training import train

    class CutAtStep3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt("the deadline")

    root, _, _, _ = micro_run
    earlier = root / "out" / "quality_results.json"
    argv = ["--data", str(root / "data"), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--size", "micro",
            "--earlier", str(earlier)]  # fmt: skip
    assert quality.main([*argv, "--budget", "1"]) == 2
    assert not quality.base_done(tmp_path / "work") and (tmp_path / "out" / "quality_results.json").is_file()
    with pytest.raises(KeyboardInterrupt):  # a pre-training cut after its step-2 checkpoint
        train(quality.study_recipe("micro"), root / "data", tmp_path / "work" / "base", progress=False,
              checkpoint_steps=quality.settings("micro")["pretrain_checkpoint_steps"], trainer_callbacks=[CutAtStep3()])  # fmt: skip
    assert quality.main([*argv, "--budget", "300"]) == 0
    assert "resuming from" in (tmp_path / "work" / "logs" / "base.txt").read_text()
    assert quality.base_fingerprint(tmp_path / "work") == json.loads(earlier.read_text())["base_fingerprint"]
