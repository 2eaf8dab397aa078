"""Triton kernels of the local expert computation; `triton_expert_mlp.py` launches them.

Shape legend: N (row, local expert) pairs in segment order (grouped by expert), R received rows,
L local experts, H hidden, I expert width, K the reduction length of a GEMM, BM/BN/BK block sizes.

Every grouped GEMM maps its programs to (expert, M tile) on the device: `_expert_of_tile` turns the
expert offsets into a tile schedule inside each program (a cumulative sum over L values), so no host
sync and no schedule tensor is needed, and autotuning may change BLOCK_M freely. Grids are sized by
the upper bound `cdiv(N, BM) + min(L, N)` M tiles; programs past the last tile return at once. The
three row-major grouped GEMMs share one K loop (`_gemm_k_loop`); they differ only in how they address
their operands and in their epilogues. The weight gradients' K loop runs along a segment (`_outer_k_loop`):
once over the whole blocks through TMA where descriptors exist, once by masked pointers over the rest.

Kernels (`triton_expert_mlp.py` says why the work is split so):
- `gate_up_kernel`     hw[p] = w[p] * act(x[row p] @ gate_e^T) * (x[row p] @ up_e^T), gathering rows
                       of x; optionally saves the pre-activations gu[p] = [gate, up] for the backward.
                       Gate and up columns share one [BK, 2 BN] weight tile: one dot computes both.
- `scatter_gemm_kernel` y[p] = a[p] @ B_e, either atomically added in fp32 into
                       out[row p] (`reduce="atomic"`) or written per pair for `segment_sum_kernel`.
- `segment_sum_kernel` out[r] = sum of y over the pairs of row r, in pair order (deterministic); rows
                       served by no pair get zeros. Several rows a program, 8 pair rows of each in flight.
- `dgate_up_kernel`    backward of the gate/up/activation stage: g[p] = dout[row p] @ down_e, then
                       d gu[p] from g, the pair weight and the saved pre-activations, the pair
                       weight's gradient partial sums <h[p], g[p]> per N tile, and hw[p] again.
                       `EPI_SPLIT = 2` runs this epilogue on two column halves of the tile one after
                       the other, so fewer fp32 tiles are live at once and a wider tile fits the registers.
- `pair_weight_grad_kernel` the pair weight's gradient from `dgate_up_kernel`'s partial sums (zero for
                       pairs past the segments), in the weights' dtype.
- `segment_outer_kernel` weight gradients: C_e = sum over the pairs p of expert e of A[row_a(p)]^T
                       B[row_b(p)]; one program owns one output tile and the whole reduction, so it is
                       deterministic.
- `topk_gate_up_kernel`, `topk_down_kernel` (`triton_topk_mlp.py`): a few tokens' experts straight from the
                       router's top-k, one program per (pair, tile of I), then per (token, tile of H); matrix-vector
                       products with fixed blocks, no layout and no tuning: an eager decode step's host time.

Activations (`ACTIVATIONS`, a constexpr code in every kernel that applies one): SiLU and GELU with
the tanh approximation, each with its derivative for the backward.

Under `TRITON_INTERPRET=1` (which must be set before triton is first imported in the process:
triton.language's own library functions are `@triton.jit`'d at import) the kernels get one small
config, so the interpreter runs no tuning and tiny test shapes still span several tiles.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from .activations import ACTIVATIONS as _ACTIVATION_NAMES

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: activation name -> the constexpr code `apply_activation` branches on
ACTIVATIONS = {name: code for code, name in enumerate(_ACTIVATION_NAMES)}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps[, extra constexprs]) candidates for Hopper, tuned
# per (H, I, rows per expert). Every candidate is valid for every shape (masks cover ragged edges); the
# tuner only picks. gate_up's BLOCK_N counts twice (gate and up columns share one tile). dgate_up's
# epilogue holds about five fp32 tiles: the wide tiles only come with EPI_SPLIT = 2. Its 128x128 tile capped at
# 128 registers (`maxnreg`, a few spills) lets two programs share a multiprocessor, so that one's epilogue (the gu
# loads, d gu and hw stores) runs beside the other's K loop (docs/kernels.md).
# The candidates with BLOCK_M <= `SMALL_M` are for small T (a handful of rows per expert, where streaming the
# weights is the whole cost): `_prune_by_rows` tunes only the tiles that can win at the call's mean segment
# length, which also keeps the tuning time of each key down (docs/kernels.md).
_GATE_UP_HOPPER = [
    (128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (256, 64, 64, 3, 8), (128, 64, 64, 4, 4), (64, 64, 128, 3, 4),
    (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
]  # fmt: skip
_TMA = {"USE_TMA": True}
_GEMM_HOPPER = [
    (128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (64, 128, 64, 4, 4),
    (64, 128, 128, 3, 4), (16, 128, 128, 4, 4), (32, 128, 128, 4, 4), (32, 64, 128, 4, 4),
    (128, 256, 64, 3, 8, _TMA), (128, 256, 64, 4, 8, _TMA), (256, 128, 64, 3, 8, _TMA), (128, 128, 64, 4, 8, _TMA),
    (64, 128, 64, 4, 4, _TMA),
]  # fmt: skip
_DGATE_UP_HOPPER = [
    (128, 128, 64, 3, 8, {"EPI_SPLIT": 1}), (128, 128, 64, 3, 8, {"EPI_SPLIT": 2}),
    (128, 256, 64, 3, 8, {"EPI_SPLIT": 2}), (128, 64, 64, 4, 4, {"EPI_SPLIT": 1}), (64, 128, 64, 4, 4, {"EPI_SPLIT": 1}),
    (32, 128, 64, 4, 4, {"EPI_SPLIT": 1}), (32, 64, 128, 4, 4, {"EPI_SPLIT": 1}),
    (128, 128, 64, 3, 8, {"EPI_SPLIT": 2, **_TMA}), (128, 256, 64, 3, 8, {"EPI_SPLIT": 2, **_TMA}),
    (128, 128, 64, 4, 8, {"EPI_SPLIT": 1, **_TMA}),
    (128, 128, 64, 3, 8, {"EPI_SPLIT": 2, "maxnreg": 128}),
]  # fmt: skip
# The weight gradients reduce along the pairs (BLOCK_K runs along a segment). Where segments are short (a
# handful of pairs per expert at small T) each program runs one or two K steps and the kernel only writes
# the [L, M, N] gradient: the candidates with BLOCK_K <= `SMALL_K` and two stages need a fraction of the
# shared memory of the 64-deep three-stage ones (1 program per SM for 128x256x64 x 3 stages), so several
# programs per SM overlap their stores. `_prune_by_segment` tunes them only below `LARGE_T_ROWS` pairs per expert.
_OUTER_HOPPER = [
    (128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8), (64, 128, 64, 4, 4),
    (64, 128, 32, 2, 4), (128, 128, 32, 2, 8), (64, 256, 32, 2, 8), (128, 256, 16, 2, 8),
    (128, 256, 64, 3, 8, _TMA), (128, 256, 64, 4, 8, _TMA), (128, 128, 64, 4, 8, _TMA), (256, 128, 64, 3, 8, _TMA),
]  # fmt: skip
# (BLOCK_R, BLOCK_H, warps) of the row sum: 2048-4096 elements a load step, so that a thread's share of
# every pair row is one or two 16-byte loads, and 8 pair rows of each of BLOCK_R rows in flight
_SEGMENT_SUM_HOPPER = [(1, 2048, 4), (2, 1024, 4), (4, 512, 4), (8, 256, 4), (4, 1024, 8), (8, 512, 8), (16, 256, 8)]
#: row tiles of at most this many rows are small-T candidates
SMALL_M = 32
#: mean pairs per expert up to which only tiles of at most 64 rows are tuned (above it, none of <= SMALL_M)
SMALL_T_ROWS = 64
#: reduction blocks of at most this many pairs are the weight gradients' short-segment candidates
SMALL_K = 32
#: mean pairs per expert from which only the tiles of at least 128 rows are tuned
LARGE_T_ROWS = 1024
#: the one config of each kernel under the interpreter (extra constexprs beside the 16-wide blocks)
_INTERPRETED_EXTRA = {"dgate_up": {"EPI_SPLIT": 2}}


def _gemm_configs(candidates: list[tuple], kernel: str = "") -> list[triton.Config]:
    pre_hook = functools.partial(_set_tma_blocks, kernel) if kernel in _TMA_BLOCKS else None
    if INTERPRETED:  # one small config: no tuning runs, and tiny test shapes still span several tiles
        extra = _INTERPRETED_EXTRA.get(kernel, {})
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, **extra}, num_warps=1, num_stages=1, pre_hook=pre_hook)]
    configs = []
    for m, n, k, stages, warps, *extra in candidates:
        kwargs = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, **(extra[0] if extra else {})}
        maxnreg = kwargs.pop("maxnreg", None)  # a register cap (an option, not a constexpr)
        configs.append(triton.Config(kwargs, num_stages=stages, num_warps=warps, maxnreg=maxnreg, pre_hook=pre_hook))
    return configs


#: kernel -> (descriptor argument, its block shape from (BLOCK_M, BLOCK_N, BLOCK_K, the call's arguments))
_TMA_BLOCKS = {
    "scatter_gemm": (
        ("a_desc", lambda m, n, k, args: [m, k]),
        ("b_desc", lambda m, n, k, args: [k, n] if args["B_K_AXIS"] == 0 else [n, k]),
    ),
    "dgate_up": (("b_desc", lambda m, n, k, args: [k, n]),),
    "segment_outer": (("a_desc", lambda m, n, k, args: [k, m]), ("b_desc", lambda m, n, k, args: [k, n])),
}


def _set_tma_blocks(kernel: str, args: dict) -> None:
    """Config pre-hook: the call's tensor descriptors (made by the launcher with a placeholder block)
    get this config's block shape. Every config sets it, TMA or not, so that a descriptor the config
    does not read still compiles to one signature per config."""
    m, n, k = args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]
    for name, block in _TMA_BLOCKS[kernel]:
        if args.get(name) is not None:
            args[name].block_shape = block(m, n, k, args)


def _prune_tma(configs, named_args, **kwargs):
    """Without descriptors (`TMA_OK` false: unaligned operands or short segments) the TMA configs
    would only repeat the pointer ones: not tuned."""
    if kwargs.get("TMA_OK", named_args.get("TMA_OK", False)):
        return configs
    return [c for c in configs if not c.kwargs.get("USE_TMA", False)] or configs


def _prune_by_rows(configs, named_args, **kwargs):
    """The row tiles worth tuning at this call's mean pairs per expert (`ROWS_PER_EXPERT`, a power of
    two), and the TMA configs only where the call has descriptors (`_prune_tma`)."""
    configs = _prune_tma(configs, named_args, **kwargs)
    rows = named_args["ROWS_PER_EXPERT"]
    if rows <= SMALL_T_ROWS:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 64]
    elif rows >= LARGE_T_ROWS:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] >= 128]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] > SMALL_M]
    return keep or configs


def _prune_by_segment(configs, named_args, **kwargs):
    """The weight gradients' candidates worth tuning: those with a short reduction block
    (BLOCK_K <= `SMALL_K`) only where segments average fewer than `LARGE_T_ROWS` pairs, and the TMA
    configs only where the call has descriptors (`_prune_tma`)."""
    configs = _prune_tma(configs, named_args, **kwargs)
    if named_args["ROWS_PER_EXPERT"] < LARGE_T_ROWS:
        return configs
    return [c for c in configs if c.kwargs["BLOCK_K"] > SMALL_K] or configs


#: `prune_configs_by` of the grouped GEMMs whose BLOCK_M runs along the pairs
_PRUNE_BY_ROWS = {"early_config_prune": _prune_by_rows}


def _segment_sum_configs() -> list[triton.Config]:
    if INTERPRETED:  # two rows a program: the tests' rows of different pair counts share programs
        return [triton.Config({"BLOCK_R": 2, "BLOCK_H": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_R": r, "BLOCK_H": h}, num_warps=warps) for r, h, warps in _SEGMENT_SUM_HOPPER]


def bench_config(kernel_call, quantiles):
    """The autotuner's timing of one config: a short `do_bench` (5 ms warm-up, 25 ms of repeats; the
    tuner runs once per shape key, and a benchmark run tunes dozens of keys). A config that fails to
    compile or launch for any reason is reported and timed as infinitely slow, so one bad candidate on
    some compiler version costs its place in the ranking, never the run."""
    import warnings

    from triton.testing import do_bench

    try:
        return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)
    except Exception as error:  # noqa: BLE001 - any failure of a candidate only disqualifies it
        warnings.warn(f"Triton expert kernels: a tuning candidate failed and is skipped: {type(error).__name__}: {error}")
        return [float("inf")] * len(quantiles)


def _even_k(args: dict) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def _a_tma(args: dict) -> bool:
    """A through its descriptor: a TMA config (`USE_TMA`) on operands that have descriptors (`TMA_OK`)."""
    return bool(args.get("USE_TMA", False) and args["TMA_OK"])


def _b_tma(args: dict) -> bool:
    """B through its descriptor: as A, and no K block crosses into the next expert's rows of the
    flattened weights (`_gemm_k_loop`)."""
    return _a_tma(args) and (args["EVEN_K"] or args["B_K_AXIS"] == 1)


@triton.jit
def _expert_of_tile(expert_offsets_ptr, num_experts, tile_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Global M tile -> (expert, first pair of the tile, end of the expert's segment).

    Expert e owns cdiv(count_e, BLOCK_M) consecutive tiles (none when empty). Returns
    expert == num_experts for tiles past the last one.
    """
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    starts = tl.load(expert_offsets_ptr + e, mask=valid, other=0)
    ends = tl.load(expert_offsets_ptr + e + 1, mask=valid, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tiles_end <= tile_m).to(tl.int32), 0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (tile_m - first_tile) * BLOCK_M
    segment_end = tl.sum(tl.where(mine, ends, 0), 0)
    return expert, row_start, segment_end


