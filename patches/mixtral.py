"""Mixtral (`MixtralForCausalLM`, e.g. Mixtral-8x7B / 8x22B).

Router (`MixtralTopKRouter`): softmax over all E logits in fp32, top-k of the probabilities
(sorted), always divided by their sum and kept in fp32 (no `norm_topk_prob` field, no cast back
to the logits' dtype). No shared experts; every decoder layer is MoE. Experts are transformers 5's
fused `MixtralExperts` (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, `act_fn`).

`router_jitter_noise` (0 in the published checkpoints) multiplies the block's input by noise in
training before both the router and the experts; the replacement block does not reproduce that,
so training with it is refused.

Shape legend: T tokens, H hidden, E routed experts, k experts per token.
"""

from __future__ import annotations

import torch

from ._transformers_moe import SoftmaxTopKAdapter
from .base import RouterOutput, register_adapter


class MixtralAdapter(SoftmaxTopKAdapter):
    def route(self, block, x_TH) -> RouterOutput:
        if block.training and block.jitter_noise > 0:
            raise ValueError(
                f"Mixtral router_jitter_noise={block.jitter_noise} in training is not supported by occult_hf "
                f"(the noise also scales the experts' input); set config.router_jitter_noise=0"
            )
        return super().route(block, x_TH)

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        weights_Tk = probs_TE.gather(1, topk_ids_Tk)
        return weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)


ADAPTER = register_adapter(
    MixtralAdapter(name="mixtral", block_class_names=("MixtralSparseMoeBlock",), num_experts_field="num_local_experts")
)
