"""DeepSeek-V2 (`DeepseekV2ForCausalLM`, transformers' own port).

Router (`DeepseekV2TopkRouter`): fp32 logits, softmax over all E; `topk_method` "greedy" takes the
top-k probabilities, "group_limited_greedy" first keeps the `topk_group` groups (of E / `n_group`
experts) with the highest max probability and zeroes the rest; the weights are the chosen
probabilities times `routed_scaling_factor`, not renormalised (transformers' port ignores
`norm_topk_prob`). Shared experts: `shared_experts(x)` added to every token. The first
`first_k_dense_replace` layers are dense.
"""

from __future__ import annotations

import torch

from ._routing import allowed_group_scores, check_groups, kept_groups_expert_mask, topk_ids_among_allowed
from ._transformers_moe import FusedExpertsAdapter
from .base import register_adapter

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Adapter(FusedExpertsAdapter):
    def _choose(self, router, logits_TE, allowed_TE):
        probs_TE = logits_TE.softmax(dim=-1, dtype=torch.float32)
        if router.topk_method == "greedy":
            return topk_ids_among_allowed(probs_TE, allowed_TE, router.top_k, sorted=False)
        if router.topk_method == "group_limited_greedy":
            check_groups(router.num_experts, router.num_group, router.topk_group, router.top_k, "DeepSeek-V2 router")
            group_scores_TG = allowed_group_scores(probs_TE, allowed_TE, router.num_group, rule="max")
            in_kept_groups_TE = kept_groups_expert_mask(group_scores_TG, allowed_TE, router.topk_group, router.top_k)
            # as the model: experts outside the kept groups score 0; disallowed experts can never win
            limited_TE = probs_TE.masked_fill(~in_kept_groups_TE, 0.0)
            return topk_ids_among_allowed(limited_TE, allowed_TE, router.top_k, sorted=False)
        raise ValueError(f"DeepSeek-V2 topk_method={router.topk_method!r} is not supported; valid: {list(TOPK_METHODS)}")

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        router = self.router(block)
        probs_TE = logits_TE.softmax(dim=-1, dtype=torch.float32)
        return probs_TE.gather(1, topk_ids_Tk) * router.routed_scaling_factor


register_adapter(
    DeepseekV2Adapter(
        name="deepseek_v2",
        block_class_names=("DeepseekV2Moe",),
        num_experts_field="n_routed_experts",
    )
)
