"""PyTorch reference for the local expert computation: the specification the Triton kernels match.

gather rows by local expert -> x @ gate_up^T -> act(gate) * up -> @ down^T -> * routing weight ->
fp32 accumulation (fp64 for fp64 rows: `summing_dtype`) into one output row per received row. Autograd through plain PyTorch ops gives
the gradients (input, both weights, routing weight) that the Triton backward must reproduce.

`expert_mlp_reference` loops over experts (one host sync for the offsets): the specification.
`expert_mlp_grouped_mm` computes the same function with torch's grouped GEMM (two launches for the
projections, no host sync): the fast PyTorch path on GPU and the baseline the kernels are timed against.

`torch.compile` traces `expert_mlp_grouped_mm` as it is; the reference's host read of the offsets cannot be traced,
so `expert_mlp_reference_op` runs it as the custom operator `occult::expert_mlp_reference` (the activation by name,
`activations.TORCH_ACTIVATIONS`) with a backward operator, `occult::expert_mlp_reference_backward`, that recomputes
each expert's forward and applies the chain rule by PyTorch's own backward kernels: the gradients autograd gives the
reference, within fp32 rounding. The forward keeps nothing for the backward beyond its inputs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .activations import TORCH_ACTIVATIONS
from .layout import ExpertSegments
from .op_support import define_expert_operators


def expert_mlp_reference(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """Returns `[R, H]` in `x_RH.dtype`: the weighted sum of each row's local experts' outputs.

    `gate_up_proj_L2IH` is `[L, 2I, H]` (gate rows first, then up, as transformers 5 stores it);
    `down_proj_LHI` is `[L, H, I]`; `pair_weight_N` is `[N]` in segment order.
    """
    sum_dtype = summing_dtype(x_RH.dtype)
    out_RH = torch.zeros(segments.num_rows, x_RH.shape[1], dtype=sum_dtype, device=x_RH.device)
    offsets = segments.expert_offsets.tolist()
    computed = False
    for expert in range(segments.num_local_experts):
        start, end = offsets[expert], offsets[expert + 1]
        if start == end:
            continue
        rows_n = segments.pair_row[start:end]
        gate, up = F.linear(x_RH[rows_n], gate_up_proj_L2IH[expert]).chunk(2, dim=-1)
        y_nH = F.linear(act_fn(gate) * up, down_proj_LHI[expert])
        y_nH = y_nH.to(sum_dtype) * pair_weight_N[start:end, None].to(sum_dtype)
        out_RH = out_RH.index_add(0, rows_n, y_nH)
        computed = True
    if not computed:  # no pair: zeros still connected to the inputs, as the kernels' output is (zero gradients)
        out_RH = out_RH + _empty_sum(x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)
    return out_RH.to(x_RH.dtype)


def summing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the weighting and the sum of the experts' outputs run in: fp32 for bf16/fp16/fp32 rows (one rounding
    to the rows' dtype at the end), fp64 for fp64 rows (a float64 model keeps its precision, as stock's does)."""
    return torch.promote_types(dtype, torch.float32)


def _empty_sum(*tensors: torch.Tensor) -> torch.Tensor:
    """Exactly 0, with a (zero) gradient for each of `tensors`: the sum of an empty slice of each (never `0 * x`,
    which is NaN where x holds a static dispatch's stale rows). An expert computation that received no pair on one
    rank must still take part in the backward: the exchanges' backward on the other ranks waits for this one's."""
    return sum(tensor[:0].sum(dtype=torch.float32) for tensor in tensors)


