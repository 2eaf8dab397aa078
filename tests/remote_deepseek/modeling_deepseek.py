"""Stand-in of deepseek-ai/deepseek-moe-16b's remote code (`modeling_deepseek.py`), for occult_hf's tests.

The published file cannot be downloaded on the machines that run these tests, so this module
reproduces its structure and behaviour in our own words, as loaded with `trust_remote_code=True`:

- MoE part, faithful to the published code: `MoEGate(config)` owns `weight [E, H]`, scores with a
  softmax over all routed experts, takes `torch.topk(..., sorted=False)`, divides by the top-k sum
  (+1e-20) when `top_k > 1 and norm_topk_prob`, and returns `(topk_idx, topk_weight, aux_loss)`
  (indices first). In training with `aux_loss_alpha > 0` it computes the sequence-level (`seq_aux`)
  or token-level balance loss from the greedy choice. `DeepseekMoE` keeps its routed experts as an
  `nn.ModuleList` of `DeepseekMLP(gate_proj, up_proj, down_proj)` plus `shared_experts`
  (width `moe_intermediate_size * n_shared_experts`); in training it repeats every token k times
  (`repeat_interleave`), runs each expert on its rows, sums the weighted rows and attaches the aux
  loss with `AddAuxiliaryLoss` (identity forward; backward hands the loss a gradient of 1, so the
  aux loss is trained although the returned LM loss does not include it); in eval it runs
  `moe_infer` (sort by expert, one call per expert, weighted scatter-add). Layer `i` is MoE iff
  `n_routed_experts is not None and i >= first_k_dense_replace and i % moe_layer_freq == 0`.
- Around it, a minimal Llama-like decoder (RMSNorm, rotary multi-head attention with a KV cache,
  untied LM head, mean cross-entropy loss) that runs on transformers 5.x; `pretraining_tp > 1`
  weight slicing of the published MLP (the same product, computed in slices) is not reproduced.

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E routed experts, k experts per token.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_deepseek import DeepseekConfig

# transformers renamed the cache field of model outputs from `past_key_values` to `cache` after 5.17
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class DeepseekRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary_cos_sin(position_ids_BS, head_dim, theta, dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids_BS.device) / head_dim))
    freqs = position_ids_BS.float()[..., None] * inv_freq  # [B, S, head_dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # [B, 1, S, head_dim]


class DeepseekMLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.scoring_func = config.scoring_func
        self.alpha = config.aux_loss_alpha
        self.seq_aux = config.seq_aux
        self.norm_topk_prob = config.norm_topk_prob
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)  # [T, H]
        logits = F.linear(hidden_states, self.weight, None)  # [T, E]
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise NotImplementedError(f"insupportable scoring function for MoE gating: {self.scoring_func}")

        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)  # [T, k]
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)

        if self.training and self.alpha > 0.0:
            aux_loss = self._balance_loss(scores, topk_idx, bsz, seq_len)
        else:
            aux_loss = None
        return topk_idx, topk_weight, aux_loss

    def _balance_loss(self, scores_TE, topk_idx_Tk, bsz, seq_len):
        topk_idx_per_seq = topk_idx_Tk.view(bsz, -1)  # [B, S*k]
        if self.seq_aux:
            # per sequence: expert load (scaled so a uniform load is 1) times mean score, summed, batch mean
            load_BE = torch.zeros(bsz, self.n_routed_experts, device=scores_TE.device)
            load_BE.scatter_add_(1, topk_idx_per_seq, torch.ones(bsz, seq_len * self.top_k, device=scores_TE.device))
            load_BE.div_(seq_len * self.top_k / self.n_routed_experts)
            mean_score_BE = scores_TE.view(bsz, seq_len, -1).mean(dim=1)
            return (load_BE * mean_score_BE).sum(dim=1).mean() * self.alpha
        # whole batch: fraction of (token, slot) pairs per expert times E, times mean score
        fraction_E = F.one_hot(topk_idx_per_seq.view(-1), num_classes=self.n_routed_experts).float().mean(0)
        return (scores_TE.mean(0) * fraction_E * self.n_routed_experts).sum() * self.alpha


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns `x` unchanged; in backward gives `loss` a gradient of one, so the loss is trained."""

    @staticmethod
    def forward(ctx, x, loss):
        assert loss.numel() == 1
        ctx.dtype = loss.dtype
        ctx.required_aux_loss = loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = None
        if ctx.required_aux_loss:
            grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device)
        return grad_output, grad_loss


