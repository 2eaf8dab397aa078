"""`kernels.row_sum`: the Triton kernel that sums each token's returned rows, against `torch.sum` of the gathered rows.

On CPU the kernel runs under the Triton interpreter (`TRITON_INTERPRET=1` when the kernel is first made: it uses
only Triton builtins, so this works in a process that imported Triton before). The interpreter rounds fp32 to
bf16 toward zero where compiled kernels round to nearest even, so in bf16 the interpreted sums are checked within
one bf16 step of the fp32 sum, and exactly against PyTorch by the `gpu` test. The custom operator
`occult::sum_rows` (what `torch.compile` traces) is checked here with the kernel behind it (opcheck, and a compiled
call equal to the eager one); tests/test_compile_ops.py checks it with the torch sum behind it.
"""

from __future__ import annotations

import pytest
import torch

from occult_hf.kernels import row_sum
from occult_hf.dispatch.base import RowFormat


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _problem(dtype, hidden: int, rows: int, tokens: int, width: int, device="cpu"):
    """A packed block's activation field (strided rows, row 0 zero, as an exchange returns it) and a transposed
    (strided) `[T, J]` index into it."""
    row_format = RowFormat([(dtype, hidden), (torch.int32, 3), (dtype, 3)])
    block = torch.randint(0, 255, (rows, row_format.row_bytes), dtype=torch.uint8, device=device)  # garbage around the field
    x_OH = row_format.unpack(block)[0]
    x_OH.copy_(torch.randn(rows, hidden, device=device).to(dtype))
    x_OH[0].zero_()
    row_TJ = torch.randint(0, rows, (width, tokens), device=device).t()
    return x_OH, row_TJ


def _fp32_sum(x_OH, row_TJ) -> torch.Tensor:
    """The fp32 sum in the kernel's order (j = 0, 1, ...), before rounding."""
    gathered = x_OH[row_TJ].float()
    total = gathered[:, 0].clone()
    for j in range(1, gathered.shape[1]):
        total += gathered[:, j]
    return total


@pytest.mark.parametrize("width", [1, 2, 5])
def test_fp32_sums_in_the_kernels_order(interpreted, width):
    torch.manual_seed(width)
    x_OH, row_TJ = _problem(torch.float32, hidden=40, rows=9, tokens=6, width=width)  # H not a multiple of the block
    assert x_OH.stride(0) != x_OH.shape[1]  # a strided field of the block
    expected = _fp32_sum(x_OH, row_TJ)  # the kernel's order; PyTorch may add J >= 3 rows in another
    assert torch.equal(row_sum.sum_rows(x_OH, row_TJ), expected)
    torch.testing.assert_close(expected, torch.sum(x_OH[row_TJ], dim=1), rtol=1e-6, atol=1e-6)
    out = torch.full((10, 40), float("nan"))
    row_sum.sum_rows(x_OH, row_TJ, out[2:8])  # a chunk's slice: only its rows are written
    assert torch.equal(out[2:8], expected) and out[:2].isnan().all() and out[8:].isnan().all()
    assert row_sum.sum_rows(x_OH, row_TJ[:0]).shape == (0, 40)


def test_bf16_sums_within_one_step(interpreted):
    torch.manual_seed(0)
    x_OH, row_TJ = _problem(torch.bfloat16, hidden=24, rows=7, tokens=5, width=3)
    out = row_sum.sum_rows(x_OH, row_TJ)
    assert out.dtype == torch.bfloat16
    total = _fp32_sum(x_OH, row_TJ)
    step = total.abs().clamp_min(1e-30) * 2.0**-7  # one bf16 step (8 significant bits) or less
    assert ((out.float() - total).abs() <= step).all()


def test_bad_output_is_named(interpreted):
    x_OH, row_TJ = torch.zeros(3, 4), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"out_TH must be \[2, 4\]"):
        row_sum.sum_rows(x_OH, row_TJ, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="contiguous elements"):
        row_sum.sum_rows(torch.zeros(4, 3).t(), row_TJ)


def test_operator_with_the_kernel_behind_it(interpreted):
    """`occult::sum_rows` over a packed block's strided field: opcheck (its one mutated argument, fake tensors,
    AOT dispatch), and `sum_rows` compiled (fullgraph) writes what the eager kernel writes into a chunk's slice."""
    from torch.library import opcheck

    torch.manual_seed(1)
    x_OH, row_TJ = _problem(torch.float32, hidden=40, rows=9, tokens=6, width=3)
    opcheck(torch.ops.occult.sum_rows, (x_OH, row_TJ, torch.empty(6, 40)))

    def into_chunk(x_OH, row_TJ, out_TH):
        row_sum.sum_rows(x_OH, row_TJ, out_TH[2:8])
        return out_TH

    compiled = torch.compile(into_chunk, backend="aot_eager", fullgraph=True)
    got, want = (f(x_OH, row_TJ, torch.full((10, 40), float("nan"))) for f in (compiled, into_chunk))
    assert torch.equal(got[2:8], want[2:8]) and got[:2].isnan().all() and got[8:].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_row_sums_equal_torch(dtype):
    """Compiled, at the real size of a combine (T = 16384, H = 2048, J = 2, where any order gives the same sum):
    bit for bit PyTorch's sum, rounded to nearest even."""
    torch.manual_seed(0)
    x_OH, row_TJ = _problem(dtype, hidden=2048, rows=2 * 16384 + 1, tokens=16384, width=2, device="cuda")
    assert torch.equal(row_sum.sum_rows(x_OH, row_TJ), torch.sum(x_OH[row_TJ], dim=1, dtype=dtype))
