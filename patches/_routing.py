"""Top-k selection restricted to allowed experts: the pieces the family adapters' `select` share.

Every function reproduces the model's own tensor operations when every expert is allowed (same
fills, same `topk` calls on bit-identical inputs), so `select` with an all-True mask returns
exactly what the model's router returns. Restricting to allowed experts means: a disallowed expert
is never chosen and does not count toward a group's score.

Shape legend: T tokens, E routed experts, G expert groups, k experts per token.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def check_allowed(allowed_TE: torch.Tensor, logits_TE: torch.Tensor, top_k: int) -> None:
    """`allowed_TE` must be a bool `[T, E]` mask like `logits_TE` with at least `top_k` True per token."""
    if allowed_TE.dtype != torch.bool:
        raise ValueError(f"allowed_TE must be a bool tensor, got dtype {allowed_TE.dtype}")
    if allowed_TE.shape != logits_TE.shape:
        raise ValueError(
            f"allowed_TE has shape {tuple(allowed_TE.shape)}; it must match logits_TE {tuple(logits_TE.shape)}"
        )
    if not allowed_TE.shape[0]:
        return
    fewest = allowed_TE.sum(dim=-1).min()
    message = f"allowed_TE leaves some token fewer than top_k={top_k} allowed experts (allow more devices or experts per token)"
    if allowed_TE.is_cuda or torch.compiler.is_compiling():
        # reading `fewest` on the host would stall the stream once per MoE layer and forward (and break a
        # traced graph): the device checks it and fails the launch with this message instead
        torch._assert_async(fewest >= top_k, message)
    elif int(fewest) < top_k:
        raise ValueError(f"{message}; one token has {int(fewest)}")


def topk_ids_among_allowed(scores_TE: torch.Tensor, allowed_TE: torch.Tensor, top_k: int, *, sorted: bool) -> torch.Tensor:
    """`[T, k]` ids of the `top_k` highest scores among allowed experts (disallowed ones set to -inf)."""
    return torch.topk(scores_TE.masked_fill(~allowed_TE, NEG_INF), top_k, dim=-1, sorted=sorted)[1]


def allowed_group_scores(choice_TE: torch.Tensor, allowed_TE: torch.Tensor, num_groups: int, rule: str) -> torch.Tensor:
    """`[T, G]` group scores over allowed experts only; a group without allowed experts scores -inf.

    rule "max" (DeepSeek-V2 group_limited_greedy): the best allowed score in the group.
    rule "top2_sum" (DeepSeek-V3): the sum of the two best allowed scores (one if only one is allowed).
    """
    tokens, experts = choice_TE.shape
    masked_TGn = choice_TE.masked_fill(~allowed_TE, NEG_INF).view(tokens, num_groups, experts // num_groups)
    if rule == "max":
        return masked_TGn.max(dim=-1).values
    if rule == "top2_sum":
        best2_TG2 = masked_TGn.topk(2, dim=-1)[0]
        present_TG2 = torch.isfinite(best2_TG2)
        summed_TG = torch.where(present_TG2, best2_TG2, torch.zeros_like(best2_TG2)).sum(dim=-1)
        return torch.where(present_TG2.any(dim=-1), summed_TG, torch.full_like(summed_TG, NEG_INF))
    raise ValueError(f"unknown group score rule {rule!r}; valid rules: ['max', 'top2_sum']")


def kept_groups_expert_mask(
    group_scores_TG: torch.Tensor, allowed_TE: torch.Tensor, topk_group: int, top_k: int
) -> torch.Tensor:
    """`[T, E]` bool: experts in each token's `topk_group` best groups.

    If those groups hold fewer than `top_k` allowed experts, the next-best groups are added until
    they hold `top_k` (the model's rule cannot be met otherwise; with every expert allowed this never
    happens because the model requires `topk_group * E / G >= top_k`).
    """
    tokens, experts = allowed_TE.shape
    num_groups = group_scores_TG.shape[-1]
    per_group = experts // num_groups
    order_TG = group_scores_TG.argsort(dim=-1, descending=True, stable=True)
    allowed_in_group_TG = allowed_TE.view(tokens, num_groups, per_group).sum(dim=-1)
    reach_TG = allowed_in_group_TG.gather(1, order_TG).cumsum(dim=-1)  # allowed experts in the best j+1 groups
    groups_needed_T = ((reach_TG < top_k).sum(dim=-1) + 1).clamp(min=topk_group)
    keep_sorted_TG = torch.arange(num_groups, device=order_TG.device)[None, :] < groups_needed_T[:, None]
    keep_TG = torch.zeros_like(keep_sorted_TG).scatter(1, order_TG, keep_sorted_TG)
    return keep_TG.repeat_interleave(per_group, dim=1)


def check_groups(num_experts: int, num_groups: int, topk_group: int, top_k: int, where: str) -> None:
    """The group layout the DeepSeek routers assume; a clear error instead of a reshape failure."""
    if num_groups is None or topk_group is None or num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{where}: n_group={num_groups} must be a positive divisor of the expert count {num_experts}")
    if not 1 <= topk_group <= num_groups:
        raise ValueError(f"{where}: topk_group={topk_group} must lie in [1, n_group={num_groups}]")
    if topk_group * (num_experts // num_groups) < top_k:
        raise ValueError(
            f"{where}: topk_group={topk_group} groups of {num_experts // num_groups} experts cannot hold "
            f"num_experts_per_tok={top_k} experts"
        )


__all__ = [
    "check_allowed",
    "topk_ids_among_allowed",
    "allowed_group_scores",
    "kept_groups_expert_mask",
    "check_groups",
]