def grouped_mm_op() -> Callable | None:
    """PyTorch's grouped GEMM (`F.grouped_mm`, or `torch._grouped_mm` before it was public), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_mlp_grouped_mm(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """Same arguments, result and gradients as `expert_mlp_reference`, through `grouped_mm`.

    Gathers the pair rows `[N, H]`, runs the two grouped GEMMs over the expert segments, and
    reduces the weighted pair outputs into one fp32 row per received row with `index_add`.

    Pairs past `expert_offsets[L]` (a static dispatch's empty slots, row `R`: `dispatch.static`) belong to no
    segment: they read a clamped row, and every `grouped_mm` output, whose rows past the last offset (and those of
    its input gradient) are left unwritten, is masked by a select (`torch.where`, whose backward selects too: no
    `0 * garbage`), so they reach neither the result nor a gradient; the count is never read on the host.
    """
    grouped_mm = grouped_mm_op()
    if grouped_mm is None:
        raise RuntimeError(f"expert_mlp_grouped_mm needs torch.nn.functional.grouped_mm (torch {torch.__version__} has none)")
    offsets_L = segments.expert_offsets[1:].to(torch.int32)  # end of each expert's segment
    num_rows = segments.num_rows
    in_segment_N1 = (torch.arange(segments.num_pairs, device=x_RH.device) < segments.expert_offsets[-1])[:, None]
    x_NH = torch.where(in_segment_N1, x_RH[segments.pair_row.clamp_max(max(num_rows - 1, 0))], 0)
    gu_N2I = torch.where(in_segment_N1, grouped_mm(x_NH, gate_up_proj_L2IH.transpose(1, 2), offs=offsets_L), 0)
    gate_NI, up_NI = gu_N2I.chunk(2, dim=-1)
    y_NH = torch.where(in_segment_N1, grouped_mm(act_fn(gate_NI) * up_NI, down_proj_LHI.transpose(1, 2), offs=offsets_L), 0)
    y_NH = y_NH.float() * pair_weight_N[:, None].float()  # bf16 only (`grouped_mm_supported`)
    out_RH = torch.zeros(num_rows + 1, x_RH.shape[1], dtype=torch.float32, device=x_RH.device)  # row R: empty slots
    return out_RH.index_add(0, segments.pair_row, y_NH)[:num_rows].to(x_RH.dtype)


def expert_mlp_reference_op(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """`expert_mlp_reference` as one custom operator, with the activation by name (one of `TORCH_ACTIVATIONS`):
    what `torch.compile` can trace (the module docstring)."""
    return torch.ops.occult.expert_mlp_reference(
        x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, segments.pair_row, segments.expert_offsets, activation, False
    )[0]


def _operator_forward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, pair_row_N, expert_offsets, activation, save):
    segments = ExpertSegments(pair_row_N, expert_offsets, x_RH.shape[0])
    act_fn = TORCH_ACTIVATIONS[activation][0]
    return expert_mlp_reference(x_RH, segments, pair_weight_N, gate_up_L2IH, down_LHI, act_fn), None  # keeps nothing


def _operator_backward(dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, _, pair_row_N, expert_offsets, activation, needs):
    """The reference's gradients (x, pair weights, gate_up, down; None where `needs` says False): per expert, the
    forward again and its chain rule, in the reference's dtypes (the weighting and the sum in `summing_dtype`)."""
    need_dx, need_dweight, need_dgate_up, need_ddown = needs
    act_fn, act_backward = TORCH_ACTIVATIONS[activation]
    sum_dtype = summing_dtype(x_RH.dtype)
    dout_RH = dout_RH.to(sum_dtype)  # the gradient of the reference's sum
    dx_RH = torch.zeros_like(x_RH) if need_dx else None
    dweight_N = torch.zeros_like(pair_weight_N) if need_dweight else None
    dgate_up_L2IH = torch.zeros_like(gate_up_L2IH) if need_dgate_up else None
    ddown_LHI = torch.zeros_like(down_LHI) if need_ddown else None
    offsets = expert_offsets.tolist()
    for expert in range(expert_offsets.shape[0] - 1):
        start, end = offsets[expert], offsets[expert + 1]
        if start == end:
            continue
        rows_n = pair_row_N[start:end]
        x_nH = x_RH[rows_n]
        gate_nI, up_nI = F.linear(x_nH, gate_up_L2IH[expert]).chunk(2, dim=-1)
        act_nI = act_fn(gate_nI)
        h_nI = act_nI * up_nI
        g_nH = dout_RH[rows_n]
        if need_dweight:
            y_nH = F.linear(h_nI, down_LHI[expert])
            dweight_N[start:end] = (g_nH * y_nH.to(sum_dtype)).sum(1).to(pair_weight_N.dtype)
        dy_nH = (g_nH * pair_weight_N[start:end, None].to(sum_dtype)).to(x_RH.dtype)
        if need_ddown:
            ddown_LHI[expert] = dy_nH.t() @ h_nI
        if not (need_dx or need_dgate_up):
            continue
        dh_nI = dy_nH @ down_LHI[expert]
        dgu_n2I = torch.cat([act_backward(dh_nI * up_nI, gate_nI), dh_nI * act_nI], dim=-1)
        if need_dx:
            dx_RH.index_add_(0, rows_n, dgu_n2I @ gate_up_L2IH[expert])
        if need_dgate_up:
            dgate_up_L2IH[expert] = dgu_n2I.t() @ x_nH
    return dx_RH, dweight_N, dgate_up_L2IH, ddown_LHI


# occult::expert_mlp_reference and occult::expert_mlp_reference_backward
define_expert_operators(
    "expert_mlp_reference", "Tensor pair_row_N, Tensor expert_offsets", "str activation", _operator_forward,
    _operator_backward, keeps_gu=False,
)  # fmt: skip


__all__ = ["expert_mlp_grouped_mm", "expert_mlp_reference", "expert_mlp_reference_op", "grouped_mm_op", "summing_dtype"]
