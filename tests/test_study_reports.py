"""The quality study's tooling on inputs a QA pass found it mishandling: tables, missing or partial results, a work
directory reused with other settings, the placement study at other device counts, duplicate distractors."""

from __future__ import annotations

import json
import random
import sys

import pytest

from occult_hf.eval.studies.variants import Variant


def _row(name: str, ppl_b: float) -> dict:
    v = Variant.parse(name)
    return {"variant": name, "fine_tuned": v.fine_tuned, "seed": v.seed, "mode": v.mode, "devices": v.devices,
            "max_devices_per_token": v.max_devices_per_token, "removed_weight": 0.1 if v.pruned else 0.0,
            "perplexity": {"python_stdlib_code": ppl_b, "python_docs": 50.0, "kernel_docs": 80.0},
            "communication": {"4": {"ct": 2.0, "remote_copies": 1.5, "bytes_per_token": 100.0}},
            "accuracy": {"occ_nextline_code": {"acc": 0.5, "acc_stderr": 0.02, "acc_norm": 0.5, "acc_norm_stderr": 0.02}}}  # fmt: skip


def test_markdown_table_refuses_rows_of_another_width():
    from occult_hf.utils.tables import markdown_table

    with pytest.raises(ValueError, match=r"markdown_table: rows \[0\] have 3 cells, not one per each of the 2 columns"):
        markdown_table(["a", "b"], [["x", "y", ""], ["1", "2"]], align="lr")  # tabulate shifted every header over


def test_a_quality_table_whose_plain_row_has_no_result_keeps_each_header_over_its_column():
    """Every `plain` seed failed: the first row had one blank cell too many, so every header sat one column left of
    its values ("seeds" over a perplexity, "CT" over the bytes)."""
    from occult_hf.eval.studies.report_quality import Study, quality_table

    results = {"settings": {"device_limits": {"4": [1, 2]}, "seeds": [0], "modes": ["router"]},
               "tasks": {"tasks": {"occ_nextline_code": ["nextline", "python_stdlib_code"]}},
               "variants": [{"variant": "plain-s0", "error": "OutOfMemoryError: ..."}, _row("d4-router-2-s0", 51.0)]}  # fmt: skip
    lines = quality_table(Study(results), 4).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    rows = {" ".join((cells := [c.strip() for c in line.split("|")[1:-1]])[:2]): dict(zip(header, cells)) for line in lines[2:]}
    assert header[:4] == ["variant", "fine-tuned", "seeds", "ppl python_stdlib_code (B)"]
    assert rows["plain yes"]["seeds"] == "0" and rows["plain yes"]["ppl python_stdlib_code (B)"] == "failed (OutOfMemoryError)"
    assert rows["router N_d=2 yes"]["seeds"] == "1" and rows["router N_d=2 yes"]["CT"] == "2.000"
    assert rows["router N_d=2 yes"]["bytes/token/layer"] == "100"


def test_report_quality_names_missing_or_unfinished_inputs_in_one_line(tmp_path):
    from occult_hf.eval.studies import report_quality

    with pytest.raises(SystemExit, match=r"quality_results.json does not exist: give the --out directory of the quality command"):
        report_quality.main([str(tmp_path), "--out-dir", str(tmp_path / "report")])
    (tmp_path / "quality_results.json").write_text(json.dumps({"base": {}, "variants": [], "settings": {"device_limits": {"4": [1]}}}))
    with pytest.raises(SystemExit, match=r"the base job has not finished \(cut by the deadline\); run the quality command again"):
        report_quality.main([str(tmp_path), "--out-dir", str(tmp_path / "report")])  # was KeyError: 'recipe'
    shipped = json.loads(json.dumps({"base": {"recipe": {}}, "variants": [], "settings": {"device_limits": {"4": [1]}}}))
    (tmp_path / "quality_results.json").write_text(json.dumps(shipped))
    with pytest.raises(SystemExit, match=r"has no profiles_train.tar.gz, profiles_heldout.tar.gz .*or pass --no-transfer"):
        report_quality.main([str(tmp_path), "--out-dir", str(tmp_path / "report")])  # was a FileNotFoundError traceback


