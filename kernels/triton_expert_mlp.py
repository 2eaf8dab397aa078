"""The local expert computation in Triton, forward and backward (docs/design.md §3 step 5).

Shape legend (docs/conventions.md): R received rows, N (row, local expert) pairs in segment order, L
local experts, H hidden, I expert width; local to this file: K the reduction length of a GEMM, F its
output width, Q its output height (`_segment_outer`).

    out[r] = sum over pairs p of row r: w[p] * down_e(act(gate_e x[r]) * up_e x[r])

with act one of `ACTIVATIONS` (SiLU, GELU-tanh); `activation_name(act_fn)` maps a model's activation
module or function to its name and refuses, naming it, one the kernels do not implement.

Forward, two grouped GEMMs over the expert segments (`triton_expert_mlp_kernels.py`):
1. `gate_up_kernel` gathers x rows by `pair_row` and writes hw [N, I] = w[p] * act(gate) * up (the
   pair weight is a per-row scalar, so it can be applied before the down projection; then neither the
   down GEMM nor the down_proj gradient needs a scale), and, when a gradient is needed, the
   pre-activations gu [N, 2I] that the backward reads instead of recomputing a GEMM;
2. `scatter_gemm_kernel` multiplies hw by down_e and reduces into one fp32 row per received row (see
   `REDUCE_MODES`): by writing the pair outputs y [N, H] (in x's dtype by default, in fp32 when
   `deterministic=True`) and summing each row's pairs in fp32 in pair order (`segment_sum_kernel`,
   through a row -> pairs index built on the device), or by fp32 atomic adds in the GEMM epilogue
   (`reduce="atomic"`; the sum order, hence the last bits, vary between runs).

Backward: `dgate_up_kernel` (g = dout[row] @ down_e, then d gu, the pair-weight gradient and hw again
from the saved pre-activations), `scatter_gemm_kernel` again for dx = d gu @ gate_up_e reduced per
row, and `segment_outer_kernel` for both weight gradients (one program per output tile reduces a whole
expert segment, so weight gradients are deterministic in both modes).

Memory kept for the backward: the pre-activations gu [N, 2I] in x's dtype (plus the inputs, which
autograd keeps anyway, and the layout's index tensors); nothing else. hw [N, I], which the down_proj
gradient needs, is recomputed by the backward's first kernel from gu (an extra [N, I] store there)
instead of being kept from the forward. The forward's transient buffers: hw [N, I], and during each row
reduction y [N, H] (x's dtype, or fp32 when deterministic). No host synchronisation: tile schedules are
derived on the device from `expert_offsets` inside each kernel (only the first call per shape autotunes,
which syncs).

On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before triton is
first imported in the process), which is for tests; use `expert_mlp_reference` otherwise.

Under `torch.compile` the forward and the backward are two custom operators, `occult::expert_mlp_triton` and
`occult::expert_mlp_triton_backward` (the first's registered autograd formula calls the second), which take the
layout as tensors: dynamo traces `expert_mlp_triton` without a graph break, and nothing that depends on the number
of pairs (tile sizes, tuning keys, TMA) is decided in the traced code. Eager calls skip the operator dispatch (tens
of microseconds a call, against a few for an autograd Function) and run the same two functions
(`_forward`, `_backward`) through `_ExpertMLPFunction`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import triton
from triton.runtime.autotuner import Heuristics
from triton.runtime.jit import JITFunction

from . import triton_expert_mlp_kernels as _kernels
from .activations import ACTIVATIONS, activation_name
from .layout import ExpertSegments, check_expert_shapes, row_index
from .op_support import EagerExpertFunction, define_expert_operators
from .triton_launch import TensorDescriptor, launch  # TensorDescriptor None: older Triton, no TMA configs tuned
from .triton_support import cdiv, interpreting, next_power_of_2

#: allocator of every buffer the kernels must fill completely (tests swap in a NaN-filled one)
_empty = torch.empty
#: mean pairs per expert from which the GEMMs get tensor descriptors and may tune their TMA configs
#: (below it the weights stream through the small-T tiles, and a descriptor per launch is host time)
TMA_MIN_ROWS = 128
#: pairs a program of `pair_weight_grad_kernel` sums (a copy-speed pass over [N, I / 64] fp32 partial sums)
PAIR_WEIGHT_GRAD_BLOCK_M = 64


def _descriptor(matrix: torch.Tensor):
    """A tensor descriptor of a 2-D tensor with a placeholder block (each config's pre-hook sets its
    own), or None where TMA cannot read it: rows not 16-byte aligned, or a non-unit last stride."""
    if TensorDescriptor is None or matrix.dim() != 2 or min(matrix.shape) == 0 or matrix.stride(1) != 1:
        return None
    if matrix.data_ptr() % 16 or (matrix.stride(0) * matrix.element_size()) % 16:
        return None
    return TensorDescriptor(matrix, list(matrix.shape), list(matrix.stride()), [16, 16])


def _expert_matrix(w_LKF: torch.Tensor):
    """(descriptor, B_K_AXIS) of a per-expert operand B_e = w[e] [K, F] as one 2-D matrix: its
    storage [L * K, F] (axis 0 is K) or, for a transposed view, [L * F, K] (axis 1 is K); (None, 0)
    when the experts are not dense in memory or TMA cannot read it."""
    num_experts, k, f = w_LKF.shape
    if w_LKF.stride() == (k * f, f, 1):
        return _descriptor(w_LKF.reshape(num_experts * k, f)), 0
    if w_LKF.stride() == (k * f, 1, k):
        return _descriptor(w_LKF.transpose(1, 2).reshape(num_experts * f, k)), 1
    return None, 0


def _rows_per_expert_bucket(num_pairs: int, num_experts: int) -> int:
    """Autotuning key for the segment lengths: mean pairs per expert, rounded up to a power of two."""
    return min(next_power_of_2(max(1, num_pairs // max(1, num_experts))), 1 << 16)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full fp32 products (the tests' 1e-4 bar); tf32 would change the function.
    return "ieee" if dtype == torch.float32 else "tf32"


#: How pair outputs are reduced into rows. "atomic": fp32 atomic adds in the GEMM epilogue into an
#: fp32 [R, F] buffer (sum order varies between runs). "rows_fp32": each pair's fp32 output written
#: to [N, F] and each row's pairs summed in fp32 in pair order. "rows_io": the same with the pair
#: outputs rounded to x's dtype before the fp32 sum (half the bytes; the reference rounds the down
#: projection's output to x's dtype too). Both "rows" modes are bitwise repeatable.
REDUCE_MODES = ("atomic", "rows_fp32", "rows_io")
#: reduce mode of `deterministic=True`: fp32 pair outputs, fixed order
DETERMINISTIC_REDUCE = "rows_fp32"
#: reduce mode of `deterministic=False`: as fast as atomics or faster at large T, and repeatable as well
#: (docs/bench_experts_h200.md)
FAST_REDUCE = "rows_io"


@dataclass(frozen=True)
class LaunchPlan:
    """What every kernel launch of one call shares (tensors already validated and contiguous)."""

    pair_row_N: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: int
    reduce: str
    activation: int  # constexpr code of the activation (`_kernels.ACTIVATIONS`)
    rows_per_expert: int
    block_experts: int
    tma: bool  # long enough segments for the TMA configs (`TMA_MIN_ROWS`)
    # row -> pairs index (deterministic mode): pairs sorted by row, and each row's range in it
    row_pairs_N: torch.Tensor | None
    row_offsets: torch.Tensor | None

    @property
    def num_pairs(self) -> int:
        return self.pair_row_N.shape[0]

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.shape[0] - 1

    @functools.cached_property
    def segments_end(self) -> torch.Tensor:
        """`expert_offsets[L:]`: the one-element view the kernels read the segments' end from (made once per
        call, not once per launch)."""
        return self.expert_offsets[self.num_experts :]

    def m_tiles_bound(self, block_m: int) -> int:
        """Upper bound on sum_e cdiv(count_e, block_m), known without reading the counts."""
        return cdiv(self.num_pairs, block_m) + min(self.num_experts, self.num_pairs)


#: (autotuned kernel, launch key) -> (the tuning cache the choice came from, the config the tuner chose, the
#: direct launches of that config by constexprs: `_direct`'s result)
_CHOSEN: dict[tuple, tuple[dict, triton.Config, dict]] = {}


def run_tuned(kernel, grid, key: tuple, *args, **constexprs) -> triton.Config:
    """Launch the autotuned `kernel`; returns the config that ran. `key` stands for the tuner's own key
    at this call site (the values the tuner is keyed on, and the tensors' dtypes).

    The first launch per key goes through the autotuner, which tunes once per key; later launches run
    the config it chose as a compiled kernel (`triton_launch.launch`), with the values of the kernel's
    `triton.heuristics` and its defaulted constexprs worked out once per (key, constexprs) (`_direct`), and
    the config's pre-hook run only where an argument is a tensor descriptor (the hook sets their block
    shapes). The autotuner's per-call Python (two dicts of every argument, its key with each tensor's dtype
    as a string, a third dict for the pre-hook) and `JITFunction.run`'s binding are host time on every
    launch, and at small T the host's time is the call's time (docs/bench_experts_h200.md). A replaced
    tuning cache (tests and `--compare-candidates` swap in an empty one to re-tune) makes the next launch
    go through the tuner again."""
    descriptors = TensorDescriptor is not None and TensorDescriptor in map(type, args)
    if descriptors and args[0].is_cuda:
        _bind_cuda_context(args[0].device)
    chosen = _CHOSEN.get((kernel, key))
    if chosen is None or chosen[0] is not kernel.cache:
        kernel[grid](*args, **constexprs)
        _CHOSEN[(kernel, key)] = (kernel.cache, kernel.best_config, {})
        return kernel.best_config
    _, config, directs = chosen
    kernel.best_config = config
    constexpr_key = tuple(constexprs.items())
    if constexpr_key not in directs:
        directs[constexpr_key] = _direct(kernel, config, args, constexprs)
    direct = directs[constexpr_key]
    if config.pre_hook is not None and (direct is None or descriptors):
        config.pre_hook({**dict(zip(kernel.arg_names, args)), **constexprs, **config.all_kwargs()})
    if direct is None:
        kernel.fn[grid](*args, **constexprs, **config.all_kwargs())
        return config
    function, meta = direct
    launch(function, grid(meta), *args, **constexprs, **meta)
    return config


#: per thread: the CUDA devices whose primary context `_bind_cuda_context` made current
_BOUND = threading.local()


def _bind_cuda_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current on this thread (once per thread and device).

    Triton encodes a host tensor descriptor (`cuTensorMapEncodeTiled`) before its launcher makes the context
    current, and on a thread whose first CUDA work is that launch the encoding fails ("Failed to create tensor
    map descriptor: invalid device context"). Autograd runs the backward on a thread of its own, so in a forward +
    backward whose dgate_up key was tuned on the main thread the backward's first kernel is a direct launch with a
    descriptor (a backward that tunes first gets the context from the tuner's timing calls)."""
    bound = _BOUND.__dict__.setdefault("devices", set())
    if device.index not in bound:
        torch.cuda.current_stream(device).query()  # a CUDA runtime call: binds the primary context
        bound.add(device.index)


