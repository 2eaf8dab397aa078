"""`occult eval` and `occult train` given inputs they cannot use: an output path that cannot take the results, a
dtype that is no dtype, a step count or time budget that schedules nothing, a corpus changed since its data was
prepared, and corpus files `datasets` cannot read. Each must end in one line naming the flag or file (exit code 2),
never a success that wrote nothing or trained on stale data.

The evaluations replace lm-eval's `simple_evaluate` with a fake that returns a one-task result at once; lm-eval's
own `EvaluationTracker` writes (or fails to write) the files, as in a real run.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from occult_hf.cli import main
from occult_hf.training import get_recipe


def _exit_message(argv: list[str], capsys) -> str:
    """stderr of an `occult` command that must fail with exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ----- occult eval ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_lm_eval(monkeypatch):
    """`lm_eval.simple_evaluate` replaced by a one-task result named as lm-eval names it (model `tiny`); the
    arguments of each call are recorded. The task index holds occult_hf's own tasks only (lm-eval's take seconds)."""
    pytest.importorskip("lm_eval", reason="occult eval needs the eval extra: pip install 'occult_hf[eval]'")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import occult_hf.eval as occult_eval

    calls = []

    def simple_evaluate(*, evaluation_tracker, **kwargs):
        calls.append(kwargs)
        evaluation_tracker.general_config_tracker.model_name_sanitized = "tiny"
        sample = {"doc_id": 0, "arguments": [["a", " b"]], "resps": [["x"]], "filtered_resps": ["x"], "target": "b",
                  "doc_hash": "d", "prompt_hash": "p", "target_hash": "t"}  # fmt: skip
        return {"results": {"task": {"alias": "task", "acc,none": 0.5}}, "versions": {"task": 1}, "n-shot": {"task": 0},
                "higher_is_better": {"task": {"acc": True}}, "configs": {"task": {}}, "samples": {"task": [sample]}}  # fmt: skip

    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    own_tasks = TaskManager(include_path=str(occult_eval.TASKS_DIR), include_defaults=False)
    monkeypatch.setattr(occult_eval, "make_task_manager", lambda include_path: own_tasks)
    return calls


def _eval(output_path, *extra: str) -> list[str]:
    return ["eval", "--tasks", "occult_offline", "--device", "cpu", "--output_path", str(output_path), *extra]


def test_eval_writes_its_results_and_says_where(fake_lm_eval, tmp_path, capsys):
    out = tmp_path / "runs" / "offline"
    assert main(_eval(out, "--log_samples")) == 0
    (results,) = (out / "tiny").glob("results_*.json")
    assert len(list((out / "tiny").glob("samples_task_*.jsonl"))) == 1
    assert f"wrote {results} and 1 samples file(s)" in capsys.readouterr().out
    assert [name for name in os.listdir(out) if name.startswith(".")] == []  # the write probe left nothing


