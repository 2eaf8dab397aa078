"""OLMoE (`OlmoeForCausalLM`): softmax top-k router, no shared experts, every layer MoE."""

from __future__ import annotations

from ._transformers_moe import SoftmaxTopKAdapter
from .base import register_adapter


class OlmoeAdapter(SoftmaxTopKAdapter):
    name = "olmoe"
    model_types = ("olmoe",)
    block_class_names = ("OlmoeSparseMoeBlock",)

    num_experts_field = "num_experts"


ADAPTER = register_adapter(OlmoeAdapter())
