"""LoRA on the routed experts refuses to train on a placement with replicated experts (2 gloo ranks).

The expert adapters are rank-local, like the experts, and nothing sums their gradients over an expert's copies:
before, each copy's adapter got only the gradient of the pairs it served (as large a difference as the gradient)
and the copies drifted apart after the first step, without a word. Inference with an adapter (loaded whole, so
every copy gets the same factors) stays allowed.
"""

from __future__ import annotations

import numpy as np
import pytest

from distributed import run_world
from tiny_models import MOE_LAYERS, tiny_batch, tiny_model


def _lora_on_replicated_experts(rank, world_size):
    import peft
    import torch

    from occult_hf import OccultConfig, Placement, apply_occult
    from occult_hf.hf.peft_support import get_peft_model

    layers = MOE_LAYERS["olmoe"]
    primary = (np.arange(8) * world_size // 8).tolist()
    placement = Placement(8, world_size, {layer: primary for layer in layers}, {}, replicas={layer: {0: [1]} for layer in layers})
    model = apply_occult(tiny_model("olmoe", seed=3).train(), OccultConfig(placement=placement))
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = get_peft_model(model, lora)
    ids = tiny_batch(seed=500 + rank)
    with torch.no_grad():
        peft_model(input_ids=ids)  # inference is fine
    try:
        peft_model(input_ids=ids, labels=ids).loss.backward()
        return "trained"
    except NotImplementedError as error:
        return str(error)


@pytest.mark.world_size(2)
def test_lora_on_replicated_experts_refuses_to_train():
    for message in run_world(_lora_on_replicated_experts, 2):
        assert message.startswith(  # the backward reaches the last MoE layer first
            f"layer {MOE_LAYERS['olmoe'][-1]}: adapters (PEFT) on the routed experts cannot train with replicated experts (1 in this layer's "
            "placement): each copy's adapter would get only the gradient of the pairs it served"
        ), message
