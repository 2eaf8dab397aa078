"""Launcher checks: the processes a launch really started against the EP group the user asked for.

`accelerate launch --num_processes 2 --cpu` without a multi-CPU setup, or `torchrun` with a script
that never initialises `torch.distributed` (TrainingArguments on a CPU machine without
`use_cpu=True`), quietly run every process as a one-process model with `num_devices` *logical*
devices: each rank trains on the same batches, with no DDP, and the user believes EP ran. These
checks turn that into an error that says what to change.
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


def check_process_group_started() -> None:
    """A launcher started several processes but this one has no process group: an error."""
    launched = launched_world_size()
    if launched > 1 and running_world_size() == 1:
        raise RuntimeError(
            f"WORLD_SIZE={launched}: this process was started by a multi-process launcher but torch.distributed "
            f"is not initialised, so every process would run the whole model with logical devices on the same "
            f"data. Initialise it before loading the model: TrainingArguments(...) does (on a CPU machine pass "
            f"use_cpu=True / --use_cpu), or torch.distributed.init_process_group()"
        )


#: environment variables by which a launcher marks the processes it starts (torchrun sets the first
#: three; `accelerate launch` sets ACCELERATE_USE_CPU even when it falls back to one plain process)
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
        f"{setting}={num_devices} but this launch runs 1 process ({launched}): the {num_devices} devices would be "
        f"logical and no expert parallelism would run. Start {num_devices} processes (torchrun --nproc-per-node "
        f"{num_devices} ..., or accelerate launch --num_processes {num_devices} ...; on CPU with a multi-CPU "
        f"accelerate config or use_cpu=True in TrainingArguments), or ask for {num_devices} logical devices in this "
        f"one process explicitly with OccultConfig(logical_devices=True) (--logical_devices in the fine-tune entry)"
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
        raise ValueError(
            f"num_devices={num_devices} but this launch runs 1 process. Start {num_devices} processes "
            f"(torchrun --nproc-per-node {num_devices} ..., or accelerate launch --num_processes {num_devices} ...; "
            f"on CPU also --use_cpu), or ask for {num_devices} logical devices in this one process with "
            f"--logical_devices (pruning then plans for {num_devices} devices; no expert parallelism runs)"
        )
    return num_devices


__all__ = [
    "LAUNCHER_ENV",
    "check_launch",
    "check_logical_devices",
    "check_process_group_started",
    "launched_world_size",
    "launcher_env",
    "running_world_size",
]
