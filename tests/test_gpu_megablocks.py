"""The MegaBlocks rows' wrapper on a GPU, one process: OLMoE, Qwen1.5-MoE (its gated shared expert) and
DeepSeek-MoE (dense first layer, shared experts, its balance loss in training) with every MoE block run by
MegaBlocks' dMoE give the fp32 transformers model's logits, loss and router gradients as closely as
transformers' own bf16 model does (MegaBlocks' grouped GEMMs compute in bf16 only, so bf16 is the only
comparison; the bound is the one of tests/test_gpu_runtime.py: within 2x transformers' bf16 error, or
1e-2). Expert parallelism over 2 GPUs is checked by `occult bench paper`'s megablocks rows themselves
(their `max rel. err.` against the stock logits). Skipped without CUDA or without MegaBlocks built."""

import pytest
import torch
from test_gpu_runtime import _rel, _run
from tiny_models import tiny_model

from occult_hf.benchmarks.megablocks import MegaBlocksMoE, apply_megablocks, megablocks_missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(megablocks_missing() is not None, reason=f"{megablocks_missing()}"),
]


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek"])
def test_megablocks_model_tracks_fp32_as_closely_as_transformers_bf16(family):
    input_ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    logits_32, loss_32, router_grad_32 = _run(tiny_model(family).cuda(), input_ids)
    logits_hf, loss_hf, router_grad_hf = _run(tiny_model(family).cuda().to(torch.bfloat16), input_ids)

    model = apply_megablocks(tiny_model(family).cuda().to(torch.bfloat16))
    assert any(isinstance(m, MegaBlocksMoE) for m in model.modules())
    logits, loss, router_grad = _run(model, input_ids)
    expert_grads = [m.dmoe.experts.mlp.w1.grad for m in model.modules() if isinstance(m, MegaBlocksMoE)]
    assert all(g is not None and g.abs().sum() > 0 for g in expert_grads)

    for name, ours, theirs, reference in (
        ("logits", logits, logits_hf, logits_32),
        ("loss", loss, loss_hf, loss_32),
        ("router gradient", router_grad, router_grad_hf, router_grad_32),
    ):
        error, hf_error = _rel(ours, reference), _rel(theirs, reference)
        assert torch.isfinite(ours).all(), f"{name} has NaN/inf"
        assert error <= max(1e-2, 2 * hf_error), f"{name}: MegaBlocks bf16 {error:.2e} vs transformers bf16 {hf_error:.2e}"
