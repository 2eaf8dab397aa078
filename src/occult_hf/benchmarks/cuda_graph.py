"""Capture a benchmark step once as a CUDA graph: the small-batch path of `bench exchange` and `bench ep`,
where launch overhead is what is measured. Its own module so that both benchmarks import it from below."""

from __future__ import annotations

import torch


def graphed(fn, device, warmup: int = 3):
    """`fn` captured once in a CUDA graph; returns the graph's `replay`. The warm-up runs on a side stream
    (allocator, Triton autotuning, communicators), as `torch.cuda.graph` asks; every rank must capture the
    same collectives in the same order."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
