"""What `occult eval` leaves on disk: a run whose results lm-eval wrote only in part (a full disk) must fail instead of
reporting a file that would pass for the run's record; a run stopped inside a task leaves no results file; the file
records the Occult setup that ran (a pruned checkpoint evaluated with `--occult-config`) and `--limit`, with the
numbers of lm-eval's own `simple_evaluate` on that model.

The runs use the shipped tiny OLMoE and `occult_offline_ppl` (8 documents, no download), offline.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="occult eval needs the eval extra: pip install 'occult_hf[eval]'")

import lm_eval  # noqa: E402
import lm_eval.api.task as lm_eval_task  # noqa: E402
import lm_eval.evaluator  # noqa: E402
import lm_eval.loggers.evaluation_tracker as lm_eval_tracker  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import occult_hf.eval as occult_eval  # noqa: E402
from occult_hf import OccultConfig, apply_occult  # noqa: E402
from occult_hf.cli import main  # noqa: E402
from occult_hf.training import tiny_checkpoint_path  # noqa: E402

TASK = "occult_offline_ppl"
EVAL_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: the checkpoint's own pruning, and the setup `--occult-config` asks for instead
SAVED = OccultConfig(num_devices=2, prune="router", max_devices_per_token=1)
OVERRIDE = OccultConfig(num_devices=4, prune="router", max_devices_per_token=2)


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No download, lm-eval's own task index left out (the package's tasks only), no `pip list` per run."""
    import datasets.config
    import huggingface_hub.constants

    for name, value in {**EVAL_ENV, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    own_tasks = TaskManager(include_path=str(occult_eval.TASKS_DIR), include_defaults=False)
    monkeypatch.setattr(occult_eval, "make_task_manager", lambda include_path: own_tasks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a shared machine
    yield own_tasks
    torch.set_num_threads(threads)


def _eval(output_path: Path, *extra: str, model: Path | None = None) -> list[str]:
    """`occult eval` of `model` (default: the shipped tiny OLMoE) on 3 of `TASK`'s documents."""
    return ["eval", *([str(model)] if model else []), "--tasks", TASK, "--device", "cpu", "--dtype", "float32",
            "--bootstrap_iters", "0", "--limit", "3", "--output_path", str(output_path), "--no-progress", *extra]


def _exit_message(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return f"{stopped.value.code}\n{capsys.readouterr().err}"


def test_results_cut_short_by_a_full_disk_fail_the_run(tmp_path, capsys, monkeypatch):
    """lm-eval writes the results in one `write_text` and logs its failure; a full disk leaves half a file, which
    passed for the run's record ("wrote ...", exit code 0)."""
    write_text = Path.write_text

    def disk_full(self, data, *args, **kwargs):
        if not self.name.startswith("results_"):
            return write_text(self, data, *args, **kwargs)
        write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    out = tmp_path / "run"
    err = _exit_message(_eval(out), capsys)
    (cut,) = out.rglob("results_*.json")
    assert f"lm-eval could not write '{cut}' whole (cut short: not valid JSON" in err
    assert "the tables above are this run's only results" in err


def test_samples_cut_short_fail_the_run(tmp_path, capsys, monkeypatch):
    """lm-eval appends one line per document and logs a failure part-way: 1 of 3 lines written passed as written."""
    sanitize_list, calls = lm_eval_tracker.sanitize_list, []

    def fails_on_the_second_document(value):
        calls.append(value)
        if len(calls) > 2:  # two calls per document
            raise OSError(errno.ENOSPC, "No space left on device")
        return sanitize_list(value)

    monkeypatch.setattr(lm_eval_tracker, "sanitize_list", fails_on_the_second_document)
    out = tmp_path / "run"
    err = _exit_message(_eval(out, "--log_samples"), capsys)
    (cut,) = out.rglob(f"samples_{TASK}_*.jsonl")
    assert f"lm-eval could not write '{cut}' whole (cut short: 1 of the 3 samples" in err


def test_a_run_stopped_inside_a_task_leaves_no_results(tmp_path, capsys, monkeypatch):
    def stopped(self, doc, results):
        raise RuntimeError("stopped inside a task")

    monkeypatch.setattr(lm_eval_task.ConfigurableTask, "process_results", stopped)
    out = tmp_path / "run"
    err = _exit_message(_eval(out, "--log_samples"), capsys)
    assert "stopped inside a task" in err
    assert list(out.rglob("*.json*")) == []


@pytest.fixture
def pruned_checkpoint(tmp_path) -> Path:
    """The shipped tiny OLMoE saved with `SAVED`'s pruning, with its tokenizer."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_checkpoint_path()
    model = AutoModelForCausalLM.from_pretrained(tiny, occult_config=None, dtype=torch.float32)
    apply_occult(model, SAVED).save_pretrained(tmp_path / "pruned")
    for name in tiny.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(name, tmp_path / "pruned" / name.name)
    return tmp_path / "pruned"


def _results(output_path: Path) -> dict:
    (written,) = output_path.rglob("results_*.json")
    return json.loads(written.read_text())


def test_results_record_the_override_that_ran_and_equal_lm_evals_own(pruned_checkpoint, tmp_path, offline):
    """A pruned checkpoint evaluated with `--occult-config`: the file names the override's N_d and devices (not the
    checkpoint's) and `--limit`, and its numbers are `simple_evaluate`'s on the `occult-hf` model of that setup,
    which differ from the checkpoint's own pruning (so the comparison can fail)."""
    from occult_hf.eval.model import OccultHFLM

    override = tmp_path / "override.json"
    override.write_text(json.dumps(OVERRIDE.to_dict()))
    assert main(_eval(tmp_path / "override", "--occult-config", str(override), model=pruned_checkpoint)) == 0
    assert main(_eval(tmp_path / "saved", model=pruned_checkpoint)) == 0
    ran, saved = _results(tmp_path / "override"), _results(tmp_path / "saved")
    recorded = ran["config"]["occult_config"]
    assert (recorded["num_devices"], recorded["prune"], recorded["max_devices_per_token"]) == (4, "router", 2)
    assert saved["config"]["occult_config"]["max_devices_per_token"] == 1
    assert ran["config"]["limit"] == 3 and ran["n-samples"][TASK] == {"original": 8, "effective": 3}
    model = OccultHFLM(pretrained=str(pruned_checkpoint), occult_config=str(override), device="cpu", dtype="float32")
    own = lm_eval.simple_evaluate(model=model, tasks=[TASK], limit=3, bootstrap_iters=0, task_manager=offline)
    assert ran["results"][TASK] == json.loads(json.dumps(own["results"][TASK]))
    assert saved["results"][TASK]["word_perplexity,none"] != ran["results"][TASK]["word_perplexity,none"]