def test_eval_refuses_an_output_path_it_cannot_write_before_it_starts(fake_lm_eval, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("afile").touch()
    Path("adir.json").mkdir()
    cases = [("afile", "--output_path 'afile' is an existing file; give a folder"),
             ("afile/sub", "--output_path 'afile/sub' lies under the file 'afile'; give a folder"),
             ("afile/res.json", "--output_path 'afile/res.json' lies under the file 'afile'; give a folder"),
             ("adir.json", "--output_path 'adir.json' is a folder, but a path ending in .json names the results file "
                           "(lm-eval writes adir_<time>.json beside it)")]  # fmt: skip
    if os.path.isdir("/proc"):  # a folder nobody can create a file in, even root
        cases.append(("/proc/occult_eval_out", "--output_path '/proc/occult_eval_out': cannot write there"))
    for output_path, message in cases:
        assert message in _exit_message(_eval(output_path), capsys), output_path
    assert fake_lm_eval == []  # refused before the evaluation
    assert Path("afile").read_bytes() == b""


def test_eval_fails_when_lm_eval_could_not_write_the_results(fake_lm_eval, tmp_path, capsys):
    """lm-eval logs a failed save and carries on: the run must not end in "wrote ..." and exit code 0."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "tiny").touch()  # lm-eval's model folder is a file: its save fails after the write probe passed
    err = _exit_message(_eval(out), capsys)
    assert f"lm-eval could not write '{out}/tiny/results_" in err and "the tables above are this run's only results" in err


def test_eval_fails_when_lm_eval_could_not_write_the_samples(fake_lm_eval, tmp_path, capsys, monkeypatch):
    from lm_eval.loggers import EvaluationTracker

    monkeypatch.setattr(EvaluationTracker, "save_results_samples", lambda self, task_name, samples: None)  # as one that failed
    out = tmp_path / "run"
    err = _exit_message(_eval(out, "--log_samples"), capsys)
    assert f"lm-eval could not write '{out}/tiny/samples_task_" in err
    assert len(list((out / "tiny").glob("results_*.json"))) == 1


def test_eval_dtype_must_name_a_torch_dtype(fake_lm_eval, tmp_path, capsys):
    err = _exit_message(_eval(tmp_path / "run", "--dtype", "nn"), capsys)
    assert "argument --dtype: expected 'auto' or a torch dtype name (float32, bfloat16, float16), got 'nn'" in err
    assert fake_lm_eval == []
    for dtype in ("auto", "bfloat16"):
        assert main(_eval(tmp_path / "run", "--dtype", dtype)) == 0
    assert [call["model_args"]["dtype"] for call in fake_lm_eval] == ["auto", "bfloat16"]


def test_eval_takes_the_dtype_from_model_args_when_the_flag_is_not_given(fake_lm_eval, tmp_path):
    """lm-eval's own CLI takes `dtype=` in `--model_args`; only `--dtype` given as well is a clash."""
    assert main(_eval(tmp_path / "run", "--model_args", "dtype=bfloat16")) == 0
    assert fake_lm_eval[-1]["model_args"]["dtype"] == "bfloat16"


def test_eval_takes_batch_size_and_device_from_model_args_or_names_the_clash(fake_lm_eval, tmp_path, capsys):
    """`--model_args batch_size=2` (or `device=cpu`) reached the model beside the flag's default: "got multiple values
    for keyword argument 'batch_size'". Given once it is used; given both ways it is the usual clash."""
    argv = ["eval", "--tasks", "occult_offline", "--output_path", str(tmp_path / "run")]
    assert main([*argv, "--model_args", "batch_size=2,device=cpu"]) == 0
    call = fake_lm_eval[-1]
    assert (call["batch_size"], call["device"]) == (2, "cpu") and not {"batch_size", "device"} & set(call["model_args"])
    for flags, name in ((["--batch_size", "3", "--model_args", "batch_size=2"], "batch_size"),
                        (["--device", "cpu", "--model_args", "device=cpu"], "device")):  # fmt: skip
        assert f"occult eval: ['{name}'] given both as options and in --model_args; give each once" in _exit_message([*argv, *flags], capsys)
    assert "--model_args batch_size: expected a positive integer, 'auto' or 'auto:N'" in _exit_message([*argv, "--model_args", "batch_size=0"], capsys)
    assert len(fake_lm_eval) == 1


def test_eval_batch_size_and_limit_are_checked_at_parse_time(fake_lm_eval, tmp_path, capsys):
    """`autox` ran as `auto`, `auto:0` divided by zero; `--limit 1.5` ran one document without a word and -1, nan and
    inf failed after the model loaded, with errors that did not name the flag."""
    for value in ("autox", "auto:0", "0", "1.5"):
        err = _exit_message(_eval(tmp_path / "run", "--batch_size", value), capsys)
        assert f"argument --batch_size/--batch-size: expected a positive integer, 'auto' or 'auto:N' (N >= 1), got '{value}'" in err
    for value in ("-1", "0", "nan", "inf", "1.5", "x"):
        err = _exit_message(_eval(tmp_path / "run", "--limit", value), capsys)
        assert f"argument --limit: expected a positive integer or a fraction in (0, 1), got '{value}'" in err
    assert fake_lm_eval == []
    for value, limit in (("auto:2", None), ("4", "0.5"), ("auto", "3")):
        assert main(_eval(tmp_path / "run", "--batch_size", value, *(["--limit", limit] if limit else []))) == 0
    assert [(call["batch_size"], call["limit"]) for call in fake_lm_eval] == [("auto:2", None), (4, 0.5), ("auto", 3)]


def test_eval_names_limit_when_lm_eval_finds_no_document(fake_lm_eval, tmp_path, capsys, monkeypatch):
    """A fractional --limit that leaves a rank no document is known only once lm-eval counted the documents; its error
    then said only "task.build_requests() did not find any docs!"."""
    import lm_eval

    def no_documents(**kwargs):
        raise ValueError("task.build_requests() did not find any docs!")

    monkeypatch.setattr(lm_eval, "simple_evaluate", no_documents)
    err = _exit_message(_eval(tmp_path / "run", "--limit", "0.01"), capsys)
    assert "occult eval: --limit 0.01 leaves rank 0 without a document of a task; give a larger --limit" in err


def test_eval_checks_the_task_names_and_model_before_the_model_loads(fake_lm_eval, tmp_path, capsys):
    """lm-eval resolves the task list after it loaded the model (minutes for a real checkpoint, on every rank)."""
    err = _exit_message(_eval(tmp_path / "run", "--tasks", "occult_offline,occult_ofline"), capsys)
    assert "--tasks ['occult_ofline']: no such lm-eval task, group or tag (did you mean 'occult_offline'?)" in err
    missing = tmp_path / "no_model"
    err = _exit_message(["eval", str(missing), "--tasks", "occult_offline", "--output_path", str(tmp_path / "run")], capsys)
    assert f"MODEL '{missing}': model directory does not exist" in err
    assert fake_lm_eval == []


def test_eval_flags_take_both_spellings():
    """`--output-path` was refused while `--batch-size` was taken, and `--num_devices` taken while
    `--max_devices_per_token` and `--occult_config` were refused."""
    from occult_hf.cli import build_parser

    (subcommands,) = [action for action in build_parser()._actions if action.choices and "eval" in action.choices]
    eval_parser = subcommands.choices["eval"]
    spellings = {flag for action in eval_parser._actions for flag in action.option_strings}
    one_way = [flag for flag in spellings if "_" in flag or "-" in flag[2:]
               if {flag.replace("_", "-"), "--" + flag[2:].replace("-", "_")} - spellings]  # fmt: skip
    assert one_way == ["--no-progress"]  # every occult command's own flag (occult_hf.cli), spelt one way everywhere
    args = eval_parser.parse_args(["--output-path", "o", "--max_devices_per_token", "1", "--occult_config", "c.json"])
    assert (args.output_path, args.max_devices_per_token, args.occult_config) == ("o", 1, "c.json")


def test_eval_refuses_options_that_would_be_ignored(fake_lm_eval, tmp_path, capsys):
    """`--compare`/`--headline` ignored `--tasks`, `--limit` and every run option, and a run ignored `--labels`."""
    results = tmp_path / "results_x.json"
    results.write_text('{"results": {"task": {"acc,none": 0.5}}}')
    for extra, named in ((["--limit", "2"], "--limit"), (["--num-devices", "2", "--tasks", "x"], "--tasks, --num-devices"),
                         (["--batch-size", "4"], "--batch_size"), (["--output-path", "o"], "--output_path")):  # fmt: skip
        err = _exit_message(["eval", "--compare", str(results), str(results), *extra], capsys)
        assert f"--compare and --headline read finished runs and take no evaluation options, got {named}\n" in err
    assert "--headline read finished runs and take no evaluation options, got --log_samples" in _exit_message(
        ["eval", "--headline", str(results), "--log_samples"], capsys)
    for argv in (["eval", "--headline", str(results), "--labels", "a", "b"], _eval(tmp_path / "run", "--labels", "a", "b")):
        assert "occult eval: --labels names the two columns of --compare" in _exit_message(argv, capsys)
    glob_matched_three = ["eval", "--compare", str(results), str(results), str(results)]
    assert "--compare takes two runs, A and B, and" in _exit_message(glob_matched_three, capsys)
    assert fake_lm_eval == []


def test_eval_no_progress_hides_lm_evals_request_and_bootstrap_bars(fake_lm_eval, tmp_path, capsys, monkeypatch):
    """lm-eval's `Task.build_requests` draws a bar per task (`tqdm` in lm_eval.api.task) and its bootstrap a bar per
    metric (`tqdm.tqdm`, imported when it runs), neither with a switch of its own, which `--no-progress` did not hide;
    the bars come back after the command."""
    import lm_eval
    import lm_eval.api.task as task_module

    record = fake_lm_eval.append

    def evaluate(**kwargs):
        record(kwargs)
        for _ in task_module.tqdm(range(3)):  # as Task.build_requests draws them
            pass
        from tqdm import tqdm

        for _ in tqdm(range(5)):  # as api.metrics.bootstrap_stderr draws them
            pass
        return None  # as on a rank other than 0: nothing to write

    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluate)
    assert main(_eval(tmp_path / "run", "--no-progress")) == 0
    err = capsys.readouterr().err
    assert "3/3" not in err and "5/5" not in err
    assert main(_eval(tmp_path / "run")) == 0
    err = capsys.readouterr().err
    assert "3/3" in err and "5/5" in err


