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
- Router auxiliary losses are on where the model has one (OLMoE, Qwen2/3-MoE, Qwen3-Next, Mixtral:
  `output_router_logits=True` and a non-zero `router_aux_loss_coef`; DeepSeek-MoE: `aux_loss_alpha`
  > 0, in training).
- `generate()` with a padded `attention_mask` on OLMoE/Qwen2/Qwen3/Qwen3-Next needs
  `output_router_logits=False` passed to `generate`: transformers (5.17 and 5.24) computes the
  load-balancing loss at every decoding step and fails on the mask's shape when router logits are on.
- Attention is transformers' default, so `save_pretrained` -> `from_pretrained` gives identical logits.
- DeepSeek-V2/V3 use 2 of `n_group` expert groups (`topk_group=2`), `n_group` = 4 for E=8 (3 for
  E=6, else 2) unless given, so group-limited routing really limits.
- Qwen3-Next's layer 0 mixes tokens with Gated DeltaNet linear attention (transformers' torch path:
  no kernel package needed), layer 1 with full attention; both are MoE.
- Dense layers: Qwen2-MoE layer 1 is dense (`mlp_only_layers=[1]`); DeepSeek-V2/V3 and
  DeepSeek-MoE have a dense first layer (`first_k_dense_replace=1`). `MOE_LAYERS[family]` lists the
  decoder layers that hold MoE blocks in the default config.