def _direct(kernel, config: triton.Config, args: tuple, constexprs: dict) -> tuple[JITFunction, dict] | None:
    """(the `triton.jit` function under `kernel`'s heuristics, every parameter after `args` that the call
    does not pass: the config's kwargs and options, the heuristics' values and the defaulted constexprs),
    for launching `config` directly; None if `kernel.fn` is not such a chain. The heuristics are evaluated
    here once, on this call's arguments: they read only values of the tuning key (K), the constexprs and the
    config (`EVEN_K`, `A_TMA`, `B_TMA` of `triton_expert_mlp_kernels`), all part of the cache key."""
    function, meta = kernel.fn, config.all_kwargs()
    named = {**dict(zip(kernel.arg_names, args)), **constexprs, **meta}
    while isinstance(function, Heuristics):
        for name, rule in function.values.items():
            meta[name] = named[name] = rule(named)
        function = function.fn
    if not isinstance(function, JITFunction):
        return None
    for name, parameter in inspect.signature(function.fn).parameters.items():
        if name not in named and parameter.default is not inspect.Parameter.empty:
            meta[name] = parameter.default  # `launch` passes every parameter after the positional ones
    return function, meta


def _gate_up(plan: LaunchPlan, x_RH, gate_up_L2IH, pair_weight_N, save_gu: bool):
    """hw [N, I] = w * act(gate) * up and, when `save_gu`, the pre-activations gu [N, 2I] (else None)."""
    num_pairs, intermediate = plan.num_pairs, gate_up_L2IH.shape[1] // 2
    hw_NI = _empty(num_pairs, intermediate, dtype=x_RH.dtype, device=x_RH.device)
    gu_N2I = _empty(num_pairs, 2 * intermediate, dtype=x_RH.dtype, device=x_RH.device) if save_gu else None
    grid = lambda meta: (plan.m_tiles_bound(meta["BLOCK_M"]) * cdiv(intermediate, meta["BLOCK_N"]),)  # noqa: E731
    run_tuned(
        _kernels.gate_up_kernel, grid, (x_RH.dtype, x_RH.shape[1], intermediate, plan.rows_per_expert, save_gu),
        x_RH, plan.pair_row_N, plan.expert_offsets, gate_up_L2IH, pair_weight_N, hw_NI, gu_N2I if save_gu else hw_NI,
        plan.num_experts, x_RH.shape[1], intermediate, plan.rows_per_expert,
        x_RH.stride(0), *gate_up_L2IH.stride(),
        SAVE_GU=save_gu, ACTIVATION=plan.activation, DOT_PRECISION=_dot_precision(x_RH.dtype), BLOCK_E=plan.block_experts,
    )  # fmt: skip
    return hw_NI, gu_N2I