@triton.jit
def _tile_rows(row_start, segment_end, BLOCK_M: tl.constexpr):
    """Pair indices of an M tile, their mask, and a clamped copy safe to load through without a mask
    (lanes past the segment repeat its last pair; they are computed but never stored)."""
    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < segment_end
    return offs_m, mask_m, tl.minimum(offs_m, segment_end - 1)


@triton.jit
def _gemm_k_loop(
    a_ptrs, b_ptrs, mask_b_n, K, stride_b_k, acc, a_desc, a_row, b_desc, b_row, b_col,
    DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_K_AXIS: tl.constexpr,
):  # fmt: skip
    """acc += A @ B over the whole reduction: the K loop every row-major grouped GEMM here shares.

    a_ptrs: [BM, BK] pointers to A's first K block (unit stride along K; rows may be gathered);
    b_ptrs: [BK, BN] pointers to B's first K block, `stride_b_k` apart along K; mask_b_n: [BN], the
    valid B columns. B's columns are masked, never clamped: a clamped index along a unit-stride
    dimension hides contiguity from the compiler and turns 16-byte loads into scalar ones.

    A_TMA / B_TMA: load that operand through a host-made tensor descriptor (Hopper's tensor memory
    accelerator: no per-element address registers) instead of its pointers. A's descriptor is the
    [N, K] operand itself, its block at (a_row, k). B's descriptor is the [L * rows, cols] weight tensor
    as one matrix, its block at (b_row, b_col) advanced along B_K_AXIS: 0 when B_e is stored [K, F]
    (the block is [BK, BN]), 1 when it is stored [F, K] (the block is [BN, BK], transposed for the dot).
    Rows of a block past the expert's (or the segment's) end read a neighbour's values: along M and N
    they are computed and never stored; along K the launcher uses B_TMA only where no block crosses
    (EVEN_K, or K on the descriptor's last axis, whose out-of-bounds elements load as zero).
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if A_TMA:
            a = a_desc.load([a_row, k * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_k < K - k * BLOCK_K)[None, :], other=0.0)
        if B_TMA:
            if B_K_AXIS == 0:
                b = b_desc.load([b_row + k * BLOCK_K, b_col])
            else:
                b = b_desc.load([b_row, b_col + k * BLOCK_K]).T
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=mask_b_n[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=(offs_k < K - k * BLOCK_K)[:, None] & mask_b_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_b_k
    return acc


@triton.jit
def apply_activation(gate, ACTIVATION: tl.constexpr):
    """act(gate) and act'(gate) in fp32 (`ACTIVATIONS`: 0 SiLU, 1 GELU with the tanh approximation)."""
    if ACTIVATION == 0:
        sig = tl.sigmoid(gate)
        act = gate * sig
        dact = sig * (1.0 + gate * (1.0 - sig))
    else:
        # tanh(u) = 2 sigmoid(2u) - 1 (portable: no libdevice call, runs under the interpreter)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        act = 0.5 * gate * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * gate * gate)
    return act, dact