# ----- occult train --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value", [("--max-steps", "0"), ("--max-steps", "-3"), ("--time-budget", "0"), ("--time-budget", "-1"),
                    ("--time-budget", "inf"), ("--time-budget", "nan")],  # fmt: skip
)
def test_train_steps_and_time_budget_must_schedule_something(flag, value, tmp_path, capsys):
    err = _exit_message(["train", "--out", str(tmp_path / "t"), flag, value], capsys)
    assert f"argument {flag}: expected " in err


def test_train_names_an_out_or_corpus_dir_that_is_a_file(tmp_path, capsys):
    """`--out FILE` was "[Errno 20] Not a directory: 'FILE/data'"; `--corpus-dir FILE` said the directory "does not
    exist"."""
    file = tmp_path / "afile"
    file.write_text("")
    err = _exit_message(["train", "--corpus-dir", str(tmp_path), "--out", str(file)], capsys)
    assert f"--out {str(file)!r} is an existing file; give a directory" in err, err
    err = _exit_message(["train", "--corpus-dir", str(file), "--out", str(tmp_path / "o")], capsys)
    assert f"corpus directory {str(file)!r} is a file; give the directory that holds the corpus files" in err, err


@pytest.mark.parametrize("flag", ["--num_fewshot", "--bootstrap_iters"])
def test_eval_counts_below_zero_are_refused_at_parse_time(flag, tmp_path, capsys):
    """`--num_fewshot -1` ran and recorded "n-shot -1"; `--bootstrap_iters -5` ran."""
    err = _exit_message(_eval(tmp_path / "run", flag, "-1"), capsys)
    assert "expected an integer >= 0, got -1" in err, err


