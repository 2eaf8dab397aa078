"""A Trainer checkpoint whose rank file was removed or truncated after a complete save is unusable, said as such.

The complete `occult_checkpoint.json` lists every rank file with its size. Before, a checkpoint whose
`occult_rank0-of-1.pt` was deleted afterwards was blamed on `save_only_model=True`, and a truncated one failed
inside `torch.load` half-way through the resume; `resume_from_checkpoint=True` picked either as the last one.
A rank file of the right size can still be wrong: one copied from another checkpoint resumed silently, one
damaged in place failed inside `torch.load` advising `weights_only=False`. A status file that was damaged
stopped `resume_from_checkpoint=True` altogether, and one holding `[]` counted as complete.
One process (its rank file is `occult_rank0-of-1.pt`), a checkpoint every step, 2 steps.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from occult_logs import occult_records
from tiny_models import tiny_batch, tiny_model

RANK_FILE = "occult_rank0-of-1.pt"


def _trainer(output_dir, steps: int):
    from transformers import Trainer, TrainingArguments

    from occult_hf import OccultConfig, apply_occult

    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=steps, learning_rate=0.01,
        save_strategy="steps", save_steps=1, logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    model = apply_occult(tiny_model("olmoe", seed=11, output_router_logits=False), OccultConfig(num_devices=2))
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=8, seq=16, seed=5)]
    return Trainer(model=model, args=args, train_dataset=data)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step run with checkpoint-1 and checkpoint-2, trained once; each test damages its own copy."""
    output_dir = tmp_path_factory.mktemp("saved_run")
    _trainer(output_dir, steps=2).train()
    return output_dir


def _copy(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "run")
    return tmp_path / "run"


