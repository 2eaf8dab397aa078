"""The routed experts of a few tokens computed straight from the router's top-k: an eager decode step's experts.

Shape legend: T tokens, k experts per token, L local experts, H hidden, I expert width.

The grouped path (`triton_expert_mlp.expert_mlp_triton`) first lays the (token, expert) pairs out by expert (a Triton
sort), then runs three tuned grouped GEMM launches around it, each planned and checked on the host. At decode sizes
the GPU is done long before the host: an eager `generate()` step on one GPU is host time, and the MoE block's share
of it is what occult adds to transformers' own. Here two launches with fixed blocks read each pair's expert by its id:

- `topk_gate_up_kernel`: hw[p] = w[p] * act(x[t] @ gate_e^T) * (x[t] @ up_e^T) for pair p = (t, j), e = ids[t, j];
- `topk_down_kernel`: out[t] = sum over j of hw[(t, j)] @ down_e^T, in fp32 in slot order.

Each pair reads its expert's weights, so two pairs of one expert read them twice (concurrent programs find them in
L2): `LocalExperts` takes this path only up to `TOPK_PAIRS_PER_EXPERT` pairs per local expert (a decode step; a
longer input goes the grouped way). Forward only, no gradient (`generate()` runs under `no_grad`), and eager only: a
compiled model keeps the grouped path's custom operators (docs/kernels.md, "Decode sizes in eager").
"""

from __future__ import annotations

import torch

from . import triton_expert_mlp_kernels as _kernels
from .triton_launch import launch
from .triton_support import cdiv, interpreting

#: output columns a program computes, and weights of each row read a step (compiled kernels, one pipeline stage,
#: 4 warps): of 36 launch configurations on the H200, the gate/up kernel's fastest or within 5% of it at the OLMoE
#: and Qwen1.5 shapes from 1 to 64 tokens, and the down kernel's at batch 1 (docs/kernels.md, "Decode sizes in
#: eager"); interpreted, 8 x 16, so that the tests' tiny shapes span several blocks
BLOCK_N, BLOCK_K, NUM_STAGES = 8, 1024, 1
INTERPRETED_BLOCK_K = 16


def expert_mlp_topk(
    x_TH: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """`[T, H]` in x's dtype: each token's weighted sum of its k experts' outputs (`local_experts`' result for the
    layout of this top-k). x and the weights share one dtype and device; x has unit stride along H."""
    num_tokens, top_k = topk_ids_Tk.shape
    hidden, width = down_proj_LHI.shape[1], down_proj_LHI.shape[2]
    ids_N = topk_ids_Tk.reshape(-1)
    weights_N = topk_weights_Tk.reshape(-1)
    hw_NI = torch.empty(num_tokens * top_k, width, dtype=x_TH.dtype, device=x_TH.device)
    out_TH = torch.empty(num_tokens, hidden, dtype=x_TH.dtype, device=x_TH.device)
    if num_tokens == 0 or top_k == 0:
        return out_TH.zero_()
    block_k = INTERPRETED_BLOCK_K if interpreting() else BLOCK_K
    launch(
        _kernels.topk_gate_up_kernel, (num_tokens * top_k, cdiv(width, BLOCK_N)),
        x_TH, ids_N, weights_N, gate_up_proj_L2IH, hw_NI, hidden, width, x_TH.stride(0), *gate_up_proj_L2IH.stride(),
        TOP_K=top_k, ACTIVATION=_kernels.ACTIVATIONS[activation], BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4, num_stages=NUM_STAGES,
    )  # fmt: skip
    launch(
        _kernels.topk_down_kernel, (num_tokens, cdiv(hidden, BLOCK_N)),
        hw_NI, ids_N, down_proj_LHI, out_TH, hidden, width, *down_proj_LHI.stride(), out_TH.stride(0),
        TOP_K=top_k, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out_TH


__all__ = ["expert_mlp_topk"]
