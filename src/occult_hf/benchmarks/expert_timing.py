"""How `occult bench experts` times one case: each implementation's plain call, in interleaved rounds at small T,
and the replay of a CUDA graph of the same call.

At small T a call is bounded by how fast the host issues its launches, and the device machine's host speed
drifts by tens of percent within minutes (docs/bench_experts_h200.md): timed one implementation after the
other, two rows of one case could see different hosts. Up to `INTERLEAVE_MAX_TOKENS` tokens the
implementations are therefore timed round by round (A B C, A B C, ...: `INTERLEAVE_ROUNDS` rounds, each with
that fraction of the warm-up and repetition time), and each row reports the median of its per-round medians,
so a drift hits every row of the case alike. The graph replay (`graph_replay_ms`) is the device's time alone,
launch gaps included, with no host: what a caller that captures its decode step in a CUDA graph sees. It is
extra information; the plain call is what the targets are judged on.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from occult_hf.utils.cuda_graph import capture

#: token counts up to which a case's implementations are timed in interleaved rounds
INTERLEAVE_MAX_TOKENS = 1024
#: rounds of the interleaved timing
INTERLEAVE_ROUNDS = 5


def cuda_timer(warmup_ms: float, rep_ms: float) -> Callable:
    """`timer(fn, grad_to_none=None, fraction=1.0)`: `triton.testing.do_bench`'s median ms, with `fraction` of
    the warm-up and repetition time (one round of an interleaved timing)."""
    import triton.testing

    def timer(fn, grad_to_none=None, fraction: float = 1.0) -> float:
        return triton.testing.do_bench(
            fn, warmup=warmup_ms * fraction, rep=rep_ms * fraction, grad_to_none=grad_to_none, return_mode="median"
        )

    return timer


def wall_timer(repeats: int = 3, warmup: bool = True) -> Callable:
    """Median wall-clock ms of `repeats` calls, after one warm-up call unless `warmup=False`; for CPU dry
    runs of the harness only (tests time one call: interpreted kernels take seconds each)."""

    def timer(fn, grad_to_none=None, fraction: float = 1.0) -> float:
        if warmup:
            fn()
        times = []
        for _ in range(repeats):
            for tensor in grad_to_none or ():
                tensor.grad = None
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return timer


def interleaved_ms(calls: dict[str, tuple[Callable, list]], timer: Callable, rounds: int) -> dict[str, float | Exception]:
    """name -> median over `rounds` rounds of `timer(fn, grad_to_none=leaves, fraction=1 / rounds)`, every
    name timed once per round in the order given; an implementation that raises gets its exception (and is
    left out of later rounds)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    failed: dict[str, Exception] = {}
    for _ in range(rounds):
        for name, (fn, leaves) in calls.items():
            if name in failed:
                continue
            try:
                times[name].append(timer(fn, grad_to_none=leaves, fraction=1.0 / rounds))
            except Exception as error:  # noqa: BLE001 - one failing implementation leaves a row that says why
                failed[name] = error
    return {name: failed.get(name) or statistics.median(times[name]) for name in calls}


def graph_replay_ms(fn: Callable, timer: Callable, grad_to_none: list | None = None) -> float | str:
    """ms of replaying a CUDA graph of one `fn()` call (`cuda_graph.capture`: warmed on a side stream first, the
    gradients of `grad_to_none` cleared before each call), or why there is none: not on CUDA, the call
    synchronises with the host (checked first, under `torch.cuda.set_sync_debug_mode("error")`), or the capture
    failed."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return "no CUDA"

    def clear():
        for tensor in grad_to_none or ():
            tensor.grad = None

    # a call that synchronises cannot be captured, and a capture that fails part-way can leave PyTorch's
    # CUDA random generator in its capture state for the rest of the process: such calls are not captured
    clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as error:
        return f"not captured: the call synchronises with the host ({' '.join(str(error).split())[:100]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")

    def cleared_call():
        clear()
        fn()

    try:
        graph, _ = capture(cleared_call, torch.cuda.current_device(), warmup=2)
    except Exception as error:  # noqa: BLE001 - the reason is the table's note
        torch.cuda.synchronize()
        return f"not capturable: {type(error).__name__}: {' '.join(str(error).split())[:120]}"
    try:
        return timer(graph.replay)
    finally:
        clear()
        del graph


__all__ = ["INTERLEAVE_MAX_TOKENS", "INTERLEAVE_ROUNDS", "cuda_timer", "graph_replay_ms", "interleaved_ms", "wall_timer"]