def _scatter_gemm(plan: LaunchPlan, a_NK, b_LKF, out_dtype):
    """out [R, F] = per row r, sum over its pairs p of a[p] @ b[e(p)], reduced in fp32.

    `b_LKF` is any strided view with B_e = b[e] of shape [K, F].
    """
    num_out = b_LKF.shape[2]
    device = a_NK.device
    atomic = plan.reduce == "atomic"
    if atomic:
        target = torch.zeros(plan.num_rows, num_out, dtype=torch.float32, device=device)
    else:
        pair_dtype = torch.float32 if plan.reduce == "rows_fp32" else out_dtype
        target = _empty(plan.num_pairs, num_out, dtype=pair_dtype, device=device)
    a_desc, (b_desc, b_k_axis) = (_descriptor(a_NK), _expert_matrix(b_LKF)) if plan.tma else (None, (None, 0))
    tma_ok = a_desc is not None and b_desc is not None
    grid = lambda meta: (plan.m_tiles_bound(meta["BLOCK_M"]) * cdiv(num_out, meta["BLOCK_N"]),)  # noqa: E731
    run_tuned(
        _kernels.scatter_gemm_kernel, grid, (a_NK.dtype, target.dtype, a_NK.shape[1], num_out, plan.rows_per_expert, atomic, tma_ok),
        a_NK, plan.pair_row_N, plan.expert_offsets, b_LKF, target, a_desc if tma_ok else None, b_desc if tma_ok else None,
        plan.num_experts, a_NK.shape[1], num_out, plan.rows_per_expert,
        a_NK.stride(0), *b_LKF.stride(), target.stride(0),
        ATOMIC=atomic, TMA_OK=tma_ok, B_K_AXIS=b_k_axis, DOT_PRECISION=_dot_precision(a_NK.dtype),
        BLOCK_E=plan.block_experts,
    )  # fmt: skip
    if atomic:
        return target.to(out_dtype)
    return row_sum(plan, target, out_dtype)


