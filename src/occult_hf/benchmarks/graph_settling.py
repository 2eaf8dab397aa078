"""Untimed `generate()` calls until CUDA-graph trees stop recording, so that a timed static-cache step is a replay.

transformers' static-cache `generate()` makes a new `StaticCache` in every call, allocated lazily in the eager
prefill. Its tensors are static inputs of the compiled decoding step, and CUDA-graph trees (the compile config's
`mode="reduce-overhead"`) replay a recorded graph only when every static input is where it was at recording. A call
whose cache lands at addresses no recorded graph has records a new one (a warm-up run and a capture, tens of
milliseconds), which a step derived from whole `generate()` calls would count, and each later step checks the graphs
recorded before until one matches. Once the caching allocator hands back addresses that a recorded graph has, calls
replay only; docs/compile_h200.md ("2026-12-04, 13:32-14:01 UTC") measures what timing the calls in between cost.

`settle` runs untimed pairs of calls until one pair records nothing (every rank agreeing under EP, whose ranks call
`generate()` in lockstep), and `counting_graph_recordings` counts the recordings, as torch announces each through
dynamo's callback handler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

#: untimed pairs of calls at most: a process still recording after these is timed anyway and its row says so
MAX_SETTLING_PAIRS = 8


@contextmanager
def counting_graph_recordings() -> Iterator[list[int]]:
    """`[n]`: the CUDA graphs that CUDA-graph trees recorded while inside (0 where nothing runs CUDA graphs)."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    recorded = [0]

    def count(event) -> None:
        if event.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
            recorded[0] += 1

    callback_handler.register_start_callback(count)
    try:
        yield recorded
    finally:
        callback_handler.remove_start_callback(count)


def settle(run_pair: Callable[[], object], recorded: list[int], device: torch.device) -> tuple[int, int]:
    """Call `run_pair()` until a call records no CUDA graph on any rank, at most `MAX_SETTLING_PAIRS` times;
    `(calls made, graphs recorded in them)`. `recorded` is a `counting_graph_recordings` count."""
    start = recorded[0]
    for pairs in range(1, MAX_SETTLING_PAIRS + 1):
        before = recorded[0]
        run_pair()
        if not recorded_on_any_rank(recorded[0] > before, device):
            break
    return pairs, recorded[0] - start


def recorded_on_any_rank(recorded: bool, device: torch.device) -> bool:
    """`recorded` on any rank of the default process group (this rank's alone without one): ranks that decode in
    lockstep must make the same number of untimed calls."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_world_size() == 1:
        return recorded
    flag = torch.tensor([int(recorded)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


__all__ = ["MAX_SETTLING_PAIRS", "counting_graph_recordings", "recorded_on_any_rank", "settle"]
