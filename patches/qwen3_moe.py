"""Qwen3-MoE (`Qwen3MoeForCausalLM`): softmax top-k router (usually `norm_topk_prob=True`), no
shared experts; layers in `mlp_only_layers` or off the `decoder_sparse_step` are dense."""

from __future__ import annotations

from ._transformers_moe import SoftmaxTopKAdapter, config_field
from .base import register_adapter


class Qwen3MoeAdapter(SoftmaxTopKAdapter):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    block_class_names = ("Qwen3MoeSparseMoeBlock",)

    def num_experts(self, config) -> int:
        return config_field(config, "num_experts")

    def top_k(self, config) -> int:
        return config_field(config, "num_experts_per_tok")

    def shared_output(self, block, x_TH):
        return None


ADAPTER = register_adapter(Qwen3MoeAdapter())