def row_sum(plan: LaunchPlan, y_NF: torch.Tensor, out_dtype) -> torch.Tensor:
    """[R, F] in `out_dtype`: each row's pair rows of y summed in fp32, in pair order (`segment_sum_kernel`,
    through the plan's row -> pairs index); rows served by no pair are zero. y's rows must be contiguous."""
    num_out = y_NF.shape[1]
    out = _empty(plan.num_rows, num_out, dtype=out_dtype, device=y_NF.device)
    grid = lambda meta: (cdiv(plan.num_rows, meta["BLOCK_R"]), cdiv(num_out, meta["BLOCK_H"]))  # noqa: E731
    run_tuned(
        _kernels.segment_sum_kernel, grid, (y_NF.dtype, num_out, plan.rows_per_expert),
        y_NF, plan.row_pairs_N, plan.row_offsets, out, plan.num_rows, num_out, y_NF.stride(0), out.stride(0),
        plan.rows_per_expert,
    )  # fmt: skip
    return out


def _dgate_up(plan: LaunchPlan, dout_RH, down_LHI, gu_N2I, pair_weight_N, write_hw: bool, weight_grad: bool):
    """d gu [N, 2I], when `weight_grad` the pair-weight gradient [N] in the weights' dtype (summed in fp32, zero
    for pairs past the segments; else None) and, when `write_hw`, hw [N, I] (else None)."""
    intermediate = down_LHI.shape[2]
    dgu_N2I = _empty(gu_N2I.shape, dtype=gu_N2I.dtype, device=gu_N2I.device)
    hw_NI = _empty(plan.num_pairs, intermediate, dtype=gu_N2I.dtype, device=gu_N2I.device) if write_hw else None
    # One partial sum per N tile of the narrowest candidate (`DGATE_UP_MIN_BLOCK_N`: any subset of the candidates
    # fits); the config that ran fills its own tiles' columns for every pair, and only those are summed (no zero fill).
    partial_NP = _empty(plan.num_pairs, cdiv(intermediate, _kernels.DGATE_UP_MIN_BLOCK_N), dtype=torch.float32, device=dout_RH.device)
    b_desc, _ = _expert_matrix(down_LHI) if plan.tma else (None, 0)
    grid = lambda meta: (plan.m_tiles_bound(meta["BLOCK_M"]) * cdiv(intermediate, meta["BLOCK_N"]),)  # noqa: E731
    config = run_tuned(
        _kernels.dgate_up_kernel, grid, (dout_RH.dtype, dout_RH.shape[1], intermediate, plan.rows_per_expert, write_hw, b_desc is not None),
        dout_RH, plan.pair_row_N, plan.expert_offsets, down_LHI, gu_N2I, pair_weight_N, dgu_N2I,
        hw_NI if write_hw else dgu_N2I, partial_NP, b_desc,
        plan.num_experts, dout_RH.shape[1], intermediate, plan.rows_per_expert,
        dout_RH.stride(0), *down_LHI.stride(), partial_NP.stride(0),
        WRITE_HW=write_hw, TMA_OK=b_desc is not None, ACTIVATION=plan.activation,
        DOT_PRECISION=_dot_precision(dout_RH.dtype), BLOCK_E=plan.block_experts,
    )  # fmt: skip
    if not weight_grad:
        return dgu_N2I, None, hw_NI
    dweight_N = _empty(plan.num_pairs, dtype=pair_weight_N.dtype, device=dout_RH.device)
    launch(
        _kernels.pair_weight_grad_kernel, (cdiv(plan.num_pairs, PAIR_WEIGHT_GRAD_BLOCK_M),),
        partial_NP, plan.segments_end, dweight_N, plan.num_pairs, cdiv(intermediate, config.kwargs["BLOCK_N"]),
        partial_NP.stride(0), BLOCK_M=PAIR_WEIGHT_GRAD_BLOCK_M, BLOCK_P=next_power_of_2(partial_NP.shape[1]),
    )  # fmt: skip
    return dgu_N2I, dweight_N, hw_NI


