"""Capture a step once as a CUDA graph, the way `torch.cuda.graph` asks for it.

The warm-up runs on a side stream first (lazy initialisation, the caching allocator, Triton's autotuning,
communicators), so that the capture records only the step's kernels. One helper for the steps the package
replays: the load-aware replica rule's per-expert tables (`replicas.routing.GraphedRoutes`) and the benchmarks'
small-batch rows.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any], device, *, warmup: int, error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, Any]:
    """`(graph, out)`: `fn()` run `warmup` times on a side stream, then captured; `out` is what the captured call
    returned (tensors in the graph's own memory, rewritten by every `graph.replay()`).

    `error_mode` is `torch.cuda.graph`'s `capture_error_mode`: "thread_local" where another thread may touch
    CUDA during the capture (NCCL's watchdog queries events; under "global" that invalidates the capture).
    Every rank must capture the same collectives in the same order."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=error_mode):
        out = fn()
    return graph, out


__all__ = ["capture"]
