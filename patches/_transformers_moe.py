"""What the transformers 5.x MoE families have in common, declared once.

In transformers 5 the routed experts of OLMoE, Qwen2/3-MoE and DeepSeek-V2/V3 live in one
`experts` module with fused 3D parameters (`gate_up_proj [E, 2I, H]`, gate rows first, and
`down_proj [E, H, I]`) and an `act_fn`; the router is the block's `gate` module and returns
`(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])`. `FusedExpertsAdapter` states
that layout; `SoftmaxTopKAdapter` adds the softmax-then-top-k rule of the OLMoE/Qwen routers.

Shape legend: T tokens, H hidden, E routed experts, k experts per token, I expert width.
"""

from __future__ import annotations

import abc
from typing import Callable

import torch
from torch import nn

from ._routing import check_allowed, topk_ids_among_allowed
from .base import MoEAdapter, RouterOutput


class FusedExpertsAdapter(MoEAdapter):
    """Families whose block has `gate` (3-tuple router) and `experts` (fused transformers 5 experts).

    Subclasses give the family's selection rule (`_choose`) and weight rule (`renormalize`).
    """

    def router(self, block: nn.Module) -> nn.Module:
        return block.gate

    def route(self, block: nn.Module, x_TH: torch.Tensor) -> RouterOutput:
        logits_TE, topk_weights_Tk, topk_ids_Tk = self.router(block)(x_TH)
        return RouterOutput(logits_TE=logits_TE, topk_weights_Tk=topk_weights_Tk, topk_ids_Tk=topk_ids_Tk)

    def observe(self, router: nn.Module, inputs: tuple, output) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE, _, topk_ids_Tk = output
        return logits_TE, topk_ids_Tk

    def shared_output(self, block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor | None:
        """The block's `shared_experts` module on every token (the DeepSeek families' name), when it has one."""
        shared = getattr(block, "shared_experts", None)
        return None if shared is None else shared(x_TH)

    def select(self, block, logits_TE, allowed_TE):
        router = self.router(block)
        check_allowed(allowed_TE, logits_TE, router.top_k)
        topk_ids_Tk = self._choose(router, logits_TE, allowed_TE)
        return self.renormalize(block, logits_TE, topk_ids_Tk), topk_ids_Tk

    @abc.abstractmethod
    def _choose(self, router: nn.Module, logits_TE: torch.Tensor, allowed_TE: torch.Tensor) -> torch.Tensor:
        """`[T, k]` expert ids by the family's rule, among allowed experts."""

    def experts_module(self, block: nn.Module) -> nn.Module:
        return block.experts

    def expert_weights(self, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return block.experts.gate_up_proj, block.experts.down_proj

    def act_fn(self, block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return block.experts.act_fn

    def expert_state_dict(self, block, gate_up_proj_E2IH, down_proj_EHI):
        return {"experts.gate_up_proj": gate_up_proj_E2IH, "experts.down_proj": down_proj_EHI}


class SoftmaxTopKAdapter(FusedExpertsAdapter):
    """OLMoE / Qwen2-MoE / Qwen3-MoE routers: fp32 softmax over all E logits, top-k of the
    probabilities (sorted), divided by their sum when `norm_topk_prob`, cast to the logits' dtype.
    Restricted to allowed experts, the softmax still runs over all E logits. OLMoE and Qwen3-MoE are
    instances of this class that differ only in their names."""

    def _choose(self, router, logits_TE, allowed_TE):
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        return topk_ids_among_allowed(probs_TE, allowed_TE, router.top_k, sorted=True)

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        router = self.router(block)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        weights_Tk = probs_TE.gather(1, topk_ids_Tk)
        if router.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return weights_Tk.to(logits_TE.dtype)


__all__ = ["FusedExpertsAdapter", "SoftmaxTopKAdapter"]
