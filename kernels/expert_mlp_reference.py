"""PyTorch reference for the local expert computation: the specification the Triton kernels match.

gather rows by local expert -> x @ gate_up^T -> act(gate) * up -> @ down^T -> * routing weight ->
fp32 accumulation into one output row per received row. Autograd through plain PyTorch ops gives
the gradients (input, both weights, routing weight) that the Triton backward must reproduce.

`expert_mlp_reference` loops over experts (one host sync for the offsets): the specification.
`expert_mlp_grouped_mm` computes the same function with torch's grouped GEMM (two launches for the
projections, no host sync): the fast PyTorch path on GPU and the baseline the kernels are timed against.
"""

from __future__ import annotations

import functools

from typing import Callable

import torch
import torch.nn.functional as F

from .layout import ExpertSegments


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
    out_RH = torch.zeros(segments.num_rows, x_RH.shape[1], dtype=torch.float32, device=x_RH.device)
    offsets = segments.expert_offsets.tolist()
    for expert in range(segments.num_local_experts):
        start, end = offsets[expert], offsets[expert + 1]
        if start == end:
            continue
        rows_n = segments.pair_row[start:end]
        gate, up = F.linear(x_RH[rows_n], gate_up_proj_L2IH[expert]).chunk(2, dim=-1)
        y_nH = F.linear(act_fn(gate) * up, down_proj_LHI[expert])
        y_nH = y_nH.float() * pair_weight_N[start:end, None].float()
        out_RH = out_RH.index_add(0, rows_n, y_nH)
    return out_RH.to(x_RH.dtype)


@functools.lru_cache(maxsize=1)
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
    y_NH = y_NH.float() * pair_weight_N[:, None].float()
    out_RH = torch.zeros(num_rows + 1, x_RH.shape[1], dtype=torch.float32, device=x_RH.device)  # row R: empty slots
    return out_RH.index_add(0, segments.pair_row, y_NH)[:num_rows].to(x_RH.dtype)


__all__ = ["expert_mlp_grouped_mm", "expert_mlp_reference", "grouped_mm_op"]
