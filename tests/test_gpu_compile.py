"""GPU checks of whole occult models under torch.compile (skipped without CUDA): inductor and CUDA graphs.

- a tiny occult model (every family, one device and 2 logical devices with pruning) compiled with inductor,
  `fullgraph=True`, equals eager in bf16 within 1e-2: logits, loss and every gradient;
- `generate(cache_implementation="static")` with transformers' default compile config (inductor,
  `mode="reduce-overhead"`: CUDA graphs) gives eager's greedy tokens in fp32, and its decoding steps compile once.

Run: `python -m pytest -q -m gpu tests/test_gpu_compile.py`.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import FAMILIES, tiny_batch, tiny_model

from occult_hf import OccultConfig, apply_occult

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: families whose stock model compiles forward and backward (Qwen3-Next's reference linear attention does not)
COMPILABLE = [family for family in FAMILIES if family != "qwen3_next"]


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def _step(model, call, input_ids):
    model.zero_grad(set_to_none=True)
    out = call(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", COMPILABLE)
@pytest.mark.parametrize(("num_devices", "prune"), [(1, None), (2, "router")])
def test_inductor_compiled_model_equals_eager_in_bf16(family, num_devices, prune):
    model = tiny_model(family).to("cuda", torch.bfloat16).train()
    settings = {"num_devices": num_devices} | ({"prune": prune, "max_devices_per_token": 1} if prune else {})
    apply_occult(model, OccultConfig(**settings))
    input_ids = tiny_batch(batch=4, seq=32, seed=1).cuda()
    loss, logits, grads = _step(model, model, input_ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    c_loss, c_logits, c_grads = _step(model, compiled, input_ids)
    assert _relative(c_logits, logits) <= 1e-2 and _relative(c_loss, loss) <= 1e-2
    assert c_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert _relative(c_grads[name], grad) <= 1e-2, name


def test_static_cache_generate_with_cuda_graphs_gives_eager_tokens():
    from torch._dynamo.utils import counters

    model = tiny_model("olmoe").cuda()
    apply_occult(model, OccultConfig(num_devices=2))
    prompt = tiny_batch(batch=2, seq=8, seed=3).cuda()
    kwargs = dict(max_new_tokens=8, do_sample=False, output_router_logits=False)
    expected = model.generate(prompt, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    tokens = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(tokens, expected)
    again = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(again, expected)
    assert not counters["graph_break"], f"graph breaks: {list(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
