"""Trainer checkpoints under EP are complete before anything is rotated (issue 33 item 1), on 2 gloo ranks.

`save_total_limit=1`, a checkpoint every 2 steps, 4 steps. At checkpoint-4, rank 1's save of its
`occult_rank1-of-2.pt` fails, as the probe made it fail:

- it stalls (sleeps past `OCCULT_SAVE_TIMEOUT_S`) and then dies (SIGKILL);
- or it raises (a full disk).

Rank 0 must raise naming rank 1 (at once when rank 1 raised), checkpoint-4 must be left marked incomplete,
and checkpoint-2 must still be there: `resume_from_checkpoint=True` then resumes from it (and skips
checkpoint-4, saying what it lacks) and the resumed run's losses equal the uninterrupted run's; resuming from
checkpoint-4 by path is an error naming the missing file.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from distributed import WorldError, run_world
from tiny_models import tiny_batch, tiny_model

STEPS, SAVE_STEPS = 4, 2
ENV = {"OCCULT_SAVE_TIMEOUT_S": "4", "OCCULT_EXCHANGE_TIMEOUT_S": "20"}


def _trainer(output_dir: str, world_size: int):
    import os

    from transformers import Trainer, TrainingArguments

    from occult_hf import OccultConfig, Placement, apply_occult

    os.environ.update(
        RANK=os.environ["OCCULT_TEST_RANK"], WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ["OCCULT_TEST_RANK"],
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29518",
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=0.01, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_STEPS, save_total_limit=1, report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    placement = Placement(8, world_size, {0: [1, 0, 0, 1, 1, 0, 1, 0], 1: [0, 1, 1, 0, 0, 1, 0, 1]})
    model = apply_occult(tiny_model("olmoe", seed=11, output_router_logits=False), OccultConfig(placement=placement))
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=2 * world_size * STEPS, seq=16, seed=5)]
    return Trainer(model=model, args=args, train_dataset=data)


def _losses(trainer) -> dict[int, float]:
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


def _fail_rank1_file_of_checkpoint_4(how: str) -> None:
    """On this rank, writing `occult_rank1-of-2.pt` of checkpoint-4 stalls then dies, or raises."""
    import signal

    import torch

    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path) and "occult_rank1-of-2.pt" in str(path):
            with open(path, "wb") as f:
                f.write(b"half a file")
            if how == "raises":
                raise OSError(28, "No space left on device", str(path))
            time.sleep(8)  # stalls past rank 0's bound
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, path, *args, **kwargs)

    torch.save = save


def _interrupted_run(rank, world_size, output_dir, how):
    from occult_hf.hf.apply import install

    install()
    trainer = _trainer(output_dir, world_size)
    if rank == 1:
        _fail_rank1_file_of_checkpoint_4(how)
    start = time.monotonic()
    try:
        trainer.train()
        report = {"seconds": time.monotonic() - start, "error": None}
    except Exception as error:  # noqa: BLE001 - what each rank sees is the point
        report = {"seconds": time.monotonic() - start, "error": f"{type(error).__name__}: {error}"}
    with open(f"{output_dir}/../rank{rank}.json", "w") as f:  # read back even when a peer's death fails the world
        json.dump(report, f)
    return report


def _resumed_run(rank, world_size, output_dir, reference_dir):
    from occult_hf.hf.apply import install

    install()
    reference = _trainer(reference_dir, world_size)
    reference.train()
    resumed = _trainer(output_dir, world_size)
    with pytest.raises(ValueError) as by_path:
        resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-4")
    resumed = _trainer(output_dir, world_size)
    resumed.train(resume_from_checkpoint=True)
    return {"reference": _losses(reference), "resumed": _losses(resumed), "by_path": str(by_path.value)}


def _checkpoints(output_dir) -> list[str]:
    return sorted(name for name in os.listdir(output_dir) if name.startswith("checkpoint-"))


@pytest.mark.world_size(2)
def test_a_rank_that_stalls_and_dies_while_saving_leaves_the_last_complete_checkpoint(tmp_path):
    output_dir = tmp_path / "run"
    with pytest.raises(WorldError) as world:
        run_world(_interrupted_run, 2, str(output_dir), "stalls and dies", env=ENV, timeout_s=200)
    assert "--- rank 1 ---\nprocess exited with code -9" in str(world.value), str(world.value)[-3000:]
    assert _checkpoints(output_dir) == ["checkpoint-2", "checkpoint-4"]  # nothing rotated away for checkpoint-4
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["seconds"] < 30 and "the Trainer checkpoint checkpoint-4 on rank 0: EP ranks [1] did not reach it within 4 s" in rank0["error"], rank0
    assert "checkpoint-4 stays marked incomplete (occult_checkpoint.json); no older checkpoint was rotated away" in rank0["error"]
    from occult_hf.hf.trainer import last_complete_checkpoint

    last, unusable = last_complete_checkpoint(str(output_dir))
    assert last == str(output_dir / "checkpoint-2")
    assert "occult_rank1-of-2.pt" in unusable[str(output_dir / "checkpoint-4")]


@pytest.mark.world_size(2)
def test_a_rank_that_fails_while_saving_is_named_at_once_and_the_run_resumes(tmp_path):
    output_dir = tmp_path / "run"
    reports = run_world(_interrupted_run, 2, str(output_dir), "raises", env=ENV, timeout_s=200)
    rank0, rank1 = reports
    assert rank1["error"].startswith("OSError: [Errno 28] No space left on device"), rank1
    assert rank0["error"] and "rank 1 of the expert-parallel group failed at the Trainer checkpoint checkpoint-4 (OSError" in rank0["error"], rank0
    assert _checkpoints(output_dir) == ["checkpoint-2", "checkpoint-4"]

    reports = run_world(_resumed_run, 2, str(output_dir), str(tmp_path / "reference"), env=ENV, timeout_s=300)
    for rank, report in enumerate(reports):
        assert "checkpoint-4': the checkpoint cannot be resumed, its save did not finish" in report["by_path"], report["by_path"]
        assert "it lacks occult_rank1-of-2.pt" in report["by_path"] and "checkpoint-2', the last complete one" in report["by_path"]
        reference, resumed = report["reference"], report["resumed"]
        assert sorted(resumed) == list(range(1, STEPS + 1)), (rank, resumed)  # steps 1-2 restored from checkpoint-2
        for step in (3, 4):
            assert resumed[step] == pytest.approx(reference[step], rel=1e-6), (rank, step, reference, resumed)
    assert _checkpoints(output_dir) == ["checkpoint-4"]  # the resumed run's checkpoint-4 is complete: 2 rotated now
