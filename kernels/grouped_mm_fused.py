"""The local expert computation with PyTorch's grouped GEMMs and fused Triton kernels around them.

Shape legend: R received rows, N (row, local expert) pairs in segment order, L local experts, H hidden,
I expert width.

    out[r] = sum over pairs p of row r: w[p] * down_e(act(gate_e x[r]) * up_e x[r])

`torch._grouped_mm` (`grouped_mm_op()`) runs CUTLASS grouped GEMMs near the dense bf16 rate; in
transformers' grouped_mm experts and in `expert_mlp_grouped_mm` most of the time goes to the elementwise,
copy, gather and scatter kernels around them (docs/kernels.md, "grouped_mm_fused"). Here the GEMMs stay
CUTLASS's and the rest is one Triton pass each (`grouped_mm_fused_kernels.py`):

forward:  x_NH = gather(x, pair_row) -> gu = x_NH @ gate_up_e^T -> hw = w * act(gate) * up
          -> y_NH = hw @ down_e^T -> out[r] = fp32 sum of row r's pair rows of y (`segment_sum_kernel`)
backward: dy_NH = gather(dout, pair_row) -> g = dy_NH @ down_e -> d gu, d w and hw from g and the saved
          gu (one kernel) -> dx = per-row sum of d gu @ gate_up_e; d gate_up_e = d gu^T x_NH (x gathered
          again), d down_e = dy^T hw: the two weight gradients as grouped GEMMs over the segments of K.

The pair weight is applied in hw (a per-row scalar), so the weight gradient is <act(gate) * up, g>, which
the backward's elementwise kernel sums from values it holds anyway. Kept for the backward beyond the
inputs: the pre-activations gu [N, 2I] in x's dtype and the layout's index tensors (as the `triton`
backend keeps); the gathered rows and hw are recomputed. Pairs past `expert_offsets[L]` (the static
dispatch's empty slots, row R) are skipped by every kernel and get zero weight gradient.

Runs where `grouped_mm_op()` has a kernel for the operands: CUDA in bf16 (SM >= 8.0, 16-byte rows); on CPU
PyTorch's fallback runs bf16 and fp32, and the Triton pieces only under `TRITON_INTERPRET=1` (tests).
Both reductions are in a fixed order, so the result is bitwise repeatable whatever `deterministic` says.

Under `torch.compile` the forward and the backward are the custom operators `occult::expert_mlp_grouped_mm_fused`
and `occult::expert_mlp_grouped_mm_fused_backward` (registered autograd), as `triton_expert_mlp` does; eager calls
run the same `_forward` / `_backward` through `_GroupedMMFusedFunction`, without the operator dispatch.
"""

from __future__ import annotations

import torch

from . import grouped_mm_fused_kernels as _kernels
from .expert_mlp_reference import grouped_mm_op
from .layout import ExpertSegments
from .op_support import EagerExpertFunction, define_expert_operators
from .triton_expert_mlp import FAST_REDUCE, LaunchPlan, check_inputs, plan_from_tensors, row_index_of, row_sum, run_tuned
from .triton_launch import launch
from .triton_support import cdiv


def _gather_rows(plan: LaunchPlan, src_RH: torch.Tensor) -> torch.Tensor:
    """[N, H]: row pair_row[p] of src for every pair of the segments (later rows unwritten)."""
    hidden = src_RH.shape[1]
    out_NH = torch.empty(plan.num_pairs, hidden, dtype=src_RH.dtype, device=src_RH.device)
    grid = lambda meta: (cdiv(plan.num_pairs, meta["BLOCK_M"]), cdiv(hidden, meta["BLOCK_N"]))  # noqa: E731
    run_tuned(
        _kernels.gather_rows_kernel, grid, (src_RH.dtype, hidden, plan.rows_per_expert),
        src_RH, plan.pair_row_N, plan.segments_end, out_NH, plan.num_pairs, hidden,
        src_RH.stride(0), out_NH.stride(0), plan.rows_per_expert,
    )  # fmt: skip
    return out_NH


def _act_mul(plan: LaunchPlan, gu_N2I: torch.Tensor, pair_weight_N: torch.Tensor) -> torch.Tensor:
    """hw [N, I] = w * act(gate) * up."""
    intermediate = gu_N2I.shape[1] // 2
    hw_NI = torch.empty(plan.num_pairs, intermediate, dtype=gu_N2I.dtype, device=gu_N2I.device)
    grid = lambda meta: (cdiv(plan.num_pairs, meta["BLOCK_M"]), cdiv(intermediate, meta["BLOCK_N"]))  # noqa: E731
    run_tuned(
        _kernels.act_mul_kernel, grid, (gu_N2I.dtype, intermediate, plan.rows_per_expert, plan.activation),
        gu_N2I, pair_weight_N, plan.segments_end, hw_NI, plan.num_pairs, intermediate, plan.rows_per_expert,
        ACTIVATION=plan.activation,
    )  # fmt: skip
    return hw_NI


