"""DeepSeek-MoE (deepseek-moe-16b-base / -chat) as a native transformers 5 model, `model_type "deepseek"`.

The published checkpoints ship remote code that no transformers 5 release can import. This module
implements the same function from its semantics with transformers' own parts:

- the decoder is Llama's (attention, RMSNorm, rotary embedding, `LlamaModel.forward`, the causal-LM
  head and loss), which is what the published attention/norm/rotary code computes;
- layer i holds a MoE block iff `n_routed_experts` is set, `i >= first_k_dense_replace` and
  `i % moe_layer_freq == 0`; other layers have a dense MLP of width `intermediate_size`;
- the MoE block (`DeepseekMoeBlock`, the published `DeepseekMoE`): the gate
  (`DeepseekMoeTopkRouter`, the published `MoEGate`, same parameter `gate.weight [E, H]`) scores with
  a softmax over the E logits in the hidden dtype, picks the top k (`torch.topk(sorted=False)`) and,
  if `k > 1 and norm_topk_prob`, divides by their sum (+1e-20); the routed experts are transformers'
  fused 3D experts (`experts.gate_up_proj [E, 2I, H]`, gate rows first, `experts.down_proj [E, H, I]`);
  shared experts (`n_shared_experts` of them, one MLP of width `n_shared_experts * moe_intermediate_size`)
  are added to every token;
- in training with `aux_loss_alpha > 0` the block computes the published expert-balance loss
  (sequence-level if `seq_aux`) and attaches it to its output with `AddAuxiliaryLoss`: the forward
  value is unchanged and backward gives the loss a gradient of one, so the loss is trained although
  the returned LM loss does not include it (as in the published model).

Checkpoints keep the published layout (`mlp.experts.{e}.gate_proj.weight`, ...): transformers' weight
conversion (registered in `occult_hf.models.deepseek`) fuses them on load and splits them on save.

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E routed experts, k experts per token,
I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .configuration_deepseek import DeepseekMoeConfig


class DeepseekMoeMLP(nn.Module):
    """SwiGLU MLP without biases (the published `DeepseekMLP`): dense layers and shared experts."""

    def __init__(self, config: DeepseekMoeConfig, intermediate_size: int | None = None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekMoeExperts(DeepseekV2Experts):
    """transformers' fused routed experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, any
    `experts_implementation`); forward `(x_TH, top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`."""


class DeepseekMoeTopkRouter(nn.Module):
    """The published `MoEGate` in transformers 5 form.

    forward(`[..., H]`) -> `(router_logits [T, E], topk_weights [T, k], topk_ids [T, k] int64)`. Logits and
    softmax are computed in the hidden dtype, as the published gate does. The balance loss is not part
    of the router's output (transformers 5 routers return these three): `DeepseekMoeBlock.balance_loss`
    computes it from the logits and ids.
    """

    def __init__(self, config: DeepseekMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x_TH = hidden_states.reshape(-1, self.hidden_dim)
        router_logits_TE = F.linear(x_TH, self.weight)
        scores_TE = router_logits_TE.softmax(dim=-1)
        topk_weights_Tk, topk_ids_Tk = torch.topk(scores_TE, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weights_Tk = topk_weights_Tk / (topk_weights_Tk.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits_TE, topk_weights_Tk, topk_ids_Tk


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x`; backward gives the scalar `aux_loss` a gradient of one (the published contract:
    the balance loss is trained without entering the reported LM loss)."""

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


def balance_loss(
    router_logits_TE: torch.Tensor, topk_ids_Tk: torch.Tensor, batch_size: int, alpha: float, seq_aux: bool
) -> torch.Tensor:
    """The published expert-balance loss: `alpha * sum_e f_e * P_e`.

    `P_e` is the mean softmax score of expert e and `f_e = E / (k * tokens) * (times e was chosen)`;
    with `seq_aux` both are taken per sequence (the `T` tokens are `batch_size` sequences of equal
    length) and the per-sequence losses averaged, otherwise over all T tokens at once. Counts are fp32.
    """
    scores_TE = router_logits_TE.softmax(dim=-1)
    tokens, num_experts = scores_TE.shape
    top_k = topk_ids_Tk.shape[-1]
    if seq_aux:
        seq_len = tokens // batch_size
        ids_BN = topk_ids_Tk.reshape(batch_size, seq_len * top_k)
        load_BE = torch.zeros(batch_size, num_experts, device=scores_TE.device)
        load_BE.scatter_add_(1, ids_BN, torch.ones(ids_BN.shape, device=scores_TE.device))
        load_BE = load_BE / (seq_len * top_k / num_experts)
        mean_score_BE = scores_TE.reshape(batch_size, seq_len, num_experts).mean(dim=1)
        return (load_BE * mean_score_BE).sum(dim=1).mean() * alpha
    fraction_E = F.one_hot(topk_ids_Tk.reshape(-1), num_classes=num_experts).float().mean(0)
    return (scores_TE.mean(0) * fraction_E * num_experts).sum() * alpha


