"""DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`).

Router (`DeepseekV3TopkRouter`): fp32 logits, sigmoid scores; the choice uses scores plus the
`e_score_correction_bias` buffer: keep the `topk_group` groups (of E / `n_group` experts) whose two
best biased scores sum highest, then the top-k biased scores inside them. The weights are the
chosen experts' unbiased sigmoid scores, divided by their sum (+1e-20) when `norm_topk_prob`, times
`routed_scaling_factor`. Shared experts: `shared_experts(x)` added to every token. The first
`first_k_dense_replace` layers are dense.

Restricted to allowed experts (`select`), the same rule runs on the biased scores of allowed
experts only: a group's score is the sum of its two best allowed experts (its only allowed one, or
-inf with none), and if the kept groups hold fewer than k allowed experts the next-best groups are
added until they do.
"""

from __future__ import annotations

from ._routing import allowed_group_scores, check_groups, kept_groups_expert_mask, topk_ids_among_allowed
from ._transformers_moe import FusedExpertsAdapter
from .base import register_adapter


class DeepseekV3Adapter(FusedExpertsAdapter):
    def _choose(self, router, logits_TE, allowed_TE):
        check_groups(router.num_experts, router.num_group, router.topk_group, router.top_k, "DeepSeek-V3 router")
        choice_TE = logits_TE.sigmoid() + router.e_score_correction_bias
        group_scores_TG = allowed_group_scores(choice_TE, allowed_TE, router.num_group, rule="top2_sum")
        in_kept_groups_TE = kept_groups_expert_mask(group_scores_TG, allowed_TE, router.topk_group, router.top_k)
        limited_TE = choice_TE.masked_fill(~in_kept_groups_TE, float("-inf"))
        return topk_ids_among_allowed(limited_TE, allowed_TE, router.top_k, sorted=False)

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        router = self.router(block)
        weights_Tk = logits_TE.sigmoid().gather(1, topk_ids_Tk)
        if router.norm_topk_prob:
            weights_Tk = weights_Tk / (weights_Tk.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_Tk * router.routed_scaling_factor


register_adapter(
    DeepseekV3Adapter(
        name="deepseek_v3",
        block_class_names=("DeepseekV3MoE",),
        num_experts_field="n_routed_experts",
    )
)
