"""Mixtral (`MixtralForCausalLM`, e.g. Mixtral-8x7B / 8x22B).

Router (`MixtralTopKRouter`): softmax over all E logits in fp32, top-k of the probabilities
(sorted), always divided by their sum and kept in fp32 (no `norm_topk_prob` field, no cast back
to the logits' dtype). No shared experts; every decoder layer is MoE. Experts are transformers 5's
fused `MixtralExperts` (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, `act_fn`).

`router_jitter_noise` (0 in the published checkpoints) multiplies the block's input by uniform noise
in `[1 - j, 1 + j]` in training, before both the router and the experts; `block_input` draws it as
the model's block does (the same call on the same generator: the same noise for the same seed).

Shape legend: T tokens, H hidden, E routed experts, k experts per token.
"""

from __future__ import annotations

import torch

from ._transformers_moe import SoftmaxTopKAdapter
from .base import register_adapter


class MixtralAdapter(SoftmaxTopKAdapter):
    def block_input(self, block, hidden_states):
        if block.training and block.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
            return hidden_states * noise
        return hidden_states

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        weights_Tk = probs_TE.gather(1, topk_ids_Tk)
        return weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)


register_adapter(
    MixtralAdapter(name="mixtral", block_class_names=("MixtralSparseMoeBlock",), num_experts_field="num_local_experts")
)