def _segment_outer(plan: LaunchPlan, a, b, *, gather_a: bool, gather_b: bool, out_dtype):
    """C [L, Q, F]: C_e = sum over pairs p of expert e of a[row_a(p)]^T b[row_b(p)]."""
    num_m, num_out = a.shape[1], b.shape[1]
    c_LQF = _empty(plan.num_experts, num_m, num_out, dtype=out_dtype, device=a.device)
    # the operand that is not gathered may come by TMA (its rows are the segment's consecutive pairs)
    desc = _descriptor(b if gather_a else a) if plan.tma and gather_a != gather_b else None
    a_desc, b_desc = (None, desc) if gather_a else (desc, None)
    grid = lambda meta: (plan.num_experts * cdiv(num_m, meta["BLOCK_M"]) * cdiv(num_out, meta["BLOCK_N"]),)  # noqa: E731
    run_tuned(
        _kernels.segment_outer_kernel, grid, (a.dtype, b.dtype, num_m, num_out, plan.rows_per_expert, gather_a, desc is not None),
        a, b, plan.pair_row_N, plan.expert_offsets, c_LQF, a_desc, b_desc,
        plan.num_experts, num_m, num_out, plan.rows_per_expert,
        a.stride(0), b.stride(0), c_LQF.stride(0), c_LQF.stride(1),
        GATHER_A=gather_a, GATHER_B=gather_b, TMA_OK=desc is not None,
        DOT_PRECISION=_dot_precision(a.dtype),
    )  # fmt: skip
    return c_LQF


