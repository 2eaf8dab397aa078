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

from typing import NamedTuple

import torch

from . import triton_expert_mlp_kernels as _kernels
from .triton_launch import launch
from .triton_support import cdiv, interpreting


class TopKTiles(NamedTuple):
    """A launch configuration of both top-k kernels: output columns a program computes (`block_n`), weights of each
    row read a step (`block_k`), warps and pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: of 36 launch configurations on the H200, the gate/up kernel's fastest or within 5% of it at the OLMoE and Qwen1.5
#: shapes from 1 to 64 tokens, and the down kernel's at batch 1 (docs/kernels.md, "Decode sizes in eager");
#: interpreted, 8 x 16, so that the tests' tiny shapes span several blocks
SHIPPED_TILES = TopKTiles(block_n=8, block_k=1024, num_warps=4, num_stages=1)
INTERPRETED_TILES = SHIPPED_TILES._replace(block_k=16)


def launch_topk_gate_up(x_TH, ids_N, weights_N, gate_up_proj_L2IH, hw_NI, top_k: int, activation: str, tiles: TopKTiles) -> None:
    """hw_NI[p] = w[p] * act(gate) * up of pair p's expert, one program per (pair, `block_n` columns)."""
    hidden, width = x_TH.shape[1], hw_NI.shape[1]
    launch(
        _kernels.topk_gate_up_kernel, (ids_N.numel(), cdiv(width, tiles.block_n)),
        x_TH, ids_N, weights_N, gate_up_proj_L2IH, hw_NI, hidden, width, x_TH.stride(0), *gate_up_proj_L2IH.stride(),
        TOP_K=top_k, ACTIVATION=_kernels.ACTIVATIONS[activation], BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def launch_topk_down(hw_NI, ids_N, down_proj_LHI, out_TH, top_k: int, tiles: TopKTiles) -> None:
    """out_TH[t] = the sum over token t's k pairs of hw @ down_e^T, one program per (token, `block_n` columns)."""
    hidden, width = down_proj_LHI.shape[1], down_proj_LHI.shape[2]
    launch(
        _kernels.topk_down_kernel, (out_TH.shape[0], cdiv(hidden, tiles.block_n)),
        hw_NI, ids_N, down_proj_LHI, out_TH, hidden, width, *down_proj_LHI.stride(), out_TH.stride(0),
        TOP_K=top_k, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


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
    hw_NI = torch.empty(num_tokens * top_k, width, dtype=x_TH.dtype, device=x_TH.device)
    out_TH = torch.empty(num_tokens, hidden, dtype=x_TH.dtype, device=x_TH.device)
    if num_tokens == 0 or top_k == 0:
        return out_TH.zero_()
    tiles = INTERPRETED_TILES if interpreting() else SHIPPED_TILES
    launch_topk_gate_up(x_TH, ids_N, topk_weights_Tk.reshape(-1), gate_up_proj_L2IH, hw_NI, top_k, activation, tiles)
    launch_topk_down(hw_NI, ids_N, down_proj_LHI, out_TH, top_k, tiles)
    return out_TH


__all__ = ["SHIPPED_TILES", "TopKTiles", "expert_mlp_topk", "launch_topk_down", "launch_topk_gate_up"]
