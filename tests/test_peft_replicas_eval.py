"""LoRA on replicated routed experts evaluates (2 gloo ranks): only a backward that reaches the adapters is refused.

Loaded whole, every copy of an expert gets the same adapter factors, so a forward is exact whether or not grad is
enabled (eval mode, a metric, `generate` outside `torch.no_grad`); what cannot work is training them, as nothing
sums the adapters' gradients over an expert's copies: that backward stops with a clear error before any adapter
gradient is written.
"""

from __future__ import annotations

import numpy as np
import pytest
from distributed import run_world
from tiny_models import MOE_LAYERS, tiny_batch, tiny_model

REFUSAL = (
    "adapters (PEFT) on the routed experts cannot train with replicated experts (1 in this layer's placement): "
    "each copy's adapter would get only the gradient of the pairs it served"
)


def _evaluate_then_train(rank, world_size):
    import peft
    import torch

    from occult_hf import OccultConfig, Placement, apply_occult
    from occult_hf.hf.peft_support import get_peft_model

    layers = MOE_LAYERS["olmoe"]
    primary = (np.arange(8) * world_size // 8).tolist()
    replicas = {layer: {0: [1]} for layer in layers}
    placement = Placement(8, world_size, {layer: primary for layer in layers}, {}, replicas=replicas)
    model = apply_occult(tiny_model("olmoe", seed=3), OccultConfig(placement=placement))
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=experts)
    peft_model = get_peft_model(model, lora)
    adapters = {name: param for name, param in peft_model.named_parameters() if "lora_" in name and "experts" in name}
    assert adapters and all(param.requires_grad for param in adapters.values())
    generator = torch.Generator().manual_seed(11)  # the same factors on both ranks, as a loaded adapter has them
    with torch.no_grad():
        for name in sorted(adapters):
            adapters[name].copy_(torch.randn(adapters[name].shape, generator=generator) * 0.1)
    ids = tiny_batch(seed=500 + rank)

    peft_model.eval()
    with torch.no_grad():
        reference = peft_model(input_ids=ids).logits
    evaluated = peft_model(input_ids=ids).logits  # grad enabled, eval mode
    assert evaluated.requires_grad
    torch.testing.assert_close(evaluated.detach(), reference, rtol=0, atol=0)
    scored = peft_model(input_ids=ids, labels=ids).loss  # a metric's forward: no backward follows
    assert torch.isfinite(scored)

    peft_model.train()
    try:
        peft_model(input_ids=ids, labels=ids).loss.backward()
    except NotImplementedError as error:
        untouched = all(param.grad is None for param in adapters.values())
        return str(error), untouched
    return "trained", None


@pytest.mark.world_size(2)
def test_lora_on_replicated_experts_evaluates_with_grad_enabled_and_refuses_to_train():
    for message, untouched in run_world(_evaluate_then_train, 2):
        assert REFUSAL in message, message
        last = MOE_LAYERS["olmoe"][-1]
        assert message.startswith(f"layer {last}: "), message  # the last layer's backward runs first
        assert untouched, "an adapter on the replicated experts got a gradient before the refusal"
