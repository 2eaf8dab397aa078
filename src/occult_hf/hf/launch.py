"""Launcher checks: the processes a launch really started against the EP group the user asked for.

What the launchers do on a machine without GPUs (accelerate 1.15, torch 2.13, transformers 5.24):

- `accelerate launch --num_processes 2 ...` and `accelerate launch --cpu --num_processes 2 ...` start
  **one** plain process, whatever `--num_processes` says: without `--multi_gpu` accelerate's
  launcher runs the script directly (its multi-CPU path needs MPI, `--mpirun_hostfile`). That process
  has `ACCELERATE_USE_CPU` in its environment and no `WORLD_SIZE`.
- `accelerate launch --multi_gpu --num_processes 2 ...` and `torchrun --nproc-per-node 2 ...` start
  two processes (`WORLD_SIZE=2`, `LOCAL_RANK`; accelerate refuses `--cpu` with `--multi_gpu`).
  `TrainingArguments` then initialises a process group either way, but without `use_cpu=True`
  (`--use_cpu`) it reports `world_size` 1 and `parallel_mode` NOT_PARALLEL: the Trainer neither
  splits the data nor averages the dense gradients.

Each of these quietly runs something other than the EP the user asked for (logical devices in one
process, or ranks that train on the same batches without DDP); the checks here make it an error
whose advice is `LAUNCH_COMMANDS`, the launches that work (tests/test_accelerate_resume.py runs them).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ..utils.checks import check_num_devices


def launched_world_size() -> int:
    """The process count the launcher announced (`WORLD_SIZE`, set by torchrun and accelerate), or 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def running_world_size() -> int:
    """The processes of the initialised default group, or 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


#: launch commands that start N processes forming one process group, on GPUs and on a machine without
#: them (there with the script's `--use_cpu`); `{n}` is the process count
LAUNCH_COMMANDS = ("torchrun --nproc-per-node {n}", "accelerate launch --multi_gpu --num_processes {n}")


def launch_advice(num_devices: int) -> str:
    """How to start `num_devices` processes: the commands of `LAUNCH_COMMANDS` and the CPU caveat."""
    first, second = (command.format(n=num_devices) for command in LAUNCH_COMMANDS)
    return (
        f"Start {num_devices} processes with `{first} ...` or `{second} ...` (--multi_gpu also on a machine "
        f"without GPUs: without it, and with accelerate's --cpu, accelerate starts one process); on a machine "
        f"without GPUs also give the script --use_cpu (TrainingArguments(use_cpu=True)), without which the "
        f"Trainer runs the processes unsynchronised"
    )


def _who_started_this_process() -> str:
    """What started this lone process, in words: accelerate's one-process fallback, or the variable set."""
    if os.environ.get("ACCELERATE_USE_CPU") and not os.environ.get("WORLD_SIZE"):
        return (
            "accelerate launch started this one process: without --multi_gpu it runs one process on a machine "
            "without GPUs, whatever --num_processes says"
        )
    return launcher_env() or "no launcher variable set"


def check_process_group_started() -> None:
    """A launcher started several processes but this one has no process group: an error."""
    launched = launched_world_size()
    if launched > 1 and running_world_size() == 1:
        raise RuntimeError(
            f"WORLD_SIZE={launched}: this process was started by a multi-process launcher but torch.distributed "
            f"is not initialised, so every process would run the whole model with logical devices on the same "
            f"data. Initialise it before loading the model: TrainingArguments(...) does (on a machine without "
            f"GPUs pass use_cpu=True / --use_cpu), or torch.distributed.init_process_group()"
        )


def check_trainer_sees_the_processes(training_args) -> None:
    """The processes form a group but `TrainingArguments` count one (no `use_cpu=True` on a machine without
    GPUs): an error, since the Trainer would neither split the data nor average the dense gradients."""
    world = running_world_size()
    if world > 1 and training_args.world_size != world:
        raise ValueError(
            f"this launch runs {world} processes but TrainingArguments counts {training_args.world_size} "
            f"(parallel_mode {training_args.parallel_mode.value}): every rank would train on the same batches "
            f"without averaging the dense gradients. On a machine without GPUs give the script --use_cpu "
            f"(TrainingArguments(use_cpu=True))"
        )


#: environment variables by which a launcher marks the processes it starts (torchrun sets the first
#: three; `accelerate launch` sets ACCELERATE_USE_CPU, "True" or "False", even when it falls back to
#: one plain process)
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_CPU")


def launcher_env() -> str | None:
    """`NAME=value` of the first launcher variable set in this process's environment, or None."""
    for name in LAUNCHER_ENV:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def check_logical_devices(num_devices: int, logical_devices: bool = False, setting: str = "OccultConfig.num_devices") -> None:
    """A launcher started this process as the only one, yet `num_devices > 1`: an error unless asked for.

    Every entry that builds an EP model calls this (`apply_occult`, and through it
    `from_pretrained(occult_config=...)`, `occult eval`, the fine-tune entry point). A plain `python`
    process (no launcher variable) keeps its logical devices: that is the documented one-process mode.
    """
    if num_devices <= 1 or logical_devices or running_world_size() > 1:
        return
    launched = launcher_env()
    if launched is None:
        return
    raise ValueError(
        f"{setting}={num_devices} but this launch runs 1 process ({_who_started_this_process()}): the "
        f"{num_devices} devices would be logical and no expert parallelism would run. {launch_advice(num_devices)}; "
        f"or ask for {num_devices} logical devices in this one process explicitly with "
        f"OccultConfig(logical_devices=True) (--logical_devices in the fine-tune entry)"
    )


def check_launch(num_devices: int | None, logical_devices: bool = False) -> int:
    """The EP size to use, checked against the processes that really run.

    Args:
        num_devices: what the user asked for (None: the number of processes).
        logical_devices: the user asked explicitly for `num_devices` logical devices in one process.

    Fewer processes than `num_devices` is an error unless `logical_devices`; more processes than
    `num_devices` is always an error (each process is one EP rank).
    """
    check_process_group_started()
    world = running_world_size()
    if num_devices is None:
        return world
    check_num_devices(num_devices)
    if world > 1 and num_devices != world:
        raise ValueError(f"num_devices={num_devices} but this launch runs {world} processes (one EP rank each); make them equal")
    if world == 1 and num_devices > 1 and not logical_devices:
        started = f" ({_who_started_this_process()})" if launcher_env() else ""
        raise ValueError(
            f"num_devices={num_devices} but this launch runs 1 process{started}. {launch_advice(num_devices)}; "
            f"or ask for {num_devices} logical devices in this one process with --logical_devices (pruning then "
            f"plans for {num_devices} devices; no expert parallelism runs)"
        )
    return num_devices


__all__ = [
    "LAUNCHER_ENV",
    "LAUNCH_COMMANDS",
    "check_launch",
    "check_logical_devices",
    "check_process_group_started",
    "check_trainer_sees_the_processes",
    "launch_advice",
    "launched_world_size",
    "launcher_env",
    "running_world_size",
]