def _resume_from_the_last_complete(run):
    """`train(resume_from_checkpoint=True)` on `run`, checkpoint-1's log marked first so that a resume from it tells
    from a fresh run; returns the skip warnings logged and the trainer."""
    state_file = run / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["log_history"][0]["restored_from"] = "checkpoint-1"
    state_file.write_text(json.dumps(state))
    resumed = _trainer(run, steps=2)
    with occult_records() as records:
        resumed.train(resume_from_checkpoint=True)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "skipping" in r.getMessage()], resumed


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_rank_file_changed_after_the_save_makes_the_checkpoint_unusable(saved_run, tmp_path, damage):
    from occult_hf.hf.trainer import last_complete_checkpoint

    run = _copy(saved_run, tmp_path)
    rank_file = run / "checkpoint-2" / "occult_rank0-of-1.pt"
    size = rank_file.stat().st_size
    if damage == "removed":
        rank_file.unlink()
        said = f"occult_rank0-of-1.pt is gone (the save wrote {size} bytes)"
    else:
        rank_file.write_bytes(rank_file.read_bytes()[: size // 2])
        said = f"occult_rank0-of-1.pt has {size // 2} bytes (the save wrote {size})"

    last, unusable = last_complete_checkpoint(str(run))
    assert last == str(run / "checkpoint-1")
    assert unusable == {str(run / "checkpoint-2"): f"its rank files changed after the save: {said}"}
    with pytest.raises(ValueError, match="the checkpoint cannot be resumed, its rank files changed after the save") as by_path:
        _trainer(run, steps=2).train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert said in str(by_path.value) and "resume from" in str(by_path.value) and "checkpoint-1', the last complete one" in str(by_path.value)

    skipped, resumed = _resume_from_the_last_complete(run)
    assert skipped == [f"occult_hf: skipping {run / 'checkpoint-2'}: its rank files changed after the save: {said}"]
    assert [(log["step"], log.get("restored_from")) for log in resumed.state.log_history if "loss" in log] == [(1, "checkpoint-1"), (2, None)]


def _refused_resume(run, checkpoint: str) -> str:
    """The one-line error of resuming `run`'s `checkpoint` by path."""
    with pytest.raises(ValueError) as refused:
        _trainer(run, steps=3).train(resume_from_checkpoint=str(run / checkpoint))
    message = str(refused.value)
    assert "\n" not in message and len(message) < 600, message
    return message


def test_a_rank_file_of_another_checkpoint_is_refused(saved_run, tmp_path):
    """checkpoint-1's rank file copied into checkpoint-2 (same size: the status check passes) resumed step 1's experts
    and optimizer state into the step-2 resume, silently."""
    run = _copy(saved_run, tmp_path)
    shutil.copy(run / "checkpoint-1" / RANK_FILE, run / "checkpoint-2" / RANK_FILE)

    message = _refused_resume(run, "checkpoint-2")
    assert message.startswith(f"resume_from_checkpoint='{run / 'checkpoint-2'}': rank file {RANK_FILE} belongs to another "
                              "checkpoint: it holds step 1's experts and optimizer state, the checkpoint is step 2"), message  # fmt: skip
    assert message.endswith(f"resume from '{run / 'checkpoint-1'}', the last complete one"), message


@pytest.mark.parametrize("damage", ["zero bytes", "a list"])
def test_a_rank_file_torch_cannot_read_is_named(saved_run, tmp_path, damage):
    """A rank file of the right size that torch.load cannot read failed inside torch, naming no file and advising
    `weights_only=False`; one holding another object failed on `.get`."""
    import torch

    run = _copy(saved_run, tmp_path)
    rank_file = run / "checkpoint-2" / RANK_FILE
    if damage == "zero bytes":
        rank_file.write_bytes(bytes(rank_file.stat().st_size))
        problem = "torch.load cannot read it (RuntimeError)"
    else:
        torch.save([1, 2], rank_file)
        status_file = run / "checkpoint-2" / "occult_checkpoint.json"
        status = json.loads(status_file.read_text())
        status["rank_files"][RANK_FILE] = rank_file.stat().st_size
        status_file.write_text(json.dumps(status))
        problem = "it holds a list, not the experts and optimizer state of an EP rank"

    message = _refused_resume(run, "checkpoint-2")
    assert message == (f"resume_from_checkpoint='{run / 'checkpoint-2'}': rank file {RANK_FILE} is damaged: {problem}; "
                       f"resume from '{run / 'checkpoint-1'}', the last complete one"), message  # fmt: skip
    assert "weights_only" not in message


STATUSES = {
    "truncated": ('{"complete": tr', "its status file cannot be read: status file '{path}' is not valid JSON: Expecting value: line 1 column 14 (char 13)"),
    "empty": ("", "its status file cannot be read: status file '{path}' is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    "an array": ("[]", "its status file occult_checkpoint.json is malformed: it holds an array, not an object"),
    "complete as a string": ('{"complete": "yes", "ranks": 1}', 'its status file occult_checkpoint.json is malformed: "complete" is "yes", not true or false'),
    "no ranks": ('{"complete": true}', 'its status file occult_checkpoint.json is malformed: "ranks" is missing, not a positive number of EP ranks'),
    "negative ranks": ('{"complete": false, "ranks": -1}', 'its status file occult_checkpoint.json is malformed: "ranks" is -1, not a positive number of EP ranks'),
    "a size as a string": ('{"complete": true, "ranks": 1, "rank_files": {"%s": "1"}}' % RANK_FILE,
                           f'its status file occult_checkpoint.json is malformed: "rank_files" gives {RANK_FILE} "1" bytes, not a number of bytes'),
    "rank files as a list": ('{"complete": true, "ranks": 1, "rank_files": []}',
                             'its status file occult_checkpoint.json is malformed: "rank_files" is [], not an object of rank files and their bytes'),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(STATUSES))
def test_a_damaged_status_file_makes_the_checkpoint_unusable(tmp_path, damage):
    """A status that did not parse stopped the scan of `last_complete_checkpoint` with its error; one that is not an
    object (`[]`) counted as complete. Neither needs a run: the status decides before any other file is looked at."""
    from occult_hf.hf.trainer import last_complete_checkpoint, unusable_because

    text, why = STATUSES[damage]
    for step, status in ((1, '{"complete": true, "ranks": 1, "rank_files": {}}'), (2, text)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "occult_checkpoint.json").write_text(status)
    why = why.format(path=tmp_path / "checkpoint-2" / "occult_checkpoint.json")

    assert unusable_because(str(tmp_path / "checkpoint-2")) == why
    assert last_complete_checkpoint(str(tmp_path)) == (str(tmp_path / "checkpoint-1"), {str(tmp_path / "checkpoint-2"): why})


def test_a_run_resumes_past_a_damaged_status_file(saved_run, tmp_path):
    """`resume_from_checkpoint=True` raised the status file's JSON error, though checkpoint-1 was whole."""
    run = _copy(saved_run, tmp_path)
    (run / "checkpoint-2" / "occult_checkpoint.json").write_text('{"complete": tr')
    why = f"its status file cannot be read: status file '{run / 'checkpoint-2' / 'occult_checkpoint.json'}' is not valid JSON"

    message = _refused_resume(run, "checkpoint-2")
    assert message.startswith(f"resume_from_checkpoint='{run / 'checkpoint-2'}': the checkpoint cannot be resumed, {why}"), message
    assert message.endswith(f"resume from '{run / 'checkpoint-1'}', the last complete one"), message
    skipped, resumed = _resume_from_the_last_complete(run)
    assert len(skipped) == 1 and skipped[0].startswith(f"occult_hf: skipping {run / 'checkpoint-2'}: {why}"), skipped
    assert [(log["step"], log.get("restored_from")) for log in resumed.state.log_history if "loss" in log] == [(1, "checkpoint-1"), (2, None)]
