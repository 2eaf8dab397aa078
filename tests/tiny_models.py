"""Tiny randomly initialised models of every supported family, for tests.

Every family is a real transformers `*ForCausalLM` (DeepSeek-MoE, `deepseek`, is occult_hf's native
class, registered with the Auto classes when occult_hf is imported), small enough that forward +
backward of a 2x16 batch takes milliseconds.

    from tiny_models import FAMILIES, tiny_config, tiny_model
    model = tiny_model("deepseek_v3", seed=1, num_experts=6)   # E=6: a device count of 4 does not divide it

Conventions (same for every family):
- fp32, returned in `eval()` mode, as `from_pretrained` returns a model; call `.train()` for training
  tests (only DeepSeek-MoE behaves differently in training: its auxiliary loss).
- `num_experts=` and `top_k=` are family-independent overrides, translated to the family's own config
  field names; any other keyword is passed to the config as is (e.g. `topk_method="group_limited_greedy"`
  for DeepSeek-V2, `norm_topk_prob=False`).
- Routers get decisive random weights (std 1/sqrt(hidden)), so that routing is far from ties and
  does not flip under fp32 reordering; DeepSeek-V3's `e_score_correction_bias` is random and non-zero.
- Router auxiliary losses are on where the model has one (OLMoE, Qwen2/3-MoE: `output_router_logits=True`
  and a non-zero `router_aux_loss_coef`; DeepSeek-MoE: `aux_loss_alpha` > 0, in training).
- `generate()` with a padded `attention_mask` on OLMoE/Qwen2/Qwen3 needs `output_router_logits=False`
  passed to `generate`: transformers (5.17 and 5.24) computes the load-balancing loss at every
  decoding step and fails on the mask's shape when router logits are on.
- Attention is transformers' default, so `save_pretrained` -> `from_pretrained` gives identical logits.
- DeepSeek-V2/V3 use 2 of `n_group` expert groups (`topk_group=2`), `n_group` = 4 for E=8 (3 for
  E=6, else 2) unless given, so group-limited routing really limits.
- Dense layers: Qwen2-MoE layer 1 is dense (`mlp_only_layers=[1]`); DeepSeek-V2/V3 and
  DeepSeek-MoE have a dense first layer (`first_k_dense_replace=1`). `MOE_LAYERS[family]` lists the
  decoder layers that hold MoE blocks in the default config.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers

FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek")

_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.05,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

_DEEPSEEK_HF_COMMON = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    topk_group=2,  # n_group: see _expert_groups
)

# family -> default config fields
_DEFAULTS: dict[str, dict] = {
    "olmoe": dict(
        _COMMON,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    ),
    "qwen2_moe": dict(
        _COMMON,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    ),
    "qwen3_moe": dict(
        _COMMON,
        num_hidden_layers=2,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    ),
    "deepseek_v2": dict(
        _COMMON,
        **_DEEPSEEK_HF_COMMON,
        n_routed_experts=8,
        num_experts_per_tok=2,
        topk_method="greedy",
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
    ),
    "deepseek_v3": dict(
        _COMMON,
        **_DEEPSEEK_HF_COMMON,
        n_routed_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    # the published deepseek-moe-16b config.json's fields, tiny
    "deepseek": dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        scoring_func="softmax",
        aux_loss_alpha=0.01,
        seq_aux=True,
        rope_theta=10000.0,
    ),
}

_CONFIG_CLASS = {
    "olmoe": "OlmoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
}  # DeepSeek-MoE ("deepseek") through AutoConfig: its class is occult_hf's

# the family's config field names for the family-independent overrides
_FIELD_NAMES = {
    "olmoe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok"},
    "qwen2_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok"},
    "qwen3_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok"},
    "deepseek_v2": {"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok"},
    "deepseek_v3": {"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok"},
    "deepseek": {"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok"},
}

MOE_LAYERS = {
    "olmoe": (0, 1),
    "qwen2_moe": (0, 2),
    "qwen3_moe": (0, 1),
    "deepseek_v2": (1, 2),
    "deepseek_v3": (1, 2),
    "deepseek": (1, 2),
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny-model family {family!r}; valid families: {list(FAMILIES)}")


def _config_fields(family: str, overrides: dict) -> dict:
    fields = dict(_DEFAULTS[family])
    for generic, own in _FIELD_NAMES[family].items():
        if generic in overrides and own in overrides and generic != own:
            raise ValueError(f"give either {generic}= or {own}= for family {family!r}, not both")
    for key, value in overrides.items():
        fields[_FIELD_NAMES[family].get(key, key)] = value
    if family in ("deepseek_v2", "deepseek_v3") and "n_group" not in overrides:
        fields["n_group"] = _expert_groups(fields["n_routed_experts"])
    return fields


def _expert_groups(num_experts: int) -> int:
    """DeepSeek-V2/V3 tiny configs: the largest of 4, 3, 2 groups that splits E into groups of >= 2."""
    for groups in (4, 3, 2):
        if num_experts % groups == 0 and num_experts // groups >= 2:
            return groups
    raise ValueError(f"tiny DeepSeek configs need num_experts divisible into 2, 3 or 4 groups of >= 2; got {num_experts}")


def tiny_config(family: str, **overrides):
    """The tiny config of `family` (a transformers `PretrainedConfig`), with `overrides` applied."""
    _check_family(family)
    fields = _config_fields(family, overrides)
    if family == "deepseek":
        import occult_hf  # noqa: F401  (registers model_type "deepseek")

        return transformers.AutoConfig.for_model("deepseek", **fields)
    return getattr(transformers, _CONFIG_CLASS[family])(**fields)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny random fp32 `*ForCausalLM` of `family` in eval mode; same `seed` and overrides, same weights.

    The global torch RNG is left as it was.
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        _decisive_routers(model, config.hidden_size)
    return model.float().eval()


def tiny_checkpoint(family: str, directory, seed: int = 0, **overrides) -> Path:
    """Save `tiny_model(family, seed, **overrides)` with `save_pretrained` into `directory` and return it."""
    directory = Path(directory)
    tiny_model(family, seed=seed, **overrides).save_pretrained(directory)
    return directory


def _decisive_routers(model: torch.nn.Module, hidden_size: int) -> None:
    """Router weights ~ N(0, 1/hidden) so logits are O(1); V3's correction bias random and non-zero."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate") and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size))
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.uniform_(-0.3, 0.3)


def tiny_batch(vocab_size: int = 128, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """`[batch, seq]` random token ids (avoids the pad/bos/eos ids 0-2)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, seq), generator=generator)


TOKENIZER_WORDS = (
    "the a one two three red blue green fox dog cat river tree sky sun moon star day night runs jumps "
    "swims flies eats sees over under big small quick slow house road city town king queen bird fish is was"
).split()


def save_tiny_tokenizer(directory, vocab_size: int = 128) -> Path:
    """Save a word-level fast tokenizer over exactly `vocab_size` ids into `directory` (pad/bos/eos = 0/1/2
    as in the tiny configs; `TOKENIZER_WORDS` are real words, the rest fillers) and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<pad>", "<bos>", "<eos>", "<unk>", ".", ",", *TOKENIZER_WORDS]
    tokens += [f"w{i}" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(directory)
    return Path(directory)


def tiny_sentences(count: int, seed: int = 0) -> list[str]:
    """`count` random sentences of 6-24 `TOKENIZER_WORDS`."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(TOKENIZER_WORDS) for _ in range(rng.randint(6, 24))) for _ in range(count)]


__all__ = ["FAMILIES", "MOE_LAYERS", "tiny_config", "tiny_model", "tiny_batch", "tiny_checkpoint"]
