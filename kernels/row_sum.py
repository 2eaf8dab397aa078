"""Each token's returned rows summed in one pass (a Triton kernel): the combine's and the dispatch backward's last step.

Shape legend: see `occult_hf.dispatch.plan` (O rows of a padded block, J rows per token).

`dispatch.base.sum_token_rows` adds up, for every token, the rows its `row_TJ` points at. In PyTorch
(`sum_rows_torch`, the specification) that is a gather into a `[T, J, H]` temporary and a reduction of it: the rows
are written once more and read twice. Here one program per (token, block of H) loads the token's J rows, adds them
in fp32 in the order j = 0, 1, ... and stores the sum rounded to nearest even: every row byte is read once and the
output written once. A fixed order and no atomics: the result is repeatable; it equals PyTorch's for J <= 2 (the
"dedup" combine at D = 2) and within fp32 rounding for more rows, which PyTorch may add in another order.

Only for rows that need no gradient (inside the exchanges' autograd Functions, where the rows are what a
collective returned); the caller keeps the differentiable PyTorch path otherwise. Runs on CUDA tensors, and
on CPU tensors under `TRITON_INTERPRET=1` (tests).

Under `torch.compile`, `sum_rows` is the custom operator `occult::sum_rows`, which writes the sums into its `out`
argument (a chunk's slice of the output, in the exchanges) and returns nothing; its fake implementation has nothing
to compute. Elsewhere (and on a tensor Triton cannot run on) the operator sums by `sum_rows_torch`.
"""

from __future__ import annotations

import functools
import math

import torch

from .triton_support import cdiv, interpreting, next_power_of_2, require_triton, triton_runs_on


def available(rows_pad_OH: torch.Tensor) -> bool:
    """Whether the kernel can sum these rows: Triton is installed, they are on a GPU (or the interpreter runs), and
    they are not fp64 (the kernel adds in fp32; PyTorch adds fp64 rows in fp64)."""
    return rows_pad_OH.dtype != torch.float64 and triton_runs_on(rows_pad_OH)


def sum_rows_torch(rows_pad_OH: torch.Tensor, row_TJ: torch.Tensor, out_TH: torch.Tensor | None = None) -> torch.Tensor:
    """`sum_rows` by PyTorch: a gather of each token's rows and their sum, accumulated in fp32 (torch reduces
    bf16/fp16 in fp32) and rounded once to the rows' dtype."""
    return torch.sum(rows_pad_OH[row_TJ], dim=1, dtype=rows_pad_OH.dtype, out=out_TH)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel, made on first use (importing Triton with occult_hf would cost every process); one per mode, since
    `triton.jit` decides at decoration whether the kernel is compiled or interpreted (`TRITON_INTERPRET`). It uses
    only Triton builtins, so the interpreted one also works after Triton was imported without the interpreter."""
    triton = require_triton("the row-sum kernel (occult_hf.kernels.row_sum)")
    import triton.language as tl

    @triton.jit
    def sum_rows_kernel(
        rows_ptr, row_stride, index_ptr, index_stride_t, index_stride_j, out_ptr, out_stride, hidden,
        J: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < hidden
        acc = tl.full([BLOCK_H], 0.0, tl.float32)  # (tl.zeros is a jit function: not interpretable here)
        for j in tl.static_range(J):
            row = tl.load(index_ptr + token * index_stride_t + j * index_stride_j).to(tl.int64)
            start = tl.multiple_of(row * row_stride, ROW_ALIGN)  # rows of a packed block start aligned (see sum_rows)
            acc += tl.load(rows_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * out_stride + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return sum_rows_kernel


def sum_rows(rows_pad_OH: torch.Tensor, row_TJ: torch.Tensor, out_TH: torch.Tensor | None = None) -> torch.Tensor:
    """`[T, H]` in the rows' dtype, `out[t] = sum_j rows_pad_OH[row_TJ[t, j]]` accumulated in fp32 (see the module).

    `rows_pad_OH` may be a strided view (a field of a packed uint8 block) whose rows are contiguous; `row_TJ`
    any strides; `out_TH` (optional) a `[T, H]` tensor with contiguous rows, e.g. a chunk's slice of the output.
    """
    num_tokens = row_TJ.shape[0]
    hidden = rows_pad_OH.shape[1]
    if rows_pad_OH.stride(1) != 1:
        raise ValueError(f"sum_rows needs rows with contiguous elements, got strides {tuple(rows_pad_OH.stride())}")
    if out_TH is None:
        out_TH = torch.empty(num_tokens, hidden, dtype=rows_pad_OH.dtype, device=rows_pad_OH.device)
    elif out_TH.shape != (num_tokens, hidden) or out_TH.stride(1) != 1 or out_TH.dtype != rows_pad_OH.dtype:
        raise ValueError(
            f"sum_rows: out_TH must be [{num_tokens}, {hidden}] {rows_pad_OH.dtype} with contiguous rows, got "
            f"{list(out_TH.shape)} {out_TH.dtype} strides {tuple(out_TH.stride())}"
        )
    if torch.compiler.is_compiling():
        torch.ops.occult.sum_rows(rows_pad_OH, row_TJ, out_TH)
    else:
        _launch(rows_pad_OH, row_TJ, out_TH)
    return out_TH


def _launch(rows_pad_OH: torch.Tensor, row_TJ: torch.Tensor, out_TH: torch.Tensor) -> None:
    """The kernel over validated arguments (nothing to launch for no tokens or no columns)."""
    num_tokens, width = row_TJ.shape
    hidden = rows_pad_OH.shape[1]
    if num_tokens == 0 or hidden == 0:
        return
    block_h = min(next_power_of_2(hidden), 1024)
    # the largest power of two (at most 16 bytes of elements) dividing every row start: what the loads may vectorise by
    row_align = math.gcd(rows_pad_OH.stride(0), max(16 // rows_pad_OH.element_size(), 1))
    grid = (num_tokens, cdiv(hidden, block_h))
    _kernel(interpreting())[grid](
        rows_pad_OH, rows_pad_OH.stride(0), row_TJ, row_TJ.stride(0), row_TJ.stride(1), out_TH, out_TH.stride(0), hidden,
        J=width, ROW_ALIGN=row_align, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip


@torch.library.custom_op("occult::sum_rows", mutates_args=("out_TH",))
def _sum_rows_op(rows_pad_OH: torch.Tensor, row_TJ: torch.Tensor, out_TH: torch.Tensor) -> None:
    """`sum_rows` into `out_TH`, as one operator: the kernel where Triton runs on the rows, else `sum_rows_torch`."""
    if available(rows_pad_OH):
        _launch(rows_pad_OH, row_TJ, out_TH)
    else:
        sum_rows_torch(rows_pad_OH, row_TJ, out_TH)


@_sum_rows_op.register_fake
def _(rows_pad_OH, row_TJ, out_TH):
    return None


__all__ = ["available", "sum_rows", "sum_rows_torch"]
