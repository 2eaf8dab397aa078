"""Qwen2-MoE / Qwen1.5-MoE (`Qwen2MoeForCausalLM`): softmax top-k router and one shared expert
gated per token by `sigmoid(shared_expert_gate(x))`; layers in `mlp_only_layers` or off the
`decoder_sparse_step` are dense."""

from __future__ import annotations

import torch

from ._transformers_moe import SoftmaxTopKAdapter
from .base import register_adapter


class Qwen2MoeAdapter(SoftmaxTopKAdapter):
    def shared_output(self, block, x_TH):
        return torch.sigmoid(block.shared_expert_gate(x_TH)) * block.shared_expert(x_TH)


register_adapter(
    Qwen2MoeAdapter(
        name="qwen2_moe",
        block_class_names=("Qwen2MoeSparseMoeBlock",),
        num_experts_field="num_experts",
    )
)
