"""A launcher that started one process while `num_devices > 1` asked for more is an error on every
entry that builds an EP model (`apply_occult`, `from_pretrained(occult_config=...)`), not only in the
fine-tune entry point (issue 13: "a launch that would run fewer processes than num_devices is an
error, unless the user asks for logical devices explicitly"). A plain `python` process keeps its
logical devices, the documented one-process mode.

The errors' advice is `LAUNCH_COMMANDS` and nothing else (tests/test_accelerate_resume.py runs those
two launches); the launches that quietly run something else are started here for real: accelerate
without `--multi_gpu` (one process on this GPU-less machine) and torchrun without the script's
`--use_cpu` (two processes the Trainer counts as one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from distributed import free_port
from tiny_models import tiny_checkpoint, tiny_model

from occult_hf import OccultConfig, apply_occult, occult_config_of
from occult_hf.hf.launch import LAUNCH_COMMANDS, LAUNCHER_ENV, check_launch


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# what each launcher leaves in the environment of a lone process: torchrun --nproc-per-node 1, and
# accelerate launch --num_processes 2 (--cpu) falling back to one plain process
@pytest.mark.parametrize(
    "launched", [{"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, {"ACCELERATE_USE_CPU": "True"}, {"ACCELERATE_USE_CPU": "False"}]
)
def test_one_launched_process_with_several_devices_is_an_error(no_launcher, launched):
    for name, value in launched.items():
        no_launcher.setenv(name, value)
    with pytest.raises(ValueError, match=r"OccultConfig.num_devices=2 but this launch runs 1 process \(.*logical_devices=True"):
        apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2))
    # asked for explicitly: logical devices, as in a plain process
    model = apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2, logical_devices=True))
    assert occult_config_of(model).num_devices == 2
    # one device needs no processes beyond this one
    apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=1))


def test_the_from_pretrained_path_checks_too(no_launcher, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoint("olmoe", tmp_path / "ckpt")
    no_launcher.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="this launch runs 1 process"):
        AutoModelForCausalLM.from_pretrained(checkpoint, occult_config={"num_devices": 2})
    no_launcher.delenv("LOCAL_RANK")  # a plain process: logical devices, no error
    model = AutoModelForCausalLM.from_pretrained(checkpoint, occult_config={"num_devices": 2})
    assert occult_config_of(model).num_devices == 2


def test_logical_devices_is_a_checked_json_field():
    config = OccultConfig(num_devices=4, logical_devices=True)
    assert OccultConfig.from_dict(config.to_dict()) == config and config.to_dict()["logical_devices"] is True
    with pytest.raises(TypeError, match="logical_devices must be True or False"):
        OccultConfig(logical_devices="yes")


def suggested_commands(message: str) -> list[str]:
    """The launch commands an error message suggests (each in backquotes, ending in ` ...`)."""
    return re.findall(r"`([^`]*) \.\.\.`", message)


def test_the_advice_is_the_launches_that_work(no_launcher):
    """Issue 32: the advice was `accelerate launch --num_processes 2 ...; on CPU also --use_cpu`, which
    starts one process again; it must be exactly LAUNCH_COMMANDS, with the CPU caveat."""
    expected = [command.format(n=2) for command in LAUNCH_COMMANDS]
    assert any("--multi_gpu" in command for command in expected)
    no_launcher.setenv("ACCELERATE_USE_CPU", "False")  # what `accelerate launch --num_processes 2` leaves
    with pytest.raises(ValueError) as one_process:
        check_launch(2)
    with pytest.raises(ValueError) as apply_path:
        apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2))
    for error in (one_process, apply_path):
        message = str(error.value)
        assert suggested_commands(message) == expected, message
        assert "accelerate launch started this one process: without --multi_gpu" in message
        assert "--use_cpu" in message


def _run_finetune(tmp_path, launcher: list[str], script_flags: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    for key in (*LAUNCHER_ENV, "RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    (tmp_path / "train.txt").write_text("some text\n")
    command = [sys.executable, "-m", *launcher, "-m", "occult_hf.hf.finetune", "--model_name_or_path", str(tmp_path),
               "--train_file", str(tmp_path / "train.txt"), "--output_dir", str(tmp_path / "out"), "--report_to", "none",
               "--num_devices", "2", *script_flags]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "launcher, script_flags, says",
    [
        # issue 32's launch: accelerate runs one process here, whatever --num_processes says
        (["accelerate.commands.accelerate_cli", "launch", "--num_processes", "2"], ["--use_cpu"],
         "accelerate launch started this one process"),
        # two processes, but without --use_cpu the Trainer counts one: the same batches on every rank, no DDP
        (["torch.distributed.run", "--nproc-per-node", "2"], [], "TrainingArguments counts 1 (parallel_mode not_parallel)"),
    ],
    ids=["accelerate-without-multi_gpu", "torchrun-without-use_cpu"],
)
def test_a_launch_that_is_not_ep_fails_before_loading_anything(tmp_path, launcher, script_flags, says):
    if launcher[0] == "torch.distributed.run":
        launcher = [*launcher, "--master-port", str(free_port())]
    done = _run_finetune(tmp_path, launcher, script_flags)
    assert done.returncode != 0 and says in done.stderr, done.stderr[-3000:]
