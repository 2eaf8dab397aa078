"""Launching compiled Triton kernels without `JITFunction.run`'s per-call Python.

`kernel[grid](*args)` binds every argument, works out the specialization of each (dtype and 16-byte alignment
of a tensor, whether an integer is 1 or a multiple of 16), packs the options, hashes all of that into a cache
key and looks the compiled kernel up, on every call: tens of microseconds of host time per launch, and at small
T the host's time is the call's time (docs/bench_experts_h200.md).

`launch` keeps the `CompiledKernel` of each specialization in a dict under a key it computes with a few
comparisons per argument (the same distinctions Triton's own specialization makes, `_specialization`), and
calls the compiled kernel's launcher directly. The first launch of each key, and every launch under the
interpreter, while Triton's launch hooks are set (a profiler such as proton) or while torch.compile traces, goes
through `kernel[grid]`; so the compiled kernel is always the one Triton would pick. Only a real
`CompiledKernel` is kept: a launch traced by dynamo returns None from `kernel[grid]`, and a cached None would fail
every later eager launch of that key.
"""

from __future__ import annotations

import torch

from .triton_support import interpreting

try:  # Triton >= 3.4 keeps the launch hooks in `knobs`
    from triton import knobs
except ImportError:  # pragma: no cover - older Triton: every launch goes through kernel[grid]
    knobs = None
try:  # host-made tensor descriptors (Triton >= 3.4), an argument kind of the TMA kernels
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: no descriptor is ever passed
    TensorDescriptor = None

#: (id of the kernel, device, argument specializations, constexprs and options) -> (compiled kernel, constexpr
#: names in parameter order after the positional arguments, the kernel). By id: a `JITFunction` hashes through
#: its `cache_key` property, a microsecond per launch; the kernel is kept in the value, so its id is never reused.
_COMPILED: dict[tuple, tuple[object, tuple[str, ...], object]] = {}


def _specialization(value) -> object:
    """What Triton compiles differently for: a tensor's dtype and whether its address is 16-byte aligned; an
    integer's width and whether it is 1 or a multiple of 16; a tensor descriptor's dtype, block shape, padding
    and the 16-divisibility of its shape and strides; anything else (floats, None, bools) by value, which
    distinguishes at least as much as Triton does. `_specializations` inlines the two common kinds."""
    kind = type(value)
    if kind is int:
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if kind is TensorDescriptor:
        return (
            value.base.dtype, value.base.data_ptr() % 16 == 0, tuple(value.block_shape), value.padding,
            getattr(value, "round_f32_to_tf32", False), tuple(size % 16 == 0 for size in (*value.shape, *value.strides)),
        )  # fmt: skip
    return value


def _specializations(args: tuple) -> tuple:
    """`_specialization` of every argument, with the integers and plain tensors (most of a GEMM's 15-25
    arguments) done inline: a Python call per argument would be a large share of `launch`'s host time."""
    return tuple(
        [
            (value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
            if type(value) is int
            else (value.dtype, value.data_ptr() % 16 == 0)
            if type(value) is torch.Tensor
            else _specialization(value)
            for value in args
        ]
    )


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and its current stream's handle, as Triton's launcher takes them (through
    torch's C functions, as Triton's own driver does: `torch.cuda.current_stream` builds a Stream object)."""
    device = torch._C._cuda_getDevice()
    return device, torch._C._cuda_getCurrentRawStream(device)


def _hook_set(hook) -> bool:
    """Whether a launch hook is installed: not None and, where Triton keeps a chain of hooks (3.9), not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    return _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)


def launch(kernel, grid: tuple[int, ...], *args, **constexprs) -> None:
    """`kernel[grid](*args, **constexprs)` for a `triton.jit` function (not an autotuner or heuristics wrapper)
    and a grid of 1-3 ints. `constexprs` may carry options (`num_warps`, `num_stages`) beside the kernel's
    constexpr parameters; every parameter after the positional `args` must be among them."""
    if knobs is None or interpreting() or _hooks_set() or torch.compiler.is_compiling():
        kernel[grid](*args, **constexprs)
        return
    device, stream = _device_and_stream()
    key = (id(kernel), device, _specializations(args), tuple(constexprs.items()))
    cached = _COMPILED.get(key)
    if cached is None:
        compiled = kernel[grid](*args, **constexprs)
        tail = tuple(kernel.arg_names[len(args) :])
        # a defaulted parameter keeps kernel[grid] for this kernel; so does a launch that gave no compiled kernel
        # (a traced call: under dynamo, kernel[grid] records the launch in the graph and returns None)
        if compiled is not None and set(tail) <= set(constexprs):
            _COMPILED[key] = (compiled, tail, kernel)
        return
    compiled, tail, _ = cached
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    compiled.run(
        grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *args, *map(constexprs.__getitem__, tail),
    )  # fmt: skip


__all__ = ["launch"]
