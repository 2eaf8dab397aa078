"""Run a function on a real multi-process `gloo` world, for CPU tests of expert parallelism.

    from distributed import run_world

    def check(rank, world_size, scale):          # module-level, so spawned processes can import it
        ...                                      # the default process group is already initialised
        return {"rank": rank}                    # anything picklable comes back

    results = run_world(check, 2, 3.0)           # [result of rank 0, result of rank 1]

Each rank is a fresh process forked from a `forkserver` that has imported torch, transformers and
occult_hf once (no torch state of the test process; starting a process that imports them costs
about 12 s of CPU on a 2-core machine, a fork of the server milliseconds). The rank gets the test
process's environment as it is at the call, `torch.distributed` initialised on the gloo backend
through a file store in a private temporary directory, one CPU thread, and `OCCULT_TEST_RANK` set. If any rank raises, `run_world` raises `WorldError` with every failed
rank's traceback, after giving the other ranks a short grace period to finish or fail on their own
(a rank blocked in a collective with a dead peer is then killed). A world that runs past
`timeout_s` is killed and reported with the ranks still running, so a deadlock fails a test
instead of hanging the suite.

Group many checks into one world all the same: a world still costs its process group and the
test module's import in every rank, while a collective on a tiny tensor costs microseconds.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

#: seconds a world may run before it is killed (override per call with timeout_s)
DEFAULT_TIMEOUT_S = 240.0
#: seconds the surviving ranks get to finish after one rank failed
FAILURE_GRACE_S = 10.0
#: imported once by the fork server, so that no rank imports them again
PRELOADED = ["torch", "torch.distributed", "transformers.modeling_utils", "occult_hf"]


class WorldError(RuntimeError):
    """A world failed: a rank raised, died or the world ran past its timeout."""


def _rank_main(rank, world_size, init_file, call, results, env, backend="gloo") -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the fork server's environment is the one it started with: use the caller's
    os.environ.update(env)
    os.environ["OCCULT_TEST_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank (GPU tests)
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=float(env.get("OCCULT_TEST_COLLECTIVE_TIMEOUT_S", 120))),
        )
        fn, args = pickle.loads(call)
        outcome = (rank, True, fn(rank, world_size, *args))
    except BaseException:  # report everything, including KeyboardInterrupt and SystemExit
        outcome = (rank, False, traceback.format_exc())
    # report first, then tear down: NCCL's destroy_process_group flushes the communicator and can block
    # (pytorch#75097, #141510), which must not keep a finished world from reporting
    results.put(outcome)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict | None = None,
    backend: str = "gloo",
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results in rank order.

    `fn` and `args` must be picklable (define `fn` at module level). `env` adds environment variables in
    the children (e.g. `{"OCCULT_TEST_COLLECTIVE_TIMEOUT_S": "20"}` shortens the collective timeout).
    `backend="nccl"` (GPU tests) gives rank r the GPU `cuda:r`.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    results = context.Queue()
    # by value: a tensor argument handed to the fork server as-is travels as a file descriptor, and
    # the server takes at most a few hundred
    call = pickle.dumps((fn, args))
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="occult_world_") as tmp:
        init_file = os.path.join(tmp, "store")
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, world_size, init_file, call, results, child_env, backend),
                name=f"occult-test-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        outcome: dict[int, tuple[bool, Any]] = {}
        try:
            outcome = _collect(processes, results, world_size, timeout_s)
        finally:
            reported = len(outcome) == world_size and all(ok for ok, _ in outcome.values())
            for process in processes:
                if reported:  # it is tearing down its process group: a moment to exit on its own
                    process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                process.join(timeout=5)
    failures = {rank: text for rank, (ok, text) in outcome.items() if not ok}
    if failures:
        report = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items()))
        raise WorldError(f"{len(failures)} of {world_size} ranks of {getattr(fn, '__name__', fn)} failed:\n{report}")
    return [outcome[rank][1] for rank in range(world_size)]


def _collect(processes, results, world_size: int, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Gather one (ok, value) per rank; dead, hung or abandoned ranks get a failure text."""
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < world_size:
        if any(not ok for ok, _ in outcome.values()):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        try:
            rank, ok, value = results.get(timeout=0.2)
            outcome[rank] = (ok, value)
            continue
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank not in outcome and not process.is_alive() and process.exitcode is not None:
                # give the queue a moment: a rank that just reported may not be read yet
                try:
                    r, ok, value = results.get(timeout=1.0)
                    outcome[r] = (ok, value)
                except queue.Empty:
                    outcome[rank] = (False, f"process exited with code {process.exitcode} without reporting")
        if time.monotonic() > deadline:
            for rank in range(world_size):
                if rank not in outcome:
                    reason = "still running (a peer failed)" if any(not ok for ok, _ in outcome.values()) else (
                        f"still running after {timeout_s:.0f}s: deadlock or too slow"
                    )
                    outcome[rank] = (False, reason)
    return outcome


def free_port() -> int:
    """A TCP port free right now, for a launcher's rendezvous: its default 29500 is shared by every
    launch on the machine, and two concurrent tests on one port would join each other's world."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["run_world", "free_port", "WorldError", "DEFAULT_TIMEOUT_S"]