def _act_mul_backward(plan: LaunchPlan, g_NI, gu_N2I, pair_weight_N, write_hw: bool):
    """(d gu [N, 2I], the pair-weight gradient [N] in the weights' dtype (summed in fp32), hw [N, I] when
    `write_hw` else None)."""
    intermediate = g_NI.shape[1]
    dgu_N2I = torch.empty_like(gu_N2I)
    hw_NI = torch.empty_like(g_NI) if write_hw else None
    dweight_N = torch.empty_like(pair_weight_N)
    block_m, block_n = _kernels.ACT_BACKWARD_BLOCK
    launch(
        _kernels.act_mul_backward_kernel, (cdiv(plan.num_pairs, block_m),),
        g_NI, gu_N2I, pair_weight_N, plan.segments_end, dgu_N2I,
        hw_NI if write_hw else dgu_N2I, dweight_N, plan.num_pairs, intermediate,
        WRITE_HW=write_hw, ACTIVATION=plan.activation, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return dgu_N2I, dweight_N, hw_NI


def _forward(plan: LaunchPlan, ends_L, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, save_gu: bool):
    """(out [R, H], gu [N, 2I] for the backward when `save_gu`, else None); `ends_L`: grouped_mm's int32 offsets."""
    if plan.num_pairs == 0:  # nothing to launch: every row is served by no pair
        return torch.zeros_like(x_RH), None
    grouped_mm = grouped_mm_op()
    gu_N2I = grouped_mm(_gather_rows(plan, x_RH), gate_up_L2IH.transpose(1, 2), offs=ends_L)
    y_NH = grouped_mm(_act_mul(plan, gu_N2I, pair_weight_N), down_LHI.transpose(1, 2), offs=ends_L)
    # the gathered rows and hw are not kept: the backward recomputes them
    return row_sum(plan, y_NH, x_RH.dtype), gu_N2I if save_gu else None


def _backward(plan: LaunchPlan, ends_L, dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, needs) -> tuple:
    """The gradients with respect to (x, pair weights, gate_up, down), each None where `needs` says False."""
    need_dx, need_dweight, need_dgate_up, need_ddown = needs
    if plan.num_pairs == 0:
        return tuple(torch.zeros_like(t) if need else None for t, need in zip((x_RH, pair_weight_N, gate_up_L2IH, down_LHI), needs))
    grouped_mm = grouped_mm_op()
    dy_NH = _gather_rows(plan, dout_RH.contiguous())
    g_NI = grouped_mm(dy_NH, down_LHI, offs=ends_L)
    dgu_N2I, dweight_N, hw_NI = _act_mul_backward(plan, g_NI, gu_N2I, pair_weight_N, write_hw=need_ddown)
    del g_NI
    dweight = dweight_N if need_dweight else None
    dx = dgate_up = ddown = None
    if need_dx:
        dx = row_sum(plan, grouped_mm(dgu_N2I, gate_up_L2IH, offs=ends_L), x_RH.dtype)
    if need_dgate_up:  # [L, 2I, H]: segment e of d gu^T times segment e of the gathered rows
        dgate_up = grouped_mm(dgu_N2I.t(), _gather_rows(plan, x_RH), offs=ends_L)
    del dgu_N2I  # [N, 2I]: freed before the last GEMM, which lowers the backward's peak
    if need_ddown:
        ddown = grouped_mm(dy_NH.t(), hw_NI, offs=ends_L)
    return dx, dweight, dgate_up, ddown


class _GroupedMMFusedFunction(EagerExpertFunction):
    """`_forward` / `_backward` for eager calls."""


def _operator_forward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, pair_row_N, expert_offsets, ends_L, row_pairs_N, row_offsets, activation, save):
    plan = plan_from_tensors(pair_row_N, expert_offsets, x_RH.shape[0], FAST_REDUCE, activation, row_pairs_N, row_offsets)
    return _forward(plan, ends_L, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, save)


def _operator_backward(dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, pair_row_N, expert_offsets, ends_L, row_pairs_N, row_offsets, activation, needs):
    plan = plan_from_tensors(pair_row_N, expert_offsets, x_RH.shape[0], FAST_REDUCE, activation, row_pairs_N, row_offsets)
    return _backward(plan, ends_L, dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, needs)


# occult::expert_mlp_grouped_mm_fused and occult::expert_mlp_grouped_mm_fused_backward (ends_L: grouped_mm's offsets)
define_expert_operators(
    "expert_mlp_grouped_mm_fused", "Tensor pair_row_N, Tensor expert_offsets, Tensor ends_L, Tensor row_pairs_N, Tensor row_offsets",
    "str activation", _operator_forward, _operator_backward,
)  # fmt: skip


def expert_mlp_grouped_mm_fused(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """The local expert computation; same arguments, result and gradients as `expert_mlp_reference` with
    the activation given by name (one of `ACTIVATIONS`; `activation_name(act_fn)` maps a model's).

    `[R, H]` in x's dtype; rows served by no pair are zero; differentiable with respect to x, the pair
    weights and both weights. Needs `grouped_mm_op()` with a kernel for the operands (see the module)."""
    check_inputs(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, "expert_mlp_grouped_mm_fused", activation)
    if grouped_mm_op() is None:
        raise RuntimeError(f"expert_mlp_grouped_mm_fused needs torch.nn.functional.grouped_mm (torch {torch.__version__} has none)")
    row_pairs_N, row_offsets = row_index_of(segments, FAST_REDUCE)
    ends_L = segments.expert_offsets[1:].to(torch.int32)  # grouped_mm's offsets: the end of each expert's segment
    inputs = (x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    x_RH, pair_weight_N = x_RH.contiguous(), pair_weight_N.contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.occult.expert_mlp_grouped_mm_fused(
            x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, segments.pair_row, segments.expert_offsets, ends_L,
            row_pairs_N, row_offsets, activation, save,
        )[0]  # fmt: skip
    plan = plan_from_tensors(segments.pair_row, segments.expert_offsets, segments.num_rows, FAST_REDUCE, activation, row_pairs_N, row_offsets)
    return _GroupedMMFusedFunction.apply(_forward, _backward, (plan, ends_L), save, x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)


__all__ = ["expert_mlp_grouped_mm_fused"]
