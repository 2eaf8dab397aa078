"""Triton kernels around PyTorch's grouped GEMMs (`grouped_mm_fused.py`): everything but the GEMMs.

Shape legend: R received rows, N (row, local expert) pairs in segment order, I expert width, H hidden.

Around the grouped GEMMs the PyTorch path costs elementwise and copy work (a gather of the pair rows, the chunk of
gate and up, `act(gate) * up`, a `.float()` and an fp32 `index_add`, and the autograd of each: docs/kernels.md).
These kernels do that work in one pass each:

- `gather_rows_kernel`  out[p] = src[index[p]] for the pairs of the segments (rows of pairs past the last
                        segment, whose index is R, stay unwritten: no GEMM reads them);
- `act_mul_kernel`      hw[p] = w[p] * act(gate[p]) * up[p] from the gate/up GEMM's output gu [N, 2I]
                        (gate columns first), the products in the order `gate_up_kernel` uses;
                        pairs past the segments (the static dispatch's empty slots) are skipped, as
                        the grouped GEMMs skip them;
- `act_mul_backward_kernel` from g[p] = dout[row p] @ down_e: d gu, the pair weight's gradient
                        <act(gate) * up, g> over the whole row in one program (no partial sums), and hw
                        again for the down_proj gradient; the tile arithmetic is the Triton backward's
                        epilogue (`dgate_up_epilogue`), so both backends compute the same values.

The per-row sum of the pair outputs is the Triton backend's `segment_sum_kernel` (fp32, pair order).
The gather's and `act_mul_kernel`'s tiles are tuned per (H or I, size class) and launched by `run_tuned`; the
backward's elementwise kernel has one fixed tile. Under `TRITON_INTERPRET=1` the tiles are small, so tiny test
shapes span several.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_expert_mlp_kernels import INTERPRETED, apply_activation, bench_config, dgate_up_epilogue

#: (BLOCK_M, BLOCK_N, warps) candidates of the gather, tuned per (H, size class): it moves [N, H], and how many
#: rows a program holds in flight decides how close it gets to copy speed (docs/kernels.md has the timings)
_GATHER_HOPPER = [(8, 512, 4), (16, 512, 4), (8, 1024, 4), (16, 1024, 8), (32, 256, 4), (4, 2048, 8)]
#: the same for `act_mul_kernel`, per (I, size class): each the fastest at one of the real shapes (docs/kernels.md)
_ACT_HOPPER = [(16, 256, 4), (8, 512, 4), (4, 1024, 4)]
#: (BLOCK_M, BLOCK_N) of the backward's elementwise kernel: 2048 elements a step of its column loop
ACT_BACKWARD_BLOCK = (4, 16) if INTERPRETED else (16, 128)


def _tile_configs(candidates: list[tuple]) -> list[triton.Config]:
    if INTERPRETED:  # one small tile: tiny test shapes span several programs
        return [triton.Config({"BLOCK_M": 4, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps) for m, n, warps in candidates]


@triton.autotune(configs=_tile_configs(_GATHER_HOPPER), key=["H", "ROWS_PER_EXPERT"], do_bench=bench_config)
@triton.jit
def gather_rows_kernel(
    src_ptr,  # [R, H]
    index_ptr,  # [N] int64: the source row of each pair
    valid_ptr,  # scalar int64: pairs before it are in the segments (`expert_offsets[L]`)
    out_ptr,  # [N, H]
    num_pairs,
    H,
    stride_src,
    stride_out,
    ROWS_PER_EXPERT,  # autotuning key only: the call's size class
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < tl.minimum(num_pairs, tl.load(valid_ptr)))[:, None] & (offs_h < H)[None, :]
    rows = tl.load(index_ptr + offs_m, mask=offs_m < num_pairs, other=0).to(tl.int64)
    values = tl.load(src_ptr + rows[:, None] * stride_src + offs_h[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_h[None, :], values, mask=mask)


@triton.autotune(configs=_tile_configs(_ACT_HOPPER), key=["I", "ROWS_PER_EXPERT"], do_bench=bench_config)
@triton.jit
def act_mul_kernel(
    gu_ptr,  # [N, 2I]: gate columns, then up columns
    pair_weight_ptr,  # [N]
    valid_ptr,  # scalar int64: pairs before it are in the segments (only those are computed)
    hw_ptr,  # [N, I] out
    num_pairs,
    I,
    ROWS_PER_EXPERT,  # autotuning key only: the call's size class
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < tl.minimum(num_pairs, tl.load(valid_ptr))
    mask = mask_m[:, None] & (offs_n < I)[None, :]
    gu_ptrs = gu_ptr + offs_m.to(tl.int64)[:, None] * (2 * I) + offs_n[None, :]
    gate = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    act, _ = apply_activation(gate, ACTIVATION)
    w_M = tl.load(pair_weight_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    h = act * up * w_M[:, None]
    tl.store(hw_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], h.to(hw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_mul_backward_kernel(
    g_ptr,  # [N, I]: dout[row p] @ down_e
    gu_ptr,  # [N, 2I] saved pre-activations
    pair_weight_ptr,  # [N]
    valid_ptr,  # scalar int64: pairs before it are in the segments (`expert_offsets[L]`)
    dgu_ptr,  # [N, 2I] out
    hw_ptr,  # [N, I] out (WRITE_HW)
    dweight_ptr,  # [N] out (summed in fp32, stored in the pair weights' dtype): zero past the segments
    num_pairs,
    I,
    WRITE_HW: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # past the segments the GEMMs wrote nothing (g and gu hold whatever was there): those pairs are masked
    # out, their weight gradient is zero, and their d gu and hw rows stay unwritten (no GEMM reads them)
    mask_m = offs_m < tl.minimum(num_pairs, tl.load(valid_ptr))
    rows_M = offs_m.to(tl.int64)
    w_M = tl.load(pair_weight_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n_start in range(0, I, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        g = tl.load(g_ptr + rows_M[:, None] * I + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        total += dgate_up_epilogue(
            g.to(tl.float32), rows_M, mask_m, offs_n, mask_n, w_M, gu_ptr, dgu_ptr, hw_ptr, I, WRITE_HW, ACTIVATION
        )
    tl.store(dweight_ptr + offs_m, total.to(dweight_ptr.dtype.element_ty), mask=offs_m < num_pairs)


__all__ = ["ACT_BACKWARD_BLOCK", "act_mul_backward_kernel", "act_mul_kernel", "gather_rows_kernel"]