def test_recipe_steps_and_time_budget_must_schedule_something():
    for changes, message in [({"max_steps": 0}, "max_steps must be an integer >= 1, got 0"),
                             ({"max_steps": 2.5}, "max_steps must be an integer >= 1, got 2.5"),
                             ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
                             ({"seq_len": -8}, "seq_len must be an integer >= 1, got -8"),
                             ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1"),
                             ({"seed": True}, "seed must be an integer >= 0, got True"),
                             ({"top_k": "4"}, "top_k must be an integer >= 1, got '4'"),
                             ({"time_budget_s": -1.0}, "time_budget_s (-1.0) must be None or a finite number of seconds > 0"),
                             ({"time_budget_s": float("inf")}, "time_budget_s (inf) must be"),
                             ({"time_budget_s": float("nan")}, "time_budget_s (nan) must be"),
                             ({"time_budget_s": 0}, "time_budget_s (0) must be"),
                             # a recipe file's string: a bare TypeError from the comparison; split into letters
                             ({"heldout_fraction": "0.1"}, "heldout_fraction (0.1) must be in (0, 1)"),
                             ({"train_domains": "kernel_docs"}, "train_domains 'kernel_docs' must be None or a list")]:  # fmt: skip
        with pytest.raises(ValueError, match=r"Recipe tiny: " + message.replace("(", r"\(").replace(")", r"\)")):
            get_recipe("tiny", **changes)
    assert get_recipe("tiny", max_steps=1, time_budget_s=0.5).time_budget_s == 0.5


