"""The runtime on a GPU in bf16: each family with the `torch` (grouped_mm) and `triton` expert backends
against the fp32 transformers model, judged beside transformers' own bf16 model (skipped without CUDA)."""

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

import occult_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _run(model, input_ids):
    model.train()  # DeepSeek-MoE trains its balance loss only in training mode
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    router_grads = [p.grad for n, p in model.named_parameters() if n.endswith("gate.weight")]
    return out.logits.detach(), out.loss.detach(), torch.cat([g.flatten() for g in router_grads])


def check_bf16_against_fp32(family: str, convert, label: str):
    """`family`'s tiny model in bf16, converted by `convert(model) -> model`, trained one step (forward and
    backward) against the fp32 transformers model: its logits, loss and router gradients must be as close to
    fp32 as transformers' own bf16 model's (within 2x its error, or 1e-2). Returns the converted model."""
    input_ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    reference = _run(tiny_model(family).cuda(), input_ids)
    transformers_bf16 = _run(tiny_model(family).cuda().to(torch.bfloat16), input_ids)
    model = convert(tiny_model(family).cuda().to(torch.bfloat16))
    converted = _run(model, input_ids)
    for name, ours, theirs, expected in zip(("logits", "loss", "router gradient"), converted, transformers_bf16, reference):
        error, hf_error = _rel(ours, expected), _rel(theirs, expected)
        assert torch.isfinite(ours).all(), f"{name} has NaN/inf"
        assert error <= max(1e-2, 2 * hf_error), f"{name}: {label} bf16 {error:.2e} vs transformers bf16 {hf_error:.2e}"
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_occult_model_tracks_fp32_as_closely_as_transformers_bf16(family, backend):
    config = occult_hf.OccultConfig(num_devices=4, expert_backend=backend)
    check_bf16_against_fp32(family, lambda model: occult_hf.apply_occult(model, config), "occult")


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek"])
def test_megablocks_model_tracks_fp32_as_closely_as_transformers_bf16(family):
    """The MegaBlocks rows' wrapper (`occult bench paper`), one process: OLMoE, Qwen1.5-MoE (its gated shared
    expert) and DeepSeek-MoE (dense first layer, shared experts, its balance loss) with every MoE block run by
    MegaBlocks' dMoE, judged as above (its grouped GEMMs compute in bf16 only). Skipped without MegaBlocks built."""
    from occult_hf.benchmarks.megablocks import MegaBlocksMoE, apply_megablocks, megablocks_missing

    if megablocks_missing() is not None:
        pytest.skip(megablocks_missing())
    model = check_bf16_against_fp32(family, apply_megablocks, "MegaBlocks")
    blocks = [m for m in model.modules() if isinstance(m, MegaBlocksMoE)]
    assert blocks and all(m.dmoe.experts.mlp.w1.grad.abs().sum() > 0 for m in blocks)  # the experts trained


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_generate_on_one_device_gives_stocks_tokens(family, monkeypatch):
    """Every family's eager dynamic-cache `generate()` on one device in fp32: each decoding step's experts come
    straight from the top-k (`LocalExperts.forward_topk`, compiled kernels), and the greedy tokens are stock's."""
    from occult_hf.kernels import triton_topk_mlp

    calls = []
    topk_path = triton_topk_mlp.expert_mlp_topk
    monkeypatch.setattr(triton_topk_mlp, "expert_mlp_topk", lambda *args: calls.append(1) or topk_path(*args))
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1)).cuda()
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_router_logits=False)
    expected = tiny_model(family, seed=2).cuda().generate(prompt, **kwargs)
    model = occult_hf.apply_occult(tiny_model(family, seed=2).cuda(), occult_hf.OccultConfig(num_devices=1))
    assert torch.equal(model.generate(prompt, **kwargs), expected)
    assert calls, "no decoding step went straight from the top-k"