def _forward(plan: LaunchPlan, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, save_gu: bool):
    """(out [R, H], gu [N, 2I] for the backward when `save_gu`, else None)."""
    if plan.num_pairs == 0:  # nothing to launch: every row is served by no pair
        return torch.zeros_like(x_RH), None
    hw_NI, gu_N2I = _gate_up(plan, x_RH, gate_up_L2IH, pair_weight_N, save_gu=save_gu)
    return _scatter_gemm(plan, hw_NI, down_LHI.transpose(1, 2), x_RH.dtype), gu_N2I  # hw is not kept: recomputed


def _backward(plan: LaunchPlan, dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, needs) -> tuple:
    """The gradients with respect to (x, pair weights, gate_up, down), each None where `needs` says False."""
    need_dx, need_dweight, need_dgate_up, need_ddown = needs
    if plan.num_pairs == 0:
        return tuple(torch.zeros_like(t) if need else None for t, need in zip((x_RH, pair_weight_N, gate_up_L2IH, down_LHI), needs))
    dout_RH = dout_RH.contiguous()
    dx = dgate_up = ddown = None
    # one kernel gives d gu (for dx, d gate_up), the pair-weight gradient and hw (for d down)
    dgu_N2I, dweight, hw_NI = _dgate_up(plan, dout_RH, down_LHI, gu_N2I, pair_weight_N, write_hw=need_ddown, weight_grad=need_dweight)
    if need_dx:
        dx = _scatter_gemm(plan, dgu_N2I, gate_up_L2IH, x_RH.dtype)
    if need_dgate_up:
        dgate_up = _segment_outer(plan, dgu_N2I, x_RH, gather_a=False, gather_b=True, out_dtype=gate_up_L2IH.dtype)
    del dgu_N2I
    if need_ddown:
        ddown = _segment_outer(plan, dout_RH, hw_NI, gather_a=True, gather_b=False, out_dtype=down_LHI.dtype)
    return dx, dweight, dgate_up, ddown


class _ExpertMLPFunction(EagerExpertFunction):
    """`_forward` / `_backward` for eager calls."""


def _operator_forward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, pair_row_N, expert_offsets, row_pairs_N, row_offsets, reduce, activation, save):
    plan = plan_from_tensors(pair_row_N, expert_offsets, x_RH.shape[0], reduce, activation, row_pairs_N, row_offsets)
    return _forward(plan, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, save)


def _operator_backward(dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, pair_row_N, expert_offsets, row_pairs_N, row_offsets, reduce, activation, needs):
    plan = plan_from_tensors(pair_row_N, expert_offsets, x_RH.shape[0], reduce, activation, row_pairs_N, row_offsets)
    return _backward(plan, dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, needs)


# occult::expert_mlp_triton and occult::expert_mlp_triton_backward (row_pairs_N / row_offsets None: atomic adds)
define_expert_operators(
    "expert_mlp_triton", "Tensor pair_row_N, Tensor expert_offsets, Tensor? row_pairs_N, Tensor? row_offsets",
    "str reduce, str activation", _operator_forward, _operator_backward,
)  # fmt: skip


