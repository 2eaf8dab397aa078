"""Trainer save/resume under EP started by the real launchers (2 CPU processes, gloo): the two launches of
docs/finetune.md at a smaller size (that document's test skips them for this one).

`tests/test_hf_native.py` checks resume = uninterrupted run in a torchrun-like world (`run_world`).
Here `torchrun` starts the fine-tune entry point for 4 steps with a checkpoint at step 2, then
`accelerate launch` resumes from that checkpoint. Both runs must be two EP ranks (one expert shard per
rank in the checkpoint) and the resumed losses must equal the uninterrupted ones step for step, so a
checkpoint written under one launcher resumes under the other.

accelerate's own `--cpu` flag starts one process whatever `--num_processes` says (its CPU path is
for `--num_cpu_threads_per_process`, or multi-CPU through MPI/oneCCL, neither here), so on a CPU
machine the EP group comes from `--multi_gpu --num_processes 2` with the script's `--use_cpu`, which
makes the processes a gloo group: the launch docs/finetune.md gives. The two launches are
`occult_hf.hf.launch.LAUNCH_COMMANDS` as written, the commands the launch errors suggest (plus a free
port each, since other runs on this machine may hold the default one).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

from distributed import free_port  # noqa: E402

STEPS, SAVE_STEPS = 4, 2


def _launch(tmp_path, launcher: str, args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"),  # no user accelerate config file: the flags say everything
           "OCCULT_SAVE_TIMEOUT_S": "60"}  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    from occult_hf.hf.launch import LAUNCH_COMMANDS

    suggested = {shlex.split(command)[0]: shlex.split(command.format(n=2))[1:] for command in LAUNCH_COMMANDS}
    launchers = {  # the suggested commands through this interpreter, each on a free port
        "torchrun": ["torch.distributed.run", *suggested["torchrun"], "--master-port", str(free_port())],
        "accelerate": ["accelerate.commands.accelerate_cli", *suggested["accelerate"], "--main_process_port", str(free_port())],
    }
    command = [sys.executable, "-m", *launchers[launcher], "-m", "occult_hf.hf.finetune", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{launcher} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _losses(checkpoint) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {log["step"]: log["loss"] for log in state["log_history"] if "loss" in log}


@pytest.mark.world_size(2)
def test_resume_under_accelerate_launch_equals_uninterrupted_torchrun_run(tmp_path):
    import datasets

    from tiny_models import save_tiny_tokenizer, tiny_checkpoint, tiny_sentences

    model_dir = save_tiny_tokenizer(tiny_checkpoint("olmoe", tmp_path / "model", seed=4, output_router_logits=False))
    datasets.Dataset.from_dict({"text": tiny_sentences(64, seed=1)}).to_json(tmp_path / "train.jsonl")
    common = ["--model_name_or_path", str(model_dir), "--train_file", str(tmp_path / "train.jsonl"), "--seq_len", "16",
              "--per_device_train_batch_size", "2", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
              "--max_steps", str(STEPS), "--save_steps", str(SAVE_STEPS), "--logging_steps", "1", "--learning_rate", "1e-2",
              "--num_devices", "2", "--prune", "router", "--max_devices_per_token", "1", "--check_every", "0",
              "--seed", "0"]  # fmt: skip
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _launch(tmp_path, "torchrun", [*common, "--output_dir", str(full)])
    # two EP ranks ran: one expert shard per rank beside the Trainer's files (one process would write -of-1)
    for rank in (0, 1):
        assert (full / f"checkpoint-{SAVE_STEPS}" / f"occult_rank{rank}-of-2.pt").is_file(), sorted(os.listdir(full / f"checkpoint-{SAVE_STEPS}"))
    _launch(tmp_path, "accelerate", [*common, "--output_dir", str(resumed), "--resume_from_checkpoint", str(full / f"checkpoint-{SAVE_STEPS}")])
    expected, got = _losses(full / f"checkpoint-{STEPS}"), _losses(resumed / f"checkpoint-{STEPS}")
    assert sorted(expected) == sorted(got) == list(range(1, STEPS + 1)), (expected, got)
    for step in range(SAVE_STEPS + 1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), (step, expected, got)
    assert expected[STEPS] != pytest.approx(expected[1], rel=1e-3)  # it trained: the comparison can fail
