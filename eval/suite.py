"""The `occult23` suite: the paper's 23 quality tasks as pinned lm-eval 0.4.13 task names.

The group is defined once, in `tasks/occult23.yaml` (shipped as package data), so that lm-eval's own
task loader and this module read the same list. The task-name choices (e.g. `wsc273` rather than
SuperGLUE `wsc`) are explained in docs/eval.md.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

#: the folder of occult_hf's lm-eval task YAMLs; pass it to lm-eval as `include_path`
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SUITE_NAME = "occult23"
SUITE_SIZE = 23


@functools.cache
def suite_tasks() -> tuple[str, ...]:
    """The lm-eval task (or group) names of `occult23`, in the paper's order."""
    with open(TASKS_DIR / f"{SUITE_NAME}.yaml") as f:
        config = yaml.safe_load(f)
    names = tuple(config["task"])
    if len(names) != SUITE_SIZE or len(set(names)) != SUITE_SIZE:
        raise ValueError(f"{SUITE_NAME}.yaml must list {SUITE_SIZE} distinct tasks, it lists {list(names)}")
    return names


def parse_task_list(spec: str) -> list[str]:
    """`"occult23"` or `"task_a,task_b"` -> the names to hand to lm-eval (a group name stays a group)."""
    names = [name.strip() for name in spec.split(",")]
    if not spec.strip() or any(not name for name in names):
        raise ValueError(f"tasks must be a comma-separated list of lm-eval task names, got {spec!r}")
    return names


def make_task_manager(include_path: str | os.PathLike | list | None = None) -> "TaskManager":
    """An lm-eval `TaskManager` that knows lm-eval's tasks, `occult23`, and any extra `include_path` folders."""
    from lm_eval.tasks import TaskManager

    extra = [] if include_path is None else include_path if isinstance(include_path, list) else [include_path]
    return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra)])


__all__ = ["TASKS_DIR", "SUITE_NAME", "SUITE_SIZE", "suite_tasks", "parse_task_list", "make_task_manager"]
