"""Run a study's worker processes under a stall watchdog and a deadline.

A study that fans its work out to GPU worker processes must never hang silently: workers that print
nothing while a parent waits with a bare `Popen.wait()` end only when something outside kills
everything, with no word of which job stalled. `run_jobs` replaces that wait:

- each job is one process (`python -m ...`) whose stdout and stderr go to its own log file; the log
  growing is the job's heartbeat (workers print a line per phase and per few training steps);
- a job whose log has not grown for `stall_s` seconds is killed and reported `stalled`, with the
  phase it was in (its last log line);
- at `deadline` every running job is killed and reported `cut`; a job is not started when the time
  left is below its `min_time_s` (reported `not_started`; a function gives an estimate that learns from the
  jobs finished so far), so the caller always gets its results back before an outer time limit;
- jobs run `slots` at a time, each slot pinned to one GPU (`CUDA_VISIBLE_DEVICES`) or to none (CPU);
- given each GPU's memory (`capacity_gib`), a job starts only where the memory the running jobs on that GPU
  hold at their peak (`Job.memory_gib`) leaves room for its own: a slot count alone puts as many of the
  biggest jobs on a GPU as of the smallest, and ten 19 GiB fine-tunes on a 140 GiB GPU end in
  out-of-memory errors, not in a slower run;
- a status line is printed every `status_every_s`, so the caller's own log shows progress too.

The caller decides what a stalled or failed job means for the whole run (`JobOutcome.ok`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    """One worker process: `python -m <argv...>` with its log file."""

    name: str = field(metadata={"help": "the job's name in status lines and outcomes"})
    argv: list[str] = field(metadata={"help": "arguments after `python` (e.g. ['-m', 'pkg.mod', '--x', '1'])"})
    log: Path = field(metadata={"help": "file receiving the job's stdout and stderr (appended)"})
    min_time_s: float | Callable[[], float] = field(
        default=0.0, metadata={"help": "do not start when less time is left before the deadline: seconds, or a function asked "
                                       "when the job could start (an estimate that learns from the jobs finished by then)"})  # fmt: skip
    memory_gib: float = field(default=0.0, metadata={"help": "GPU memory the job's process holds at its peak (with `capacity_gib`)"})

    def time_needed(self) -> float:
        """Seconds this job needs left before the deadline to start, now."""
        return self.min_time_s() if callable(self.min_time_s) else self.min_time_s


@dataclass
class JobOutcome:
    """What became of one job."""

    name: str
    status: str  # "done", "failed", "stalled", "cut", "not_started"
    returncode: int | None = None
    wall_s: float = 0.0
    slot: str | None = None
    last_line: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "done"

    def describe(self) -> str:
        where = f" on GPU {self.slot}" if self.slot not in (None, "") else ""
        if self.status == "failed":
            return f"{self.name}{where}: exited with {self.returncode} after {self.wall_s:.0f} s; last log line: {self.last_line!r}"
        if self.status == "stalled":
            return f"{self.name}{where}: stalled (its log did not grow for the stall limit) after {self.wall_s:.0f} s and was killed; last log line: {self.last_line!r}"
        if self.status == "cut":
            return f"{self.name}{where}: still running at the deadline after {self.wall_s:.0f} s and was killed; last log line: {self.last_line!r}"
        if self.status == "not_started":
            return f"{self.name}: not started (too little time left before the deadline)"
        return f"{self.name}{where}: done in {self.wall_s:.0f} s"


def last_line(path: Path, max_bytes: int = 4096) -> str:
    """The last non-empty line of `path` (tqdm's carriage returns count as line ends)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - max_bytes))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


class _Running:
    def __init__(self, job: Job, slot: str | None, env: dict) -> None:
        self.job, self.slot = job, slot
        job.log.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(job.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # a log, appended to (not a result file)
        try:
            # a new process session, so that the kill takes the job's own children (torchrun ranks) too
            self.proc = subprocess.Popen([sys.executable, *job.argv], env=env, stdout=log_fd, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        finally:
            os.close(log_fd)
        self.start = self.last_growth = time.time()
        self.size = -1

    def grew(self, now: float) -> None:
        try:
            size = self.job.log.stat().st_size
        except OSError:
            size = -1
        if size != self.size:
            self.size, self.last_growth = size, now

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()

    def outcome(self, status: str) -> JobOutcome:
        return JobOutcome(self.job.name, status, self.proc.returncode, round(time.time() - self.start, 1), self.slot,
                          last_line(self.job.log))  # fmt: skip


def _held_gib(running: list[_Running], slot: str | None) -> float:
    return sum(r.job.memory_gib for r in running if r.slot == slot)


def run_jobs(
    jobs: list[Job],
    slots: list[str | None],
    *,
    deadline: float,
    stall_s: float,
    poll_s: float = 1.0,
    status_every_s: float = 20.0,
    env: dict | None = None,
    prefix: str = "[jobs]",
    capacity_gib: dict[str, float] | None = None,
) -> list[JobOutcome]:
    """Run `jobs` in order, `len(slots)` at a time; return one outcome per job, in the jobs' order.

    Args:
        jobs: the work, in priority order (a job starts only when a slot is free).
        slots: one entry per concurrent process: a GPU index as a string (set as `CUDA_VISIBLE_DEVICES`)
            or None (the environment as given).
        deadline: epoch seconds after which running jobs are killed (`cut`) and none starts.
        stall_s: a running job whose log has not grown for this long is killed (`stalled`).
        capacity_gib: GPU index -> GiB its jobs may hold together; a job waits until a free slot's GPU has room
            for its `memory_gib`, and smaller jobs behind it may start in the room left (a job that fits always
            starts before those behind it, so freed room goes to the first waiting job that fits).
    """
    if not slots:
        raise ValueError("run_jobs: slots must hold at least one entry (a GPU index or None)")
    if stall_s <= 0:
        raise ValueError(f"run_jobs: stall_s ({stall_s}) must be > 0")
    capacity_gib = capacity_gib or {}
    too_big = [j.name for j in jobs if all(j.memory_gib > capacity_gib.get(slot, float("inf")) for slot in set(slots))]
    if too_big:
        raise ValueError(f"run_jobs: job(s) {too_big} need more GPU memory than any GPU has for jobs ({capacity_gib} GiB)")
    base_env = dict(os.environ if env is None else env)
    pending = list(jobs)
    free = list(slots)
    running: list[_Running] = []
    outcomes: dict[str, JobOutcome] = {}
    last_status = time.time()
    while pending or running:
        now = time.time()
        for job in list(pending):  # in order; a job that does not fit (memory) lets the ones behind it try
            if not free:
                break
            if deadline - now < job.time_needed():
                pending.remove(job)
                outcomes[job.name] = JobOutcome(job.name, "not_started")
                continue
            fitting = [s for s in free if _held_gib(running, s) + job.memory_gib <= capacity_gib.get(s, float("inf"))]
            if not fitting:
                continue
            slot = fitting[0]
            pending.remove(job)
            free.remove(slot)
            job_env = dict(base_env)
            if slot is not None:
                job_env["CUDA_VISIBLE_DEVICES"] = slot
            running.append(_Running(job, slot, job_env))
            print(f"{prefix} started {job.name}" + (f" on GPU {slot}" if slot is not None else ""), flush=True)
        time.sleep(poll_s)
        now = time.time()
        for r in list(running):
            r.grew(now)
            status = None
            if r.proc.poll() is not None:
                status = "done" if r.proc.returncode == 0 else "failed"
            elif now >= deadline:
                r.kill()
                status = "cut"
            elif now - r.last_growth > stall_s:
                r.kill()
                status = "stalled"
            if status is not None:
                running.remove(r)
                free.append(r.slot)
                outcomes[r.job.name] = r.outcome(status)
                print(f"{prefix} {outcomes[r.job.name].describe()}", flush=True)
        if running and now - last_status >= status_every_s:
            last_status = now
            states = "; ".join(f"{r.job.name} {now - r.start:.0f} s: {last_line(r.job.log)[:80]}" for r in running)
            skipped = sum(o.status == "not_started" for o in outcomes.values())
            print(f"{prefix} {len(outcomes) - skipped} finished, {skipped} left for lack of time, {len(pending)} waiting, "
                  f"running: {states}", flush=True)  # fmt: skip
    return [outcomes[job.name] for job in jobs]