class DeepseekMoeBlock(nn.Module):
    """The published `DeepseekMoE` block: routed experts chosen by the gate, plus shared experts."""

    def __init__(self, config: DeepseekMoeConfig):
        super().__init__()
        self.config = config
        self.gate = DeepseekMoeTopkRouter(config)
        self.experts = DeepseekMoeExperts(config)
        self.shared_experts = (
            DeepseekMoeMLP(config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def balance_loss(self, router_logits_TE: torch.Tensor, topk_ids_Tk: torch.Tensor, batch_size: int) -> torch.Tensor | None:
        """The block's balance loss for a batch of `batch_size` equal-length sequences, or None (eval, or
        `aux_loss_alpha == 0`), exactly when the published gate returns one."""
        if not (self.training and self.config.aux_loss_alpha > 0.0):
            return None
        return balance_loss(router_logits_TE, topk_ids_Tk, batch_size, self.config.aux_loss_alpha, self.config.seq_aux)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        batch_size = shape[0] if hidden_states.dim() == 3 else 1
        x_TH = hidden_states.reshape(-1, shape[-1])
        router_logits_TE, topk_weights_Tk, topk_ids_Tk = self.gate(x_TH)
        routed_TH = self.experts(x_TH, topk_ids_Tk, topk_weights_Tk)
        aux_loss = self.balance_loss(router_logits_TE, topk_ids_Tk, batch_size)
        if aux_loss is not None:
            routed_TH = AddAuxiliaryLoss.apply(routed_TH, aux_loss)
        if self.shared_experts is not None:
            routed_TH = routed_TH + self.shared_experts(x_TH)
        return routed_TH.reshape(shape)


class DeepseekMoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer with the DeepSeek-MoE MLP of layer `layer_idx` (forward is Llama's)."""

    def __init__(self, config: DeepseekMoeConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # not Llama's __init__: it would build a dense MLP first
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = DeepseekMoeBlock(config) if config.is_moe_layer(layer_idx) else DeepseekMoeMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekMoePreTrainedModel(LlamaPreTrainedModel):
    config: DeepseekMoeConfig
    config_class = DeepseekMoeConfig
    _no_split_modules = ["DeepseekMoeDecoderLayer"]
    _can_record_outputs = {"hidden_states": DeepseekMoeDecoderLayer, "attentions": LlamaAttention}

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """True: the routed experts are transformers' `DeepseekV2Experts` (`@use_experts_implementation`),
        so every `experts_implementation` applies, and the default is `grouped_mm` as for transformers' own
        MoE classes. transformers decides this by looking for that decorator in the source of the model
        class's module; this module imports the decorated class instead, so without this override the
        check fails, the experts silently fall back to the per-expert `eager` loop (on a GPU one host sync
        per expert and layer; in training a whole-parameter-sized gradient per expert) and `grouped_mm` is
        refused."""
        return True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, DeepseekMoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, DeepseekMoeTopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)


class DeepseekMoeModel(DeepseekMoePreTrainedModel, LlamaModel):
    """Llama's decoder stack (and its forward) over DeepSeek-MoE layers."""

    def __init__(self, config: DeepseekMoeConfig):
        # again: a keyword of `from_pretrained` / `AutoConfig.from_pretrained` (scoring_func="sigmoid") is set after
        # the config validated itself, and the layers would ignore it or fail deep inside a forward
        config.validate_architecture()
        PreTrainedModel.__init__(self, config)  # not Llama's __init__: it would build Llama layers first
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DeepseekMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class DeepseekMoeForCausalLM(DeepseekMoePreTrainedModel, LlamaForCausalLM):
    """DeepSeek-MoE causal LM: Llama's head, loss and generation over `DeepseekMoeModel`."""

    def __init__(self, config: DeepseekMoeConfig):
        PreTrainedModel.__init__(self, config)  # not Llama's __init__: it would build Llama layers first
        self.model = DeepseekMoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = [
    "AddAuxiliaryLoss",
    "DeepseekMoeBlock",
    "DeepseekMoeExperts",
    "DeepseekMoeForCausalLM",
    "DeepseekMoeMLP",
    "DeepseekMoeModel",
    "DeepseekMoePreTrainedModel",
    "DeepseekMoeTopkRouter",
    "balance_loss",
]
