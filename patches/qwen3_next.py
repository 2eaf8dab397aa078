"""Qwen3-Next (`Qwen3NextForCausalLM`, e.g. Qwen3-Next-80B-A3B): the MoE block is Qwen2-MoE's.

Router (`Qwen3NextTopKRouter`): fp32 softmax over all E logits, top-k of the probabilities
(sorted), divided by their sum when `norm_topk_prob` (True in the published checkpoints), cast to
the logits' dtype. One shared expert gated per token by `sigmoid(shared_expert_gate(x))`. Layers in
`mlp_only_layers` or off the `decoder_sparse_step` are dense. The token mixers (Gated DeltaNet
linear attention and gated full attention, by `config.layer_types`) are not part of the MoE block
and stay the model's own.
"""

from .base import register_adapter
from .qwen2_moe import Qwen2MoeAdapter

register_adapter(
    Qwen2MoeAdapter(name="qwen3_next", block_class_names=("Qwen3NextSparseMoeBlock",), num_experts_field="num_experts")
)
