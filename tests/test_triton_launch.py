"""`triton_launch.launch`: one compiled kernel per specialization, called with the arguments in parameter order.

A stand-in kernel records what `kernel[grid]` (Triton's own path: binding, specialization, compilation) and the
compiled kernel's launcher receive, so the cache's distinctions are checked on CPU; the GPU tests of
tests/test_triton_kernels.py run the real compiled kernels through it (every call after a shape's first)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from occult_hf.kernels import triton_launch  # noqa: E402


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, launches: list):
        self.launches = launches

    def run(self, *launch_args):
        self.launches.append(launch_args)


class _Kernel:
    """Parameters (x_ptr, n, BLOCK): what a `triton.jit` function exposes to `launch`."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self):
        self.through_jit, self.launches = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.through_jit.append((grid, args, kwargs))
            return _Compiled(self.launches)

        return run


@pytest.fixture
def compiled_launches(monkeypatch):
    if triton_launch.knobs is None:
        pytest.skip("this Triton has no triton.knobs: every launch goes through kernel[grid]")
    monkeypatch.setattr(triton_launch, "_device_and_stream", lambda: (0, 1234))
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    monkeypatch.setattr(triton_launch, "_COMPILED", {})


def test_compiled_kernel_reused_per_specialization(compiled_launches):
    kernel, x = _Kernel(), torch.zeros(64)
    triton_launch.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    triton_launch.launch(kernel, (5, 2), x, 48, BLOCK=16, num_warps=4)  # 48 is a multiple of 16 too: same kernel
    assert len(kernel.through_jit) == 1
    assert kernel.launches == [(5, 2, 1, 1234, "function", "metadata", None, None, None, x, 48, 16)]
    # each of these compiles differently in Triton, so each goes through kernel[grid] once
    variants = [
        ((x, 40), {"BLOCK": 16, "num_warps": 4}),  # not a multiple of 16
        ((x, 1), {"BLOCK": 16, "num_warps": 4}),  # 1 is a constant
        ((x, 2**31 + 16), {"BLOCK": 16, "num_warps": 4}),  # 64-bit
        ((x[1:], 32), {"BLOCK": 16, "num_warps": 4}),  # address not 16-byte aligned
        ((x.half(), 32), {"BLOCK": 16, "num_warps": 4}),  # dtype
        ((x, 32), {"BLOCK": 32, "num_warps": 4}),  # constexpr
        ((x, 32), {"BLOCK": 16, "num_warps": 8}),  # option
    ]
    for args, constexprs in variants:
        triton_launch.launch(kernel, (1,), *args, **constexprs)
    assert len(kernel.through_jit) == 1 + len(variants) and len(kernel.launches) == 1


def test_defaulted_parameter_or_launch_hook_keeps_kernel_grid(compiled_launches, monkeypatch):
    kernel, x = _Kernel(), torch.zeros(16)
    for _ in range(2):  # BLOCK left to its default: the launcher's argument list is not known here
        triton_launch.launch(kernel, (1,), x, 16)
    monkeypatch.setattr(triton_launch.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    for _ in range(2):  # a profiler's hook wants Triton's launch metadata
        triton_launch.launch(kernel, (1,), x, 16, BLOCK=16)
    assert len(kernel.through_jit) == 4 and kernel.launches == []


class _TracedKernel(_Kernel):
    """`kernel[grid](...)` as dynamo traces it while `traced`: the launch goes into the graph and the call returns
    None instead of a compiled kernel (a stand-in: the real one needs a GPU, where `launch` caches)."""

    traced = True

    def __getitem__(self, grid):
        run = super().__getitem__(grid)
        return lambda *args, **kwargs: None if self.traced else run(*args, **kwargs)


def test_a_traced_launch_leaves_eager_launches_working(compiled_launches, monkeypatch):
    """After a traced launch (None from `kernel[grid]`) the same kernel launches eagerly: nothing cached None, whose
    `.run` failed every later eager launch of that key ("'NoneType' object has no attribute 'run'"). While
    torch.compile traces, every launch goes through `kernel[grid]`."""
    kernel, x = _TracedKernel(), torch.zeros(64)
    triton_launch.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    kernel.traced = False
    for _ in range(2):  # the first compiles through kernel[grid], the second runs the cached compiled kernel
        triton_launch.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    assert len(kernel.through_jit) == 1 and len(kernel.launches) == 1
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for _ in range(2):
        triton_launch.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    assert len(kernel.through_jit) == 3 and triton_launch._COMPILED == {}
