"""DeepSeek-MoE 16B (`model_type "deepseek"`) through occult_hf's native class (`occult_hf.models.deepseek`).

Block `DeepseekMoeBlock`: `gate` is a transformers 5 style router returning
`(router_logits [T, E], topk_weights [T, k], topk_ids [T, k])`: softmax over all E logits in the hidden
dtype, `torch.topk(sorted=False)`, divided by the top-k sum (+1e-20) when `top_k > 1 and
norm_topk_prob`. Experts are fused (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`);
shared experts `shared_experts(x)` (when `n_shared_experts` is set) are added to every token. Layer i
is MoE iff `i >= first_k_dense_replace and i % moe_layer_freq == 0`.

In training with `aux_loss_alpha > 0` the block computes the published balance loss
(`block.balance_loss`, sequence-level when `seq_aux`) and attaches it to the routed output with
`AddAuxiliaryLoss` (forward unchanged, backward gives the loss a gradient of one). `route` returns that
loss as `aux_loss` and `attach_aux_loss` attaches it the same way, so a replaced block trains the same
balance loss. `route` should get the block's `[B, S, H]` input: the sequence-level loss averages per
sequence (a `[T, H]` input is one sequence).
"""

from __future__ import annotations

from occult_hf.models.deepseek.modeling_deepseek import AddAuxiliaryLoss

from ._routing import topk_ids_among_allowed
from ._transformers_moe import FusedExpertsAdapter
from .base import RouterOutput, register_adapter


class DeepseekAdapter(FusedExpertsAdapter):
    def route(self, block, x_TH):
        batch_size = x_TH.shape[0] if x_TH.dim() == 3 else 1
        logits_TE, topk_weights_Tk, topk_ids_Tk = self.router(block)(x_TH)
        return RouterOutput(
            logits_TE=logits_TE,
            topk_weights_Tk=topk_weights_Tk,
            topk_ids_Tk=topk_ids_Tk,
            aux_loss=block.balance_loss(logits_TE, topk_ids_Tk, batch_size),
        )

    def _choose(self, router, logits_TE, allowed_TE):
        return topk_ids_among_allowed(logits_TE.softmax(dim=-1), allowed_TE, router.top_k, sorted=False)

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        router = self.router(block)
        weights_Tk = logits_TE.softmax(dim=-1).gather(1, topk_ids_Tk)
        if router.top_k > 1 and router.norm_topk_prob:
            weights_Tk = weights_Tk / (weights_Tk.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_Tk

    def attach_aux_loss(self, block, routed_TH, aux_loss):
        if aux_loss is None:
            return routed_TH
        return AddAuxiliaryLoss.apply(routed_TH, aux_loss)


register_adapter(
    DeepseekAdapter(name="deepseek", block_class_names=("DeepseekMoeBlock",), num_experts_field="n_routed_experts")
)
