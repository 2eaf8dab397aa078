"""Qwen3-MoE (`Qwen3MoeForCausalLM`): softmax top-k router (usually `norm_topk_prob=True`), no
shared experts; layers in `mlp_only_layers` or off the `decoder_sparse_step` are dense."""

from ._transformers_moe import SoftmaxTopKAdapter
from .base import register_adapter

register_adapter(
    SoftmaxTopKAdapter(name="qwen3_moe", block_class_names=("Qwen3MoeSparseMoeBlock",), num_experts_field="num_experts")
)
