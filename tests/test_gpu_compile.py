"""GPU checks of whole occult models under torch.compile (skipped without CUDA): inductor and CUDA graphs.

- a tiny occult model (every family, one device and 2 logical devices with pruning) compiled with inductor,
  `fullgraph=True`, equals eager in fp32 within 1e-4: logits, loss and every gradient (the same Triton kernels run
  in both; inductor's own code for the rest reorders reductions, 1e-6 on the CPU). In bf16 the two differ by bf16's
  rounding, and on a tiny model one token whose pruned or top-k routing sits on a tie moves between experts (a 5%
  change of one expert's gradient, measured): bf16 against fp32 is `test_gpu_runtime.py`'s check;
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


def _named(step) -> dict[str, torch.Tensor]:
    loss, logits, grads = step
    return {"loss": loss, "logits": logits} | grads


@pytest.mark.parametrize("family", COMPILABLE)
@pytest.mark.parametrize(("num_devices", "prune"), [(1, None), (2, "router")])
def test_inductor_compiled_model_equals_eager_in_fp32(family, num_devices, prune):
    settings = {"num_devices": num_devices} | ({"prune": prune, "max_devices_per_token": 1} if prune else {})
    model = apply_occult(tiny_model(family).cuda().train(), OccultConfig(**settings))
    input_ids = tiny_batch(batch=4, seq=32, seed=1).cuda()
    eager = _named(_step(model, model, input_ids))
    torch._dynamo.reset()
    compiled = _named(_step(model, torch.compile(model, fullgraph=True), input_ids))
    assert compiled.keys() == eager.keys()
    for name, expected in eager.items():
        assert _relative(compiled[name], expected) <= 1e-4, f"{name}: {_relative(compiled[name], expected):.2e}"


def test_a_call_that_tunes_the_kernels_equals_a_call_that_launches_them_directly_in_fp32(monkeypatch):
    """With the Triton tuning caches emptied, the first eager forward+backward of an occult model tunes every kernel
    (the autotuner times each candidate on the call's own tensors) and the second launches the chosen configs
    directly (`run_tuned`): the two agree within 1e-5 (fp32; candidates differ only in their reduction blocks). A
    tuning call that differed would make the first step of every run wrong, and the other tests, whose caches are
    warm after a worker's first test, would not see it."""
    from occult_hf.kernels import grouped_mm_fused_kernels, triton_expert_mlp_kernels
    from triton.runtime.autotuner import Autotuner

    for module in (triton_expert_mlp_kernels, grouped_mm_fused_kernels):
        for tuner in vars(module).values():
            if isinstance(tuner, Autotuner):
                monkeypatch.setattr(tuner, "cache", {})
    model = apply_occult(tiny_model("olmoe").cuda().train(), OccultConfig(num_devices=2, prune="router", max_devices_per_token=1))
    input_ids = tiny_batch(batch=4, seq=32, seed=1).cuda()
    tuning = _named(_step(model, model, input_ids))
    direct = _named(_step(model, model, input_ids))
    for name, expected in direct.items():
        assert _relative(tuning[name], expected) <= 1e-5, f"{name}: {_relative(tuning[name], expected):.2e}"


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
