"""OLMoE (`OlmoeForCausalLM`): softmax top-k router, no shared experts, every layer MoE."""

from ._transformers_moe import SoftmaxTopKAdapter
from .base import register_adapter

register_adapter(
    SoftmaxTopKAdapter(name="olmoe", block_class_names=("OlmoeSparseMoeBlock",), num_experts_field="num_experts")
)