def check_inputs(
    x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, caller: str = "expert_mlp_triton", activation: str = "silu"
) -> None:
    """The activation's name, shapes, dtypes and devices (never values: reading them would synchronise with the
    device; `layout.check_expert_shapes` and what the kernels add); `caller` is the entry point the errors name."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of the Triton kernels' activations {ACTIVATIONS}")
    check_expert_shapes(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)
    if x_RH.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"{caller}: x_RH dtype must be float32, bfloat16 or float16 (the Triton kernels' dtypes), got {x_RH.dtype}: "
            f"use expert_backend='torch' for {x_RH.dtype}"
        )
    if x_RH.dtype == torch.bfloat16 and interpreting():
        raise ValueError(
            f"{caller}: Triton's interpreter (TRITON_INTERPRET=1) multiplies bfloat16 matrices wrongly (a 16 x 16 tl.dot "
            "is off by a factor of 1e9: numpy has no bfloat16), so its result would be meaningless; use float32 or "
            "float16 under the interpreter, or expert_backend='torch'"
        )
    if x_RH.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{caller} runs on CUDA tensors (got {x_RH.device}); on CPU set TRITON_INTERPRET=1 "
            "(slow, for tests) or use expert_mlp_reference"
        )


def plan_launch(segments: ExpertSegments, reduce: str, activation: str = "silu") -> LaunchPlan:
    """What every launch of one call shares, the row -> pairs index included (`row_index_of`)."""
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce mode {reduce!r} is not one of {REDUCE_MODES}")
    return plan_from_tensors(segments.pair_row, segments.expert_offsets, segments.num_rows, reduce, activation, *row_index_of(segments, reduce))


def row_index_of(segments: ExpertSegments, reduce: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The row -> pairs index the row reductions read: the layout's own where it built one (`from_topk`), else built
    here (`layout.row_index`); none for atomic adds."""
    if reduce == "atomic" or segments.row_pairs is not None:
        return segments.row_pairs, segments.row_offsets
    return row_index(segments.pair_row, segments.num_rows)


def plan_from_tensors(pair_row_N, expert_offsets, num_rows: int, reduce: str, activation: str, row_pairs_N, row_offsets) -> LaunchPlan:
    """`plan_launch` from the layout's tensors (what the custom operators receive) and the row index."""
    num_pairs, num_experts = pair_row_N.shape[0], expert_offsets.shape[0] - 1
    return LaunchPlan(
        pair_row_N=pair_row_N.contiguous(),
        expert_offsets=expert_offsets.contiguous(),
        num_rows=num_rows,
        reduce=reduce,
        activation=_kernels.ACTIVATIONS[activation],
        rows_per_expert=_rows_per_expert_bucket(num_pairs, num_experts),
        tma=num_pairs >= TMA_MIN_ROWS * max(1, num_experts),
        block_experts=next_power_of_2(max(2, num_experts)),
        row_pairs_N=row_pairs_N,
        row_offsets=row_offsets,
    )


