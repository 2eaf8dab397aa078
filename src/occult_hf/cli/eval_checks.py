"""`occult eval`'s checks before the model loads: a typo in `--tasks`, a `--limit` that leaves an EP rank without a
document or an `--output_path` nothing can be written in is an error within seconds, on every rank, instead of after
minutes of loading (lm-eval loads the model before it resolves the tasks) or, on the ranks that did not check, after
the process group's timeout."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..utils.checks import did_you_mean, shown
from ..utils.checks import check_model_source

#: what the EP ranks' agreement on the checks before the model loads is called in its errors
CHECKS = "occult eval's checks before the model loads"


def check_output_path(output_path: str) -> None:
    """Fail before the evaluation when `--output_path` cannot take its results: lm-eval logs a failed write
    ("Could not save results aggregated") and carries on, so an hours-long run would end with nothing written."""
    from occult_hf.utils.atomic import nearest_existing, probe_directory

    if not output_path:
        raise SystemExit("occult eval: --output_path must not be empty")
    path = Path(output_path)
    if path.suffix == ".json" and path.is_dir():
        raise SystemExit(f"occult eval: --output_path {output_path!r} is a folder, but a path ending in .json names the "
                         f"results file (lm-eval writes {path.stem}_<time>.json beside it); give a path without .json")  # fmt: skip
    folder = path.parent if path.suffix == ".json" else path  # lm-eval writes beside a .json path, else into it
    existing = nearest_existing(folder)  # a file there names what is in the way
    if not existing.is_dir():
        where = "is an existing file" if existing == path else f"lies under the file {os.fspath(existing)!r}"
        raise SystemExit(f"occult eval: --output_path {output_path!r} {where}; give a folder (it is made if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_directory(folder)
    except OSError as error:
        raise SystemExit(f"occult eval: --output_path {output_path!r}: cannot write there ({error.strerror or error})") from None


def check_task_names(names: list[str], task_manager) -> None:
    """Fail naming the `--tasks` entries that `task_manager` does not know: lm-eval resolves the task list only after
    it has loaded the model (minutes for a real checkpoint, on every rank)."""
    unknown = [name for name in names if name not in task_manager.task_index and not Path(name).is_file()]
    if unknown:
        raise SystemExit(
            f"occult eval: --tasks {shown(unknown)}: no such lm-eval task, group or tag{did_you_mean(unknown, task_manager.all_tasks)}; "
            f"known are lm-eval's tasks, occult23, occult_offline, the tasks under --include_path and task YAML files"
        )  # fmt: skip


def check_limit_for_ranks(limit: int | float | None, world_size: int) -> None:
    """Fail when an integer `--limit` leaves an EP rank without documents: lm-eval gives rank r the documents r, r + W,
    ... of the first `limit`, and a rank with none fails in lm-eval after the model loaded, taking the others down."""
    if isinstance(limit, int) and limit < world_size:
        raise SystemExit(f"occult eval: --limit {limit} leaves ranks {shown(range(limit, world_size))} of the {world_size} "
                         f"without a document (lm-eval gives rank r documents r, r + {world_size}, ... of the first "
                         f"{limit}); give --limit {world_size} or more")  # fmt: skip


def task_sizes(names: list[str], task_manager) -> dict[str, int]:
    """`{task: documents}` of every task that `names` resolve to, counted as lm-eval counts them (`eval_docs`) without
    the model: a fractional `--limit` gives each task its own number of documents, known only from these."""
    return {name: len(task.eval_docs) for name, task in task_manager.load(names)["tasks"].items()}


def check_fraction_for_ranks(limit: float, world_size: int, sizes: dict[str, int]) -> None:
    """Fail when a fractional `--limit` leaves an EP rank without documents of a task: lm-eval scores the first
    ceil(documents x limit) of each task and gives rank r the documents r, r + W, ... of those, so a task with fewer
    than W of them leaves the last ranks none, and lm-eval fails there after the model loaded."""
    scored = {name: math.ceil(size * limit) for name, size in sizes.items()}
    short = {name: size for name, size in sizes.items() if scored[name] < world_size}
    if short:
        named = ", ".join(f"{name} ({scored[name]} of {size} documents scored)" for name, size in sorted(short.items()))
        idle = range(min(scored[name] for name in short), world_size)
        raise SystemExit(f"occult eval: --limit {limit} leaves ranks {shown(idle)} of the {world_size} without a "
                         f"document of {named} (lm-eval scores the first ceil(documents x {limit}) of each task and "
                         f"gives rank r documents r, r + {world_size}, ... of them); {_limit_fix(world_size, short)}")  # fmt: skip


def _limit_fix(world_size: int, sizes: dict[str, int]) -> str:
    """What makes every rank get a document of each of the tasks of `sizes` (`{task: documents}`): the smallest
    fraction, rounded up, that scores `world_size` documents of each, else an integer `--limit`; or, for a task with
    fewer documents than ranks, which no `--limit` helps, leaving it out."""
    too_small = sorted(name for name, size in sizes.items() if size < world_size)
    if too_small:
        return f"{shown(too_small)} have fewer documents than ranks: leave them out of --tasks or run on fewer ranks"
    fraction = math.ceil(world_size / min(sizes.values()) * 1000) / 1000
    either = f"--limit {fraction} or more, or " if fraction < 1 else ""
    return f"give {either}an integer --limit {world_size} or more"


def no_documents_message(limit: int | float | None, rank: int, world_size: int) -> str:
    """lm-eval's "task.build_requests() did not find any docs!", said with its cause: a task with fewer documents than
    ranks (checked before the load only for a fractional `--limit` under EP), or none at all."""
    split = f" (lm-eval gives rank r of {world_size} documents r, r + {world_size}, ...)" if world_size > 1 else ""
    if limit is not None:
        return f"occult eval: --limit {limit} leaves rank {rank} without a document of a task{split}; give a larger --limit"
    return f"occult eval: a task has no document for rank {rank}{split}"


def check_before_loading(args: argparse.Namespace, rank: int, world_size: int):
    """`(task names, TaskManager)` of the run, after every check that needs no model. Under EP each rank checks what
    it can see (rank 0 the `--output_path` it will write), then the ranks agree on a gloo group (bounded by
    `OCCULT_SAVE_TIMEOUT_S`): a failed check stops every rank at once with its reason, instead of leaving the others
    waiting for a rank that has gone, up to the process group's timeout (30 min)."""
    import torch.distributed as dist

    from occult_hf.distributed.agreement import check_agreement, fail_together, save_timeout_s
    from occult_hf.eval import make_task_manager, parse_task_list

    group = dist.new_group(backend="gloo") if world_size > 1 else None  # every rank, before any check can fail
    try:
        names = parse_task_list(args.tasks)
        check_limit_for_ranks(args.limit, world_size)
        check_model_source(args.pretrained)
        if rank == 0:  # the one rank that writes
            check_output_path(args.output_path)
        task_manager = make_task_manager(args.include_path)
        check_task_names(names, task_manager)
        if world_size > 1 and isinstance(args.limit, float):
            check_fraction_for_ranks(args.limit, world_size, task_sizes(names, task_manager))
    except (Exception, SystemExit) as error:  # a usage error too: the other ranks must hear of it
        if group is None:
            raise
        fail_together(error, group, CHECKS, save_timeout_s())
    if group is not None:
        check_agreement({}, group, CHECKS, save_timeout_s())
        dist.destroy_process_group(group)
    return names, task_manager
