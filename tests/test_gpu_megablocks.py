"""The MegaBlocks rows' wrapper on a GPU, one process: OLMoE, Qwen1.5-MoE (its gated shared expert) and
DeepSeek-MoE (dense first layer, shared experts, its balance loss in training) with every MoE block run by
MegaBlocks' dMoE give the fp32 transformers model's logits, loss and router gradients as closely as
transformers' own bf16 model does (MegaBlocks' grouped GEMMs compute in bf16 only, so bf16 is the only
comparison; the bound is the one of tests/test_gpu_runtime.py: within 2x transformers' bf16 error, or
1e-2). Expert parallelism over 2 GPUs is checked by `occult bench paper`'s megablocks rows themselves
(their `max rel. err.` against the stock logits). Skipped without CUDA or without MegaBlocks built."""

import pytest
import torch
from test_gpu_runtime import check_bf16_against_fp32

from occult_hf.benchmarks.megablocks import MegaBlocksMoE, apply_megablocks, megablocks_missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(megablocks_missing() is not None, reason=f"{megablocks_missing()}"),
]


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek"])
def test_megablocks_model_tracks_fp32_as_closely_as_transformers_bf16(family):
    model = check_bf16_against_fp32(family, apply_megablocks, "MegaBlocks")
    blocks = [m for m in model.modules() if isinstance(m, MegaBlocksMoE)]
    assert blocks and all(m.dmoe.experts.mlp.w1.grad.abs().sum() > 0 for m in blocks)  # the experts trained
