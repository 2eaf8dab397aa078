"""DeepSeek-MoE 16B through its published remote code (`trust_remote_code=True`, model_type "deepseek").

Block `DeepseekMoE`: `gate` is a `MoEGate` whose forward takes `[B, S, H]` and returns
`(topk_idx, topk_weight, aux_loss)` (indices first, no logits); it scores with a softmax over all
E logits (computed in the hidden dtype), takes the top-k, and divides by their sum (+1e-20) when
`top_k > 1 and norm_topk_prob`. In training with `aux_loss_alpha > 0` it also returns a balance loss
(sequence-level when `seq_aux`, else token-level) that the block attaches to its output with
`AddAuxiliaryLoss`: the forward value is unchanged and backward gives the loss a gradient of one.
Routed experts are an `nn.ModuleList` of `DeepseekMLP(gate_proj, up_proj, down_proj)`; shared experts
`shared_experts(x)` (present when `n_shared_experts` is not None) are added to every token. Layer i
is MoE iff `i >= first_k_dense_replace and i % moe_layer_freq == 0`.

For the runtime: the expert list's parameters are the model's source of truth. `expert_weights`
stacks them into the fused `[E, 2I, H]` / `[E, H, I]` layout (a differentiable copy: gradients reach
the list when it is used directly; a runtime that instead copies it into its own fused parameters
owns the weights from then on and must write them back with `expert_state_dict` to save or restore);
`expert_state_dict` turns fused weights back into the list's `experts.{e}.*.weight` keys for a
vanilla checkpoint; `expert_parameters(block, e)` gives one expert's own parameters; `attach_aux_loss` must be applied to the routed output whenever `route`
returned an `aux_loss` (training), exactly where the published block calls `AddAuxiliaryLoss`.
`route` should get the block's `[B, S, H]` input: the sequence-level aux loss averages per sequence
(a `[T, H]` input is treated as one sequence).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._routing import check_allowed, topk_ids_among_allowed
from .base import MoEAdapter, RouterOutput, register_adapter


class AttachAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x`; backward gives the scalar `aux_loss` a gradient of one (the published
    `AddAuxiliaryLoss` contract, so the balance loss is trained without entering the LM loss)."""

    @staticmethod
    def forward(ctx, x, aux_loss):
        if aux_loss.numel() != 1:
            raise ValueError(f"aux_loss must be a scalar, got shape {tuple(aux_loss.shape)}")
        ctx.aux_dtype = aux_loss.dtype
        ctx.aux_needs_grad = aux_loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_x):
        grad_aux = torch.ones(1, dtype=ctx.aux_dtype, device=grad_x.device) if ctx.aux_needs_grad else None
        return grad_x, grad_aux


class DeepseekRemoteAdapter(MoEAdapter):
    name = "deepseek_remote"
    model_types = ("deepseek",)
    block_class_names = ("DeepseekMoE",)

    num_experts_field = "n_routed_experts"

    def router(self, block: nn.Module) -> nn.Module:
        return block.gate

    # ----- routing ----------------------------------------------------------------------
    def route(self, block, x_TH):
        gate = self.router(block)
        x_BSH = x_TH if x_TH.dim() == 3 else x_TH.reshape(1, -1, x_TH.shape[-1])
        topk_ids_Tk, topk_weights_Tk, aux_loss = gate(x_BSH)
        return RouterOutput(
            logits_TE=self._logits(gate, x_BSH),
            topk_weights_Tk=topk_weights_Tk,
            topk_ids_Tk=topk_ids_Tk,
            aux_loss=aux_loss,
        )

    def observe(self, router, inputs, output):
        topk_ids_Tk, _, _ = output
        return self._logits(router, inputs[0]), topk_ids_Tk

    @staticmethod
    def _logits(gate: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`[T, E]` logits as `MoEGate.forward` computes them internally (it does not return them)."""
        return F.linear(x.reshape(-1, x.shape[-1]), gate.weight, None)

    def _scores(self, gate: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
        if gate.scoring_func != "softmax":
            raise ValueError(f"DeepSeek-MoE scoring_func={gate.scoring_func!r} is not supported; valid: ['softmax']")
        return logits_TE.softmax(dim=-1)

    def select(self, block, logits_TE, allowed_TE):
        gate = self.router(block)
        check_allowed(allowed_TE, logits_TE, gate.top_k)
        topk_ids_Tk = topk_ids_among_allowed(self._scores(gate, logits_TE), allowed_TE, gate.top_k, sorted=False)
        return self.renormalize(block, logits_TE, topk_ids_Tk), topk_ids_Tk

    def renormalize(self, block, logits_TE, topk_ids_Tk):
        gate = self.router(block)
        weights_Tk = self._scores(gate, logits_TE).gather(1, topk_ids_Tk)
        if gate.top_k > 1 and gate.norm_topk_prob:
            weights_Tk = weights_Tk / (weights_Tk.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_Tk

    def attach_aux_loss(self, block, routed_TH, aux_loss):
        if aux_loss is None:
            return routed_TH
        return AttachAuxiliaryLoss.apply(routed_TH, aux_loss)

    # ----- experts ----------------------------------------------------------------------
    def experts_module(self, block: nn.Module) -> nn.Module:
        return block.experts

    def expert_parameters(self, block: nn.Module, expert: int) -> dict[str, nn.Parameter]:
        """Expert `expert`'s own parameters: `gate_proj [I, H]`, `up_proj [I, H]`, `down_proj [H, I]`."""
        mlp = block.experts[expert]
        return {"gate_proj": mlp.gate_proj.weight, "up_proj": mlp.up_proj.weight, "down_proj": mlp.down_proj.weight}

    def expert_weights(self, block):
        gate_up_proj_E2IH = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight], dim=0) for m in block.experts])
        down_proj_EHI = torch.stack([m.down_proj.weight for m in block.experts])
        return gate_up_proj_E2IH, down_proj_EHI

    def expert_state_dict(self, block, gate_up_proj_E2IH, down_proj_EHI):
        state = {}
        for expert, (gate_up_2IH, down_HI) in enumerate(zip(gate_up_proj_E2IH, down_proj_EHI)):
            gate_IH, up_IH = gate_up_2IH.chunk(2, dim=0)
            state[f"experts.{expert}.gate_proj.weight"] = gate_IH
            state[f"experts.{expert}.up_proj.weight"] = up_IH
            state[f"experts.{expert}.down_proj.weight"] = down_HI
        return state

    def act_fn(self, block) -> Callable[[torch.Tensor], torch.Tensor]:
        return block.experts[0].act_fn

    def shared_output(self, block, x_TH):
        if block.config.n_shared_experts is None:
            return None
        return block.shared_experts(x_TH)


ADAPTER = register_adapter(DeepseekRemoteAdapter())
