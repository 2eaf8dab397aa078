"""OLMoE (`OlmoeForCausalLM`): softmax top-k router, no shared experts, every layer MoE."""

from __future__ import annotations

from ._transformers_moe import SoftmaxTopKAdapter, config_field
from .base import register_adapter


class OlmoeAdapter(SoftmaxTopKAdapter):
    name = "olmoe"
    model_types = ("olmoe",)
    block_class_names = ("OlmoeSparseMoeBlock",)

    def num_experts(self, config) -> int:
        return config_field(config, "num_experts")

    def top_k(self, config) -> int:
        return config_field(config, "num_experts_per_tok")

    def shared_output(self, block, x_TH):
        return None


ADAPTER = register_adapter(OlmoeAdapter())