`FAMILIES` is the families `patches/` registers (the registry is the one list; a registered family
without an entry here fails every family-driven test with an error naming the missing entry). A
family here is one `TINY_FAMILIES` entry (config fields, MoE layers, the router's rule); the config
class comes from its adapter's model type, the override names from the adapter's config fields,
the routers from the adapter. Adding a family to occult_hf adds `patches/<family>.py` and one
entry here (docs/models.md).
"""

from __future__ import annotations

import math
from pathlib import Path

from dataclasses import dataclass
from typing import Callable

import torch
import transformers

from occult_hf.patches import adapter_for, registered_adapters

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

# OLMoE and the Qwen families: E=8, k=2, the load-balancing loss on
_QWEN_STYLE_ROUTING = dict(num_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)

# Qwen3-Next's linear attention: 2 key heads and 4 value heads of width 8
_GATED_DELTANET_HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)

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

@dataclass(frozen=True)
class RoutingRule:
    """What a family's router does, written independently of its adapter, for the float64 reference
    of `test_adapters` (the model's own rule restricted to allowed experts).

    Attributes:
        score: "softmax" over all E logits, or "sigmoid".
        biased_choice: choose on score + `router.e_score_correction_bias` (weights stay unbiased).
        groups: expert-group limit before top-k: None, "max" (a group scores its best member),
            "top2_sum" (its two best), or "topk_method" ("max" when `router.topk_method` is
            "group_limited_greedy", else none).
        normalize: divide the chosen weights by their sum: True, False, or the router attribute that says.
        normalize_single: False when a single expert (k=1) is never divided by its sum.
        scale: multiply by `router.routed_scaling_factor`.
    """

    score: str = "softmax"
    biased_choice: bool = False
    groups: str | None = None
    normalize: bool | str = "norm_topk_prob"
    normalize_single: bool = True
    scale: bool = False


@dataclass(frozen=True)
class TinyFamily:
    """The one entry a model family needs here (its adapter, in `patches/`, says the rest).

    Attributes:
        config: the tiny config's fields (the family's own field names).
        moe_layers: the decoder layers that hold MoE blocks with these fields (checked against the
            adapter's `iter_moe_blocks`, so it is written out, not derived).
        routing: the router's rule, for the reference in `test_adapters`.
        derived: fields computed from the others unless given as overrides (e.g. DeepSeek's `n_group`).
        condition: re-draws weights outside the MoE blocks that transformers' init leaves too
            ill-conditioned for an fp32 comparison at 1e-5 (Qwen3-Next's linear-attention decays).
    """

    config: dict
    moe_layers: tuple[int, ...]
    routing: RoutingRule = RoutingRule()
    derived: Callable[[dict], dict] | None = None
    condition: Callable[[torch.nn.Module], None] | None = None


def _deepseek_groups(fields: dict) -> dict:
    return {"n_group": _expert_groups(fields["n_routed_experts"])}


def _moderate_linear_attention_decays(model: torch.nn.Module) -> None:
    """Gated DeltaNet decay rates `A = exp(A_log)` drawn from [0.01, 0.5], not transformers' [0.01, 16].

    With the fastest heads forgetting within a token, the gradients of `A_log` and `dt_bias` amplify
    fp32 rounding in their input about 10^4-fold in transformers' own model, so no reordering of the
    same sums could meet 1e-5 there; with slower decays they are as well-conditioned as the other
    gradients (docs/models.md, Qwen3-Next)."""
    with torch.no_grad():
        for layer in model.model.layers:
            linear_attention = getattr(layer, "linear_attn", None)
            if linear_attention is not None:
                linear_attention.A_log.copy_(torch.empty_like(linear_attention.A_log).uniform_(0.01, 0.5).log())


# family (= adapter name) -> its tiny config
TINY_FAMILIES: dict[str, TinyFamily] = {
    "olmoe": TinyFamily(
        dict(_COMMON, **_QWEN_STYLE_ROUTING, num_hidden_layers=2, norm_topk_prob=False),
        moe_layers=(0, 1),
    ),
    "qwen2_moe": TinyFamily(
        dict(
            _COMMON,
            **_QWEN_STYLE_ROUTING,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            norm_topk_prob=False,
        ),
        moe_layers=(0, 2),
    ),
    "qwen3_moe": TinyFamily(
        dict(_COMMON, **_QWEN_STYLE_ROUTING, num_hidden_layers=2, head_dim=8, moe_intermediate_size=16, norm_topk_prob=True),
        moe_layers=(0, 1),
    ),
    "deepseek_v2": TinyFamily(
        dict(
            _COMMON,
            **_DEEPSEEK_HF_COMMON,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="greedy",
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
        ),
        moe_layers=(1, 2),
        routing=RoutingRule(groups="topk_method", normalize=False, scale=True),
        derived=_deepseek_groups,
    ),
    "deepseek_v3": TinyFamily(
        dict(
            _COMMON,
            **_DEEPSEEK_HF_COMMON,
            n_routed_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        moe_layers=(1, 2),
        routing=RoutingRule(score="sigmoid", biased_choice=True, groups="top2_sum", scale=True),
        derived=_deepseek_groups,
    ),
    # the published deepseek-moe-16b config.json's fields, tiny
    "deepseek": TinyFamily(
        dict(
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
        moe_layers=(1, 2),
        routing=RoutingRule(normalize_single=False),
    ),
    "mixtral": TinyFamily(
        dict(
            _COMMON,
            intermediate_size=16,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.02,
        ),
        moe_layers=(0, 1),
        routing=RoutingRule(normalize=True),
    ),
    # both token mixers: Gated DeltaNet linear attention (layer 0), gated full attention (layer 1)
    "qwen3_next": TinyFamily(
        dict(
            _COMMON,
            **_QWEN_STYLE_ROUTING,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            head_dim=8,
            **_GATED_DELTANET_HEADS,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
        ),
        moe_layers=(0, 1),
        condition=_moderate_linear_attention_decays,
    ),
}


def _registered_families() -> tuple[str, ...]:
    """Every family `patches/` registers, in this table's order (stable test ids), then any the table lacks.

    The registry is the one list of families: a family registered without an entry here still shows up
    in every family-driven test, which then fails naming the missing entry (`_check_family`)."""
    registered = registered_adapters()
    stale = sorted(set(TINY_FAMILIES) - set(registered))
    if stale:
        raise ValueError(f"tests/tiny_models.py has tiny configs for families no adapter in patches/ registers: {stale}")
    return tuple(TINY_FAMILIES) + tuple(family for family in registered if family not in TINY_FAMILIES)


FAMILIES = _registered_families()
MOE_LAYERS = {family: entry.moe_layers for family, entry in TINY_FAMILIES.items()}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny-model family {family!r}; valid families: {list(FAMILIES)}")
    if family not in TINY_FAMILIES:
        raise ValueError(
            f"family {family!r} is registered (patches/{family}.py) but has no TINY_FAMILIES entry in tests/tiny_models.py"
        )


def _config_fields(family: str, overrides: dict) -> dict:
    entry, adapter = TINY_FAMILIES[family], registered_adapters()[family]
    field_names = {"num_experts": adapter.num_experts_field, "top_k": adapter.top_k_field}
    fields = dict(entry.config)
    for generic, own in field_names.items():
        if generic in overrides and own in overrides and generic != own:
            raise ValueError(f"give either {generic}= or {own}= for family {family!r}, not both")
    for key, value in overrides.items():
        fields[field_names.get(key, key)] = value
    if entry.derived is not None:
        fields.update({key: value for key, value in entry.derived(fields).items() if key not in overrides})
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
    return transformers.AutoConfig.for_model(registered_adapters()[family].model_types[0], **fields)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny random fp32 `*ForCausalLM` of `family` in eval mode; same `seed` and overrides, same weights.

    The global torch RNG is left as it was.
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        _decisive_routers(model, config.hidden_size)
        condition = TINY_FAMILIES[family].condition
        if condition is not None:
            condition(model)
    return model.float().eval()


def tiny_checkpoint(family: str, directory, seed: int = 0, **overrides) -> Path:
    """Save `tiny_model(family, seed, **overrides)` with `save_pretrained` into `directory` and return it."""
    directory = Path(directory)
    tiny_model(family, seed=seed, **overrides).save_pretrained(directory)
    return directory


def _decisive_routers(model: torch.nn.Module, hidden_size: int) -> None:
    """Router weights ~ N(0, 1/hidden) so logits are O(1); V3's correction bias random and non-zero.

    The routers are the ones the family's adapter names, in module order."""
    adapter = adapter_for(model)
    with torch.no_grad():
        for _, _, block in adapter.iter_moe_blocks(model):
            router = adapter.router(block)
            if isinstance(getattr(router, "weight", None), torch.Tensor):
                router.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size))
            bias = getattr(router, "e_score_correction_bias", None)
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


__all__ = ["FAMILIES", "MOE_LAYERS", "TINY_FAMILIES", "TinyFamily", "RoutingRule", "tiny_config", "tiny_model", "tiny_batch", "tiny_checkpoint"]