def test_a_work_directory_refuses_a_study_of_another_size(tmp_path):
    """A micro work directory resumed as a cpu study reused its 4-step base model and 3-step variants and reported
    them as the cpu study's."""
    from occult_hf.eval.studies.quality import claim_work_dir

    settings = {"vocab_size": 300, "corpus_files": ["a.txt"]}
    claim_work_dir(tmp_path / "work", "micro", settings)
    claim_work_dir(tmp_path / "work", "micro", settings)  # the same study resumes
    with pytest.raises(SystemExit, match=r"the work directory .*work holds a study made with other settings: size 'micro' \(now 'cpu'\); use a new --work"):
        claim_work_dir(tmp_path / "work", "cpu", settings)
    with pytest.raises(SystemExit, match=r"data_settings .*'vocab_size': 300.* \(now .*'vocab_size': 500"):
        claim_work_dir(tmp_path / "work", "micro", {**settings, "vocab_size": 500})


def test_the_placement_study_figure_has_a_panel_per_series_at_any_device_count(tmp_path):
    """`--num-devices 2` ran the whole study and then failed to save an empty figure; D=4 alone lost its balance panel."""
    from occult_hf.eval.studies.placement_study import PANEL_TITLES, StudyResult, plot

    result = StudyResult()
    for key in ("tiny_ct_D2", "tiny_balance_D2", "tiny_ct_D16"):
        result.series[key] = {"refined": [1.0, 1.2]}
    plot(result, tmp_path / "figure.png")
    assert (tmp_path / "figure.png").stat().st_size > 0
    assert PANEL_TITLES["tiny_balance_D"].format(2) == "learned tiny OLMoE, D=2: held-out load balance (max/mean)"
    plot(StudyResult(), tmp_path / "none.png")  # nothing computed: no figure, no error
    assert not (tmp_path / "none.png").exists()


def test_evalhook_requires_its_data_directory(capsys):
    from occult_hf.eval.studies import evalhook

    with pytest.raises(SystemExit) as exit_:
        evalhook.main(["--model", "m"])
    assert exit_.value.code == 2 and "the following arguments are required: --data" in capsys.readouterr().err


def test_nextline_distractors_are_distinct_texts():
    """A line common to several documents was one pool entry per document, and an item could offer it twice."""
    from occult_hf.eval.studies.lmeval_tasks import nextline_items

    texts = ["\n".join(["def f():", "    x = 1", "    y = 2", "    if x is None:", f"    z{d}_{i} = x + {i}"] * 3) for d in range(30) for i in range(1)]
    items = nextline_items(texts, 40, random.Random(0))
    for item in items:
        wrong = [choice for index, choice in enumerate(item["choices"]) if index != item["label"]]
        assert len(set(wrong)) == 3, item["choices"]


def test_the_study_commands_end_a_bad_input_in_one_line():
    """`python -m occult_hf.eval.studies.*` printed a traceback for a bad setting (`--num-devices 0`, a data directory
    that is not prepared data); now one line and exit status 2, as `occult` does (`OCCULT_DEBUG=1`: the traceback)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "OCCULT_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "occult_hf.eval.studies.placement_study", "--num-devices", "0", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "python -m occult_hf.eval.studies.placement_study: error: num_devices must be a positive integer, got 0 "
        "(OCCULT_DEBUG=1 shows the traceback)"
    ]


def test_run_command_passes_exits_through_and_shows_the_traceback_on_request(monkeypatch, capsys):
    from occult_hf.utils.errors import run_command

    def fails():
        raise FileNotFoundError("'data' is not a prepared data directory")

    assert run_command("study", lambda: 0) == 0 and run_command("study", lambda: None) == 0
    with pytest.raises(SystemExit):
        run_command("study", lambda: sys.exit(3))
    assert run_command("study", fails) == 2
    assert capsys.readouterr().err == "study: error: 'data' is not a prepared data directory (OCCULT_DEBUG=1 shows the traceback)\n"
    monkeypatch.setenv("OCCULT_DEBUG", "1")
    assert run_command("study", fails) == 2 and "Traceback" in capsys.readouterr().err


def test_a_result_of_another_base_model_is_neither_finished_nor_reported(tmp_path):
    """A variant made before the base job ran again (its base/ removed, pre-trained anew) counted as done and was
    reported beside the new base model's variants."""
    from occult_hf.eval.studies import quality

    work = tmp_path / "work"
    for mark in quality.base_parts(work).values():
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text("{}")
    (work / "base" / "fingerprint.txt").write_text("new-base")
    (work / "variants").mkdir()
    for name, made_on in (("plain-s0", "old-base"), ("plain-s1", "new-base"), ("base", None)):
        (work / "variants" / f"{name}.json").write_text(json.dumps({"variant": name, "base_fingerprint": made_on}))
    assert [quality.finished(work, n) for n in ("plain-s0", "plain-s1", "base")] == [False, True, True]
    assert quality.current_result(work, "plain-s0") is None and quality.current_result(work, "plain-s1")["variant"] == "plain-s1"
