"""occult_hf without Triton (CPU torch from PyPI brings none): importing it and the CPU path work, and every Triton
path fails with one clear error that names what needed Triton and how to install it.

A child process hides `triton` behind a meta-path finder (any `import triton...` raises ModuleNotFoundError, as if it
were not installed), imports occult_hf, runs a tiny OLMoE with Occult blocks at 2 logical devices forward and
backward (its logits equal the stock model's), compiles the expert computation (aot_eager, fullgraph), and checks
that nothing imported Triton.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
sys.path.insert(0, TESTS)

import pytest
import torch
import torch.nn.functional as F

import occult_hf
from occult_hf.experts import local_experts
from occult_hf.kernels import ExpertSegments, row_sum
from occult_hf.kernels.replica_routes import fused_expert_routes
from tiny_models import tiny_model

stock = tiny_model("olmoe", seed=0)
model = occult_hf.apply_occult(tiny_model("olmoe", seed=0), occult_hf.OccultConfig(num_devices=2))
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
out = model(input_ids=ids, labels=ids)
out.loss.backward()
torch.testing.assert_close(out.logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

x, gate_up, down = torch.randn(5, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
topk_ids, topk_weights = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]]), torch.rand(5, 2)


def experts(x, topk_weights, backend):
    segments, weight_N = ExpertSegments.from_topk(topk_ids, topk_weights, 3)
    return local_experts(x, segments, weight_N, gate_up, down, F.silu, backend)


compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
torch.testing.assert_close(compiled(x, topk_weights, "torch"), experts(x, topk_weights, "torch"))
for backend in ("triton", "grouped_mm_fused"):
    with pytest.raises(ImportError, match=rf"expert_backend='{backend}'.*pip install triton.*CUDA build of torch"):
        experts(x, topk_weights, backend)
assert not row_sum.available(torch.zeros(1))
with pytest.raises(ImportError, match=r"the row-sum kernel .*pip install triton"):
    row_sum.sum_rows(torch.zeros(3, 4), torch.zeros(2, 1, dtype=torch.int64))
with pytest.raises(ImportError, match=r"replica rule's kernel .*pip install triton"):
    fused_expert_routes(torch.zeros(1, 4, 3, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int64), 2, 0, 0.0, False)
assert not [name for name in sys.modules if name == "triton" or name.startswith("triton.")]
print("ok without triton")
"""


def test_cpu_path_and_errors_without_triton():
    script = f"TESTS = {str(TESTS)!r}\n" + SCRIPT
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok without triton" in result.stdout, result.stdout[-3000:] + result.stderr[-6000:]
