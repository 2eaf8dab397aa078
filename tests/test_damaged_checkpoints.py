"""A Trainer checkpoint whose rank file was removed or truncated after a complete save is unusable, said as such.

The complete `occult_checkpoint.json` lists every rank file with its size. Before, a checkpoint whose
`occult_rank0-of-1.pt` was deleted afterwards was blamed on `save_only_model=True`, and a truncated one failed
inside `torch.load` half-way through the resume; `resume_from_checkpoint=True` picked either as the last one.
One process (its rank file is `occult_rank0-of-1.pt`), a checkpoint every step, 2 steps.
"""

from __future__ import annotations

import json
import logging

import pytest

from occult_logs import occult_records
from tiny_models import tiny_batch, tiny_model


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


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_rank_file_changed_after_the_save_makes_the_checkpoint_unusable(tmp_path, damage):
    from occult_hf.hf.trainer import last_complete_checkpoint

    _trainer(tmp_path, steps=2).train()
    rank_file = tmp_path / "checkpoint-2" / "occult_rank0-of-1.pt"
    size = rank_file.stat().st_size
    if damage == "removed":
        rank_file.unlink()
        said = f"occult_rank0-of-1.pt is gone (the save wrote {size} bytes)"
    else:
        rank_file.write_bytes(rank_file.read_bytes()[: size // 2])
        said = f"occult_rank0-of-1.pt has {size // 2} bytes (the save wrote {size})"

    last, unusable = last_complete_checkpoint(str(tmp_path))
    assert last == str(tmp_path / "checkpoint-1")
    assert unusable == {str(tmp_path / "checkpoint-2"): f"its rank files changed after the save: {said}"}
    with pytest.raises(ValueError, match="the checkpoint cannot be resumed, its rank files changed after the save") as by_path:
        _trainer(tmp_path, steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert said in str(by_path.value) and "resume from" in str(by_path.value) and "checkpoint-1', the last complete one" in str(by_path.value)

    state_file = tmp_path / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["log_history"][0]["restored_from"] = "checkpoint-1"  # tells a resume from checkpoint-1 from a fresh run
    state_file.write_text(json.dumps(state))
    resumed = _trainer(tmp_path, steps=2)
    with occult_records() as records:
        resumed.train(resume_from_checkpoint=True)
    assert [r.getMessage() for r in records if r.levelno == logging.WARNING and "skipping" in r.getMessage()] == [
        f"occult_hf: skipping {tmp_path / 'checkpoint-2'}: its rank files changed after the save: {said}"
    ]
    assert [(log["step"], log.get("restored_from")) for log in resumed.state.log_history if "loss" in log] == [(1, "checkpoint-1"), (2, None)]