class DeepseekMoE(nn.Module):
    """Routed experts (a ModuleList) chosen by `MoEGate`, plus always-on shared experts."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.experts = nn.ModuleList(
            [DeepseekMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_routed_experts)]
        )
        self.gate = MoEGate(config)
        if config.n_shared_experts is not None:
            self.shared_experts = DeepseekMLP(config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])  # [T, H]
        flat_topk_idx = topk_idx.view(-1)  # [T*k]
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)  # [T*k, H]
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)
            y = AddAuxiliaryLoss.apply(y, aux_loss)
        else:
            y = self.moe_infer(hidden_states, flat_topk_idx, topk_weight.view(-1, 1)).view(*orig_shape)
        if self.config.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        order = flat_expert_indices.argsort()
        ends = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_of_row = order // self.num_experts_per_tok
        for i, end in enumerate(ends):
            start = 0 if i == 0 else ends[i - 1]
            if start == end:
                continue
            rows = token_of_row[start:end]
            expert_out = self.experts[i](x[rows])
            expert_out.mul_(flat_expert_weights[order[start:end]])
            expert_cache = expert_cache.to(expert_out.dtype)
            expert_cache.scatter_reduce_(0, rows.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
        return expert_cache


class DeepseekAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, position_ids, additive_mask, cache):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = _rotary_cos_sin(position_ids, self.head_dim, self.config.rope_theta, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        repeats = self.num_heads // self.num_key_value_heads
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + additive_mask
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=self.config.attention_dropout, training=self.training)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepseekAttention(config, layer_idx)
        is_moe = (
            config.n_routed_experts is not None
            and layer_idx >= config.first_k_dense_replace
            and layer_idx % config.moe_layer_freq == 0
        )
        self.mlp = DeepseekMoE(config) if is_moe else DeepseekMLP(config)
        self.input_layernorm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, additive_mask, cache):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids, additive_mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DeepseekPreTrainedModel(PreTrainedModel):
    config_class = DeepseekConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DeepseekDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MoEGate):
            module.reset_parameters()
        elif isinstance(module, DeepseekRMSNorm):
            nn.init.ones_(module.weight)


class DeepseekModel(DeepseekPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, use_cache=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        bsz, q_len = inputs_embeds.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past_len = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + q_len, device=inputs_embeds.device).expand(bsz, -1)
        additive_mask = _additive_causal_mask(attention_mask, bsz, q_len, past_len, inputs_embeds)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids, additive_mask, cache)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{_CACHE_FIELD: cache})


def _additive_causal_mask(attention_mask_BK, bsz, q_len, past_len, like):
    """`[B, 1, S, past+S]` additive mask: causal, and padded keys (attention_mask == 0) masked."""
    kv_len = past_len + q_len
    query_pos = torch.arange(past_len, kv_len, device=like.device)[:, None]
    key_pos = torch.arange(kv_len, device=like.device)[None, :]
    allowed = (key_pos <= query_pos)[None, None].expand(bsz, 1, q_len, kv_len)
    if attention_mask_BK is not None:
        allowed = allowed & attention_mask_BK[:, None, None, -kv_len:].bool()
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(~allowed, torch.finfo(like.dtype).min)


class DeepseekForCausalLM(DeepseekPreTrainedModel, GenerationMixin):
    # the loss is a plain mean over label tokens; Trainer must not pass num_items_in_batch
    accepts_loss_kwargs = False

    def __init__(self, config):
        super().__init__(config)
        self.model = DeepseekModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        cache=None,
        **unused_generation_kwargs,
    ):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        logits = self.lm_head(outputs.last_hidden_state).float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous().view(-1, self.config.vocab_size)
            shift_labels = labels[..., 1:].contiguous().view(-1).to(shift_logits.device)
            loss = F.cross_entropy(shift_logits, shift_labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)})