def expert_mlp_triton(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    deterministic: bool = False,
    *,
    reduce: str | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The local expert computation; same function as `expert_mlp_reference` with the same activation.

    Args:
        x_RH: `[R, H]` received rows (float32, bfloat16 or float16).
        segments: pairs grouped by local expert (`pair_row` `[N]` int64, `expert_offsets` `[L + 1]`
            int64 on x's device; offsets must be non-decreasing from 0 to N and rows in [0, R), which
            is not checked, since checking would synchronise).
        pair_weight_N: `[N]` routing weight of each pair, in segment order (any float dtype).
        gate_up_proj_L2IH: `[L, 2I, H]`, gate rows first, x's dtype.
        down_proj_LHI: `[L, H, I]`, x's dtype.
        deterministic: sum each row's pairs in a fixed order from fp32 pair outputs (bitwise
            repeatable for a given tuned configuration; one extra [N, H] fp32 buffer); otherwise the
            fastest reduction measured (`FAST_REDUCE`: pair outputs in x's dtype, fp32 sums, also
            repeatable; see `REDUCE_MODES`).
        reduce: one of `REDUCE_MODES`, overriding the choice `deterministic` makes (benchmarks, tests).
        activation: the experts' activation, one of `ACTIVATIONS` ("silu", "gelu_tanh"); map a model's
            `act_fn` with `activation_name`.

    Returns:
        `[R, H]` in x's dtype; rows served by no pair are zero. Differentiable with respect to x,
        pair_weight and both weights (Triton backward kernels).
    """
    check_inputs(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, activation=activation)
    if reduce is None:
        reduce = DETERMINISTIC_REDUCE if deterministic else FAST_REDUCE
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce mode {reduce!r} is not one of {REDUCE_MODES}")
    row_pairs_N, row_offsets = row_index_of(segments, reduce)
    inputs = (x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    x_RH, pair_weight_N = x_RH.contiguous(), pair_weight_N.contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.occult.expert_mlp_triton(
            x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, segments.pair_row, segments.expert_offsets,
            row_pairs_N, row_offsets, reduce, activation, save,
        )[0]  # fmt: skip
    plan = plan_from_tensors(segments.pair_row, segments.expert_offsets, segments.num_rows, reduce, activation, row_pairs_N, row_offsets)
    if not save:  # nothing to differentiate (decoding): the autograd function's host time would be the only effect
        return _forward(plan, x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, save_gu=False)[0]
    return _ExpertMLPFunction.apply(_forward, _backward, (plan,), save, x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)


def expert_mlp_triton_stages(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    reduce: str = FAST_REDUCE,
) -> dict[str, tuple[Callable[[], object], float]]:
    """The stages of `expert_mlp_triton`'s forward and backward as separate zero-argument callables,
    each with its FLOP count, for timing one by one (benchmarks); `reduce` is one of `REDUCE_MODES`.
    Inputs of later stages (hw, gu, a random dout, d gu) are prepared once here with the same kernels."""
    check_inputs(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)
    if segments.num_pairs == 0:
        raise ValueError("expert_mlp_triton_stages needs at least one pair (segments.num_pairs is 0)")
    x_RH, pair_weight_N = x_RH.detach().contiguous(), pair_weight_N.detach().contiguous()
    gate_up_L2IH, down_LHI = gate_up_proj_L2IH.detach(), down_proj_LHI.detach()
    plan = plan_launch(segments, reduce)
    pairs, hidden, inter = plan.num_pairs, x_RH.shape[1], down_LHI.shape[2]
    hw_NI, gu_N2I = _gate_up(plan, x_RH, gate_up_L2IH, pair_weight_N, save_gu=True)
    dout_RH = torch.randn_like(x_RH)
    dgu_N2I, _, _ = _dgate_up(plan, dout_RH, down_LHI, gu_N2I, pair_weight_N, write_hw=False, weight_grad=False)
    gemm = 2.0 * pairs * hidden * inter  # FLOPs of one [N, H] x [H, I] product
    stages = {
        "fwd: gather + gate_up GEMM + w*SiLU*up": (lambda: _gate_up(plan, x_RH, gate_up_L2IH, pair_weight_N, save_gu=False), 2 * gemm),
        "fwd: same, saving gate/up for bwd": (lambda: _gate_up(plan, x_RH, gate_up_L2IH, pair_weight_N, save_gu=True), 2 * gemm),
        "fwd: down GEMM + row reduce": (lambda: _scatter_gemm(plan, hw_NI, down_LHI.transpose(1, 2), x_RH.dtype), gemm),
        "bwd: dout @ down + act bwd + d weight + hw": (
            lambda: _dgate_up(plan, dout_RH, down_LHI, gu_N2I, pair_weight_N, write_hw=True, weight_grad=True),
            gemm,
        ),
        "bwd: dx GEMM + row reduce": (lambda: _scatter_gemm(plan, dgu_N2I, gate_up_L2IH, x_RH.dtype), 2 * gemm),
        "bwd: d gate_up_proj": (
            lambda: _segment_outer(plan, dgu_N2I, x_RH, gather_a=False, gather_b=True, out_dtype=gate_up_L2IH.dtype),
            2 * gemm,
        ),
        "bwd: d down_proj": (
            lambda: _segment_outer(plan, dout_RH, hw_NI, gather_a=True, gather_b=False, out_dtype=down_LHI.dtype),
            gemm,
        ),
    }
    if reduce != "atomic":
        stages = {"row -> pairs index (once per call)": (lambda: row_index(segments.pair_row, segments.num_rows), 0.0), **stages}
    return stages


__all__ = [
    "ACTIVATIONS", "REDUCE_MODES", "LaunchPlan", "activation_name", "check_inputs", "expert_mlp_triton",
    "expert_mlp_triton_stages", "plan_from_tensors", "plan_launch", "row_index_of", "row_sum", "run_tuned",
]  # fmt: skip