def _two_domain_corpus(directory: Path) -> Path:
    directory.mkdir()
    for domain in ("alpha", "gamma"):
        docs = [f"{domain} document {d}\nwith a second line about {domain} things" for d in range(6)]
        (directory / f"{domain}.txt").write_text("\n\n".join(docs) + "\n")
    return directory


def test_train_refuses_prepared_data_whose_corpus_changed(tmp_path, capsys):
    pytest.importorskip("datasets", reason="preparing training data needs the eval extra")
    corpus, out = _two_domain_corpus(tmp_path / "corp"), tmp_path / "trn1"
    argv = ["train", "--corpus-dir", str(corpus), "--out", str(out), "--prepare-only"]
    assert main(argv) == 0
    assert main(argv) == 0  # the same corpus: reused, and said so
    assert f"occult train: reusing the data prepared in {out / 'data'} (its corpus files and settings unchanged)" in capsys.readouterr().out
    (corpus / "beta.txt").write_text("beta one\n\nbeta two\n")
    alpha = corpus / "alpha.txt"
    stat = alpha.stat()
    alpha.write_text(alpha.read_text().replace("alpha document 0", "alpha document X"))  # same size: its time tells
    os.utime(alpha, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    (corpus / "gamma.txt").unlink()
    err = _exit_message(argv, capsys)
    assert (f"'{out / 'data'}' was prepared with other settings: corpus files changed since it was prepared: added ['beta.txt'], "
            f"removed ['gamma.txt'], modified (size or modification time) ['alpha.txt']. Remove it to prepare it again, or give "
            f"another --data-dir (or --out)") in err  # fmt: skip


@pytest.mark.parametrize(
    "name, content, cause",
    [
        ("a.txt.gz", b"garbage", "BadGzipFile: Not a gzipped file"),
        ("a.txt.gz", gzip.compress(b"one\n\ntwo\n" * 200)[:40], "EOFError: Compressed file ended before the end-of-stream marker"),
        ("a.jsonl.gz", b"garbage", "BadGzipFile: Not a gzipped file"),
        ("a.jsonl", b"", "is empty"),
        ("a.jsonl.gz", gzip.compress(b""), "is empty"),
        ("a.txt", b"", "is empty"),
        ("a.txt", "caf\xe9\n\nau lait\n".encode("latin-1"), "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"),
        ("a.jsonl", b'{"text": "caf\xe9"}\n{"text": "x"}\n', "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"),
        ("a.jsonl", b'{"text": "a"\n', "ArrowInvalid: JSON parse error"),
    ],
    ids=["not-gzip", "gzip-cut-short", "jsonl-not-gzip", "empty-jsonl", "empty-once-decompressed", "empty-txt", "txt-not-utf8",
         "jsonl-not-utf8", "not-json"],  # fmt: skip
)
def test_a_corpus_file_that_cannot_be_read_is_named(name, content, cause, tmp_path, capsys):
    pytest.importorskip("datasets", reason="preparing training data needs the eval extra")
    corpus = tmp_path / "corp"
    corpus.mkdir()
    (corpus / name).write_bytes(content)
    (corpus / "b.txt").write_text("one\n\ntwo\n\nthree\n")
    err = _exit_message(["train", "--corpus-dir", str(corpus), "--out", str(tmp_path / "t"), "--prepare-only", "--no-progress"], capsys)
    assert f"corpus file '{corpus / name}' " in err and cause in err, err
    assert len(err.strip().splitlines()) == 1, err