@triton.jit
def _column_halves(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BM, BN] -> its left and right [BM, BN/2] halves."""
    return tl.split(tl.permute(tl.reshape(t, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.autotune(
    configs=_gemm_configs(_GATE_UP_HOPPER),
    key=["K", "I", "ROWS_PER_EXPERT", "SAVE_GU"],
    prune_configs_by=_PRUNE_BY_ROWS,
    do_bench=bench_config,
)
@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def gate_up_kernel(
    x_ptr,  # [R, K=H], unit stride along H
    pair_row_ptr,  # [N] int64
    expert_offsets_ptr,  # [L + 1] int64
    w_ptr,  # [L, 2I, H]: gate rows, then up rows
    pair_weight_ptr,  # [N]
    hw_ptr,  # [N, I] out: pair_weight * act(gate) * up
    gu_ptr,  # [N, 2I] out when SAVE_GU: gate and up pre-activations
    num_experts,
    K,
    I,
    ROWS_PER_EXPERT,  # autotuning key only
    stride_x_row,
    stride_w_expert,
    stride_w_out,
    stride_w_k,
    SAVE_GU: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(I, BLOCK_N)
    expert, row_start, segment_end = _expert_of_tile(expert_offsets_ptr, num_experts, pid // tiles_n, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    offs_m, mask_m, safe_m = _tile_rows(row_start, segment_end, BLOCK_M)
    rows_M = tl.load(pair_row_ptr + safe_m)
    n_start = (pid % tiles_n) * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    # One [BK, 2 BN] weight tile with gate and up columns interleaved: column 2c is gate row n_start + c,
    # column 2c + 1 up row I + n_start + c, so the accumulator splits into gate and up in registers.
    cols = tl.arange(0, 2 * BLOCK_N)
    col_n = n_start + cols // 2
    w_rows = col_n + (cols % 2) * I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_M[:, None] * stride_x_row + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + w_rows[None, :] * stride_w_out + offs_k[:, None] * stride_w_k
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    acc = _gemm_k_loop(
        x_ptrs, w_ptrs, col_n < I, K, stride_w_k, acc, x_ptr, 0, w_ptr, 0, 0, DOT_PRECISION, BLOCK_K, EVEN_K, False, False, 0
    )
    acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))

    # Round the pre-activations to the storage dtype first, as the reference does, so that the forward
    # and the backward (which reads them back) see the same values.
    gate = acc_gate.to(hw_ptr.dtype.element_ty)
    up = acc_up.to(hw_ptr.dtype.element_ty)
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SAVE_GU:
        gu_ptrs = gu_ptr + offs_m[:, None] * (2 * I) + offs_n[None, :]
        tl.store(gu_ptrs, gate, mask=mask_out)
        tl.store(gu_ptrs + I, up, mask=mask_out)
    act, _ = apply_activation(gate.to(tl.float32), ACTIVATION)
    h = act * up.to(tl.float32) * tl.load(pair_weight_ptr + safe_m).to(tl.float32)[:, None]
    tl.store(hw_ptr + offs_m[:, None] * I + offs_n[None, :], h.to(hw_ptr.dtype.element_ty), mask=mask_out)


@triton.autotune(
    configs=_gemm_configs(_GEMM_HOPPER, "scatter_gemm"),
    key=["K", "N_OUT", "ROWS_PER_EXPERT", "ATOMIC", "TMA_OK"],
    prune_configs_by=_PRUNE_BY_ROWS,
    reset_to_zero=["out_ptr"],
    do_bench=bench_config,
)
@triton.heuristics({"EVEN_K": _even_k, "A_TMA": _a_tma, "B_TMA": _b_tma})
@triton.jit
def scatter_gemm_kernel(
    a_ptr,  # [N, K] in segment order, unit stride along K
    pair_row_ptr,  # [N] int64
    expert_offsets_ptr,  # [L + 1] int64
    b_ptr,  # B_e = b[e] as [K, N_OUT] through the strides
    out_ptr,  # ATOMIC: fp32 [R, N_OUT], accumulated; else [N, N_OUT], one row per pair
    a_desc,  # TMA_OK: tensor descriptor of a [N, K]; else None
    b_desc,  # TMA_OK: tensor descriptor of b as one [L * rows, cols] matrix (see B_K_AXIS); else None
    num_experts,
    K,
    N_OUT,
    ROWS_PER_EXPERT,  # autotuning key only
    stride_a_row,
    stride_b_expert,
    stride_b_k,
    stride_b_n,
    stride_out_row,
    ATOMIC: tl.constexpr,
    TMA_OK: tl.constexpr,  # the descriptors exist (aligned operands, dense experts)
    B_K_AXIS: tl.constexpr,  # 0: b[e] is stored [K, N_OUT]; 1: stored [N_OUT, K] (see _gemm_k_loop)
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    expert, row_start, segment_end = _expert_of_tile(expert_offsets_ptr, num_experts, pid // tiles_n, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    offs_m, mask_m, safe_m = _tile_rows(row_start, segment_end, BLOCK_M)
    n_start = (pid % tiles_n) * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + safe_m[:, None].to(tl.int64) * stride_a_row + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_b_expert + offs_k[:, None] * stride_b_k + offs_n[None, :] * stride_b_n
    if B_K_AXIS == 0:  # b's descriptor rows: expert e's K rows, then its N_OUT rows
        b_row = expert * K
        b_col = n_start
    else:
        b_row = expert * N_OUT + n_start
        b_col = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _gemm_k_loop(
        a_ptrs, b_ptrs, mask_n, K, stride_b_k, acc, a_desc, row_start.to(tl.int32), b_desc, b_row, b_col,
        DOT_PRECISION, BLOCK_K, EVEN_K, A_TMA, B_TMA, B_K_AXIS,
    )  # fmt: skip

    mask_out = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        rows_M = tl.load(pair_row_ptr + safe_m)
        tl.atomic_add(out_ptr + rows_M[:, None] * stride_out_row + offs_n[None, :], acc, mask=mask_out, sem="relaxed")
    else:
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out_row + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


@triton.autotune(configs=_segment_sum_configs(), key=["H", "ROWS_PER_EXPERT"], do_bench=bench_config)
@triton.jit
def segment_sum_kernel(
    y_ptr,  # [N, H] per-pair rows
    row_pairs_ptr,  # [N] int64: pairs sorted by row (stable)
    row_offsets_ptr,  # [R + 1] int64: pairs of row r are row_pairs[row_offsets[r]:row_offsets[r + 1]]
    out_ptr,  # [R, H]
    num_rows,
    H,
    stride_y_row,
    stride_out_row,
    ROWS_PER_EXPERT,  # autotuning key only: the call's size class (a tile that wins at small T may lose at large T)
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # BLOCK_R rows a program, PAIRS pair rows of each loaded before any is added: every program puts
    # BLOCK_R * PAIRS independent row loads in flight after one load of the offsets and one of the pair
    # indices, which brings it to copy speed (docs/kernels.md). The sum runs pair by pair, in pair order, in
    # fp32, whatever the config: the tuner's choice never changes the bits of the result.
    PAIRS: tl.constexpr = 8
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < num_rows
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    first_R = tl.load(row_offsets_ptr + offs_r, mask=mask_r, other=0)
    count_R = tl.load(row_offsets_ptr + offs_r + 1, mask=mask_r, other=0) - first_R
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for j in range(0, tl.max(count_R, axis=0), PAIRS):
        for q in tl.static_range(PAIRS):
            has_R = j + q < count_R
            pair_R = tl.load(row_pairs_ptr + first_R + j + q, mask=has_R, other=0)
            y_ptrs = y_ptr + pair_R[:, None] * stride_y_row + offs_h[None, :]
            acc += tl.load(y_ptrs, mask=has_R[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs_r.to(tl.int64)[:, None] * stride_out_row + offs_h[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_h[None, :])


@triton.jit
def dgate_up_epilogue(
    g, offs_m, mask_m, offs_n, mask_n, w_M, gu_ptr, dgu_ptr, hw_ptr, I, WRITE_HW: tl.constexpr, ACTIVATION: tl.constexpr
):
    """From g = dout[row] @ down_e over a [BM, BN'] tile: store d gate, d up (and hw when WRITE_HW);
    return the pair-weight gradient's partial sums <act(gate) * up, g> over the tile's columns [BM]."""
    mask_out = mask_m[:, None] & mask_n[None, :]
    gu_ptrs = gu_ptr + offs_m[:, None] * (2 * I) + offs_n[None, :]
    gate = tl.load(gu_ptrs, mask=mask_out, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + I, mask=mask_out, other=0.0).to(tl.float32)
    act, dact = apply_activation(gate, ACTIVATION)
    h = act * up
    # d out / d pair_weight[p] = <y[p], dout[row p]> = <h[p], dout[row p] @ down_e> = <h[p], g[p]>
    partial = tl.sum(tl.where(mask_out, h * g, 0.0), axis=1)
    dh = g * w_M[:, None]
    dgu_ptrs = dgu_ptr + offs_m[:, None] * (2 * I) + offs_n[None, :]
    tl.store(dgu_ptrs, (dh * up * dact).to(dgu_ptr.dtype.element_ty), mask=mask_out)
    tl.store(dgu_ptrs + I, (dh * act).to(dgu_ptr.dtype.element_ty), mask=mask_out)
    if WRITE_HW:  # the same product, in the same order, as gate_up_kernel's forward: the same bits
        tl.store(hw_ptr + offs_m[:, None] * I + offs_n[None, :], (h * w_M[:, None]).to(hw_ptr.dtype.element_ty), mask=mask_out)
    return partial


# Configs differ in BLOCK_N, hence in how many partial-sum columns they write: `pair_weight_grad_kernel` sums
# only the columns of the config that ran (`best_config`), which every pair's row fills.
@triton.autotune(
    configs=_gemm_configs(_DGATE_UP_HOPPER, "dgate_up"),
    key=["K", "I", "ROWS_PER_EXPERT", "WRITE_HW", "TMA_OK"],
    prune_configs_by=_PRUNE_BY_ROWS,
    do_bench=bench_config,
)
@triton.heuristics({"EVEN_K": _even_k, "B_TMA": lambda args: _a_tma(args) and args["EVEN_K"]})
@triton.jit
def dgate_up_kernel(
    dout_ptr,  # [R, K=H], unit stride along H
    pair_row_ptr,  # [N] int64
    expert_offsets_ptr,  # [L + 1] int64
    w_ptr,  # down projection [L, H, I]
    gu_ptr,  # [N, 2I] saved pre-activations
    pair_weight_ptr,  # [N]
    dgu_ptr,  # [N, 2I] out
    hw_ptr,  # [N, I] out when WRITE_HW: pair_weight * act(gate) * up, as the forward computed it
    dweight_partial_ptr,  # [N, P] fp32 out: column n holds <h[p], g[p]> over N tile n (P >= tiles)
    b_desc,  # TMA_OK: tensor descriptor of the down projection as one [L * H, I] matrix; else None
    num_experts,
    K,
    I,
    ROWS_PER_EXPERT,  # autotuning key only
    stride_dout_row,
    stride_w_expert,
    stride_w_k,
    stride_w_n,
    stride_partial_row,
    WRITE_HW: tl.constexpr,
    TMA_OK: tl.constexpr,  # the descriptor exists
    ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    B_TMA: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(I, BLOCK_N)
    tile_n = pid % tiles_n
    expert, row_start, segment_end = _expert_of_tile(expert_offsets_ptr, num_experts, pid // tiles_n, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    offs_m, mask_m, safe_m = _tile_rows(row_start, segment_end, BLOCK_M)
    rows_M = tl.load(pair_row_ptr + safe_m)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    dout_ptrs = dout_ptr + rows_M[:, None] * stride_dout_row + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + offs_k[:, None] * stride_w_k + offs_n[None, :] * stride_w_n
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g = _gemm_k_loop(
        dout_ptrs, w_ptrs, mask_n, K, stride_w_k, g, dout_ptr, 0, b_desc, expert * K, tile_n * BLOCK_N,
        DOT_PRECISION, BLOCK_K, EVEN_K, False, B_TMA, 0,
    )  # fmt: skip

    w_M = tl.load(pair_weight_ptr + safe_m).to(tl.float32)
    if EPI_SPLIT == 2:  # two column halves one after the other: fewer fp32 tiles live at once
        g_left, g_right = _column_halves(g, BLOCK_M, BLOCK_N)
        offs_left = tile_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        partial = dgate_up_epilogue(
            g_left, offs_m, mask_m, offs_left, offs_left < I, w_M, gu_ptr, dgu_ptr, hw_ptr, I, WRITE_HW, ACTIVATION
        )
        offs_right = offs_left + BLOCK_N // 2
        partial += dgate_up_epilogue(
            g_right, offs_m, mask_m, offs_right, offs_right < I, w_M, gu_ptr, dgu_ptr, hw_ptr, I, WRITE_HW, ACTIVATION
        )
    else:
        partial = dgate_up_epilogue(g, offs_m, mask_m, offs_n, mask_n, w_M, gu_ptr, dgu_ptr, hw_ptr, I, WRITE_HW, ACTIVATION)
    tl.store(dweight_partial_ptr + offs_m * stride_partial_row + tile_n, partial, mask=mask_m)


#: the smallest BLOCK_N of `dgate_up_kernel`'s candidates: the launcher sizes the pair-weight gradient's
#: per-N-tile partial sums by it once, not per call
DGATE_UP_MIN_BLOCK_N = min(config.kwargs["BLOCK_N"] for config in dgate_up_kernel.configs)


@triton.jit
def pair_weight_grad_kernel(
    partial_ptr,  # [N, P] fp32: `dgate_up_kernel`'s partial sums, columns [0, tiles) written for pairs in the segments
    segments_end_ptr,  # [1] int64: expert_offsets[L]; pairs at or past it (a static dispatch's empty slots) get 0
    out_ptr,  # [N] the pair-weight gradient, in the weights' dtype
    num_pairs,
    tiles,  # N tiles of the dgate_up config that ran
    stride_partial_row,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= tiles
):
    # One launch instead of four small operators: at small T each operator's host time is the call's time.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_pairs
    inside_m = mask_m & (offs_m < tl.load(segments_end_ptr))
    offs_p = tl.arange(0, BLOCK_P)
    mask = inside_m[:, None] & (offs_p < tiles)[None, :]
    partial = tl.load(partial_ptr + offs_m.to(tl.int64)[:, None] * stride_partial_row + offs_p[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + offs_m, tl.sum(partial, axis=1).to(out_ptr.dtype.element_ty), mask=mask_m)


@triton.jit
def _outer_block(
    a_ptr, b_ptr, pair_row_ptr, a_desc, b_desc, k0, segment_end, offs_m, mask_m, offs_n, mask_n, stride_a_row, stride_b_row,
    m_start, n_start, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TMA: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The A [BM, BK] and B [BK, BN] operands of `segment_outer_kernel` for the pairs k0 .. k0 + BK.

    TMA (a whole block inside the segment): the operand that is not gathered comes through its
    descriptor (its rows are consecutive pairs) and no pair needs a mask. Otherwise pointers, with the
    pairs past the segment's end masked to zero (they belong to the next expert)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if TMA:
        mask_k = offs_k >= 0  # all true: a whole block
        safe_k = offs_k
    else:
        mask_k = offs_k < segment_end
        safe_k = tl.minimum(offs_k, segment_end - 1)
    if GATHER_A:
        rows_a = tl.load(pair_row_ptr + safe_k)
    else:
        rows_a = safe_k
    if GATHER_B:
        rows_b = tl.load(pair_row_ptr + safe_k)
    else:
        rows_b = safe_k
    # M and N are the unit-stride dimensions here: masked, not clamped (see _gemm_k_loop)
    if TMA and not GATHER_A:
        a = a_desc.load([tl.cast(k0, tl.int32), m_start]).T
    else:
        a = tl.load(a_ptr + rows_a[None, :] * stride_a_row + offs_m[:, None], mask=mask_k[None, :] & mask_m[:, None], other=0.0)
    if TMA and not GATHER_B:
        b = b_desc.load([tl.cast(k0, tl.int32), n_start])
    else:
        b = tl.load(b_ptr + rows_b[:, None] * stride_b_row + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    return a, b


@triton.jit
def _outer_k_loop(
    acc, k_first, k_stop, a_ptr, b_ptr, pair_row_ptr, a_desc, b_desc, segment_end, offs_m, mask_m, offs_n, mask_n,
    stride_a_row, stride_b_row, m_start, n_start, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """acc += A^T B over the pairs k_first .. k_stop of one segment, BLOCK_K at a time: the K loop of the
    weight gradients (`_outer_block` loads each block; TMA only for whole blocks inside the segment).
    STAGES: the loop's software pipelining depth, None for the config's `num_stages` (1 for the ragged tail
    after the TMA blocks: at most one step, which pipelining only slows)."""
    for k0 in tl.range(k_first, k_stop, BLOCK_K, num_stages=STAGES):
        a, b = _outer_block(
            a_ptr, b_ptr, pair_row_ptr, a_desc, b_desc, k0, segment_end, offs_m, mask_m, offs_n, mask_n,
            stride_a_row, stride_b_row, m_start, n_start, GATHER_A, GATHER_B, TMA, BLOCK_K,
        )  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.autotune(
    configs=_gemm_configs(_OUTER_HOPPER, "segment_outer"),
    key=["M", "N_OUT", "ROWS_PER_EXPERT", "GATHER_A", "TMA_OK"],
    prune_configs_by={"early_config_prune": _prune_by_segment},
    do_bench=bench_config,
)
@triton.jit
def segment_outer_kernel(
    a_ptr,  # rows of A; row p (or pair_row[p] when GATHER_A) holds A's M values, unit stride
    b_ptr,  # rows of B; row p (or pair_row[p] when GATHER_B) holds B's N_OUT values, unit stride
    pair_row_ptr,  # [N] int64
    expert_offsets_ptr,  # [L + 1] int64
    c_ptr,  # [L, M, N_OUT] out
    a_desc,  # TMA_OK and not GATHER_A: descriptor of A's rows [N, M], block [BK, BM]; else None
    b_desc,  # TMA_OK and not GATHER_B: descriptor of B's rows [N, N_OUT], block [BK, BN]; else None
    num_experts,
    M,
    N_OUT,
    ROWS_PER_EXPERT,  # autotuning key only
    stride_a_row,
    stride_b_row,
    stride_c_expert,
    stride_c_m,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    TMA_OK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    expert = pid // (tiles_m * tiles_n)
    tile = pid % (tiles_m * tiles_n)
    m_start = (tile // tiles_n) * BLOCK_M
    n_start = (tile % tiles_n) * BLOCK_N
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N_OUT
    segment_start = tl.load(expert_offsets_ptr + expert)
    segment_end = tl.load(expert_offsets_ptr + expert + 1)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    whole_end = segment_start
    TMA: tl.constexpr = USE_TMA and TMA_OK
    if TMA:  # the whole blocks without masks, the operand that is not gathered by TMA
        whole_end += (segment_end - segment_start) // BLOCK_K * BLOCK_K
        acc = _outer_k_loop(
            acc, segment_start, whole_end, a_ptr, b_ptr, pair_row_ptr, a_desc, b_desc, segment_end, offs_m, mask_m,
            offs_n, mask_n, stride_a_row, stride_b_row, m_start, n_start, GATHER_A, GATHER_B, True, DOT_PRECISION, BLOCK_K,
            None,
        )  # fmt: skip
    # by pointers, masked: the whole segment, or after the TMA blocks its ragged tail (at most one block, not pipelined)
    acc = _outer_k_loop(
        acc, whole_end, segment_end, a_ptr, b_ptr, pair_row_ptr, a_desc, b_desc, segment_end, offs_m, mask_m, offs_n,
        mask_n, stride_a_row, stride_b_row, m_start, n_start, GATHER_A, GATHER_B, False, DOT_PRECISION, BLOCK_K,
        1 if TMA else None,
    )  # fmt: skip

    mask_out = mask_m[:, None] & mask_n[None, :]
    c_ptrs = c_ptr + expert.to(tl.int64) * stride_c_expert + offs_m[:, None] * stride_c_m + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_out)


# ----- a few tokens straight from the router's top-k (`triton_topk_mlp.py`): no layout, no tuning ----------------


@triton.jit
def topk_gate_up_kernel(
    x_ptr,  # [T, H], unit stride along H
    ids_ptr,  # [T * k] int64: the expert of pair p = token p // k, slot p % k (the top-k, token-major)
    weights_ptr,  # [T * k] routing weights
    w_ptr,  # [L, 2I, H]: gate rows, then up rows
    hw_ptr,  # [T * k, I] out: weight * act(gate) * up
    H,
    I,
    stride_x_row,
    stride_w_expert,
    stride_w_out,
    stride_w_k,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (pair, BLOCK_N columns of I): a matrix-vector product over the pair's expert's gate and up
    rows (a decode step is bound by reading the weights), rounded and activated as `gate_up_kernel` does."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K) * stride_x_row + offs_k
    gate_ptrs = w_ptr + expert * stride_w_expert + offs_n[:, None] * stride_w_out + offs_k[None, :] * stride_w_k
    up_ptrs = gate_ptrs + I * stride_w_out
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k_start in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k_start
        x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        mask = mask_n[:, None] & mask_k[None, :]
        acc_gate += tl.sum(tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        acc_up += tl.sum(tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_w_k
        up_ptrs += BLOCK_K * stride_w_k
    gate = acc_gate.to(hw_ptr.dtype.element_ty)
    up = acc_up.to(hw_ptr.dtype.element_ty)
    act, _ = apply_activation(gate.to(tl.float32), ACTIVATION)
    h = act * up.to(tl.float32) * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(hw_ptr + pair * I + offs_n, h.to(hw_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def topk_down_kernel(
    hw_ptr,  # [T * k, I] from `topk_gate_up_kernel`
    ids_ptr,  # [T * k] int64, as there
    w_ptr,  # [L, H, I]
    out_ptr,  # [T, H] out
    H,
    I,
    stride_w_expert,
    stride_w_out,
    stride_w_k,
    stride_out_row,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (token, BLOCK_N columns of H): each of the token's k pairs through its expert's down rows,
    the pair's output rounded to the output dtype (as the reference and the grouped kernels' default "rows_io" do),
    and the k outputs summed in fp32 in slot order: no atomics, the same bits on every run."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        hw_ptrs = hw_ptr + pair * I + offs_k
        w_ptrs = w_ptr + expert * stride_w_expert + offs_n[:, None] * stride_w_out + offs_k[None, :] * stride_w_k
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k_start in range(0, I, BLOCK_K):
            mask_k = offs_k < I - k_start
            hw = tl.load(hw_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32) * hw, axis=1)
            hw_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_w_k
        total += acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_out_row + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)
