"""occult_hf's native DeepSeek-MoE (`model_type "deepseek"`, `occult_hf.models.deepseek`).

- It loads through the Auto classes with no remote code, also from a published-style `config.json`
  (with `auto_map`, `rope_theta`, `architectures: DeepseekForCausalLM`), and `occult_config=` works.
- Checkpoints keep the published weight layout (per-expert `mlp.experts.{e}.gate_proj.weight`, ...):
  exactly the published key set, values equal to the fused tensors, and a checkpoint written in that
  layout loads back into the fused model; `config.json` keeps `rope_theta` for the published config.
- The layer pattern (`first_k_dense_replace`, `moe_layer_freq`), the balance loss only in training,
  and config validation.
- Equivalence with the published `modeling_deepseek.py` (same logits, loss and gradients on a tiny
  config with the same weights), only where a copy of it is supplied: set
  `OCCULT_DEEPSEEK_PUBLISHED_DIR` to a folder holding `modeling_deepseek.py` (and optionally the
  published `configuration_deepseek.py`). The file cannot be shipped or downloaded here; a minimal
  import shim lets it import under transformers 5.

Shape legend: B batch, S sequence, H hidden, E routed experts, I expert width.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import occult_hf
from occult_hf.models.deepseek import DeepseekMoeConfig, DeepseekMoeForCausalLM
from occult_hf.moe import OccultMoE
from tiny_models import MOE_LAYERS, tiny_batch, tiny_checkpoint, tiny_config, tiny_model

PUBLISHED_DIR_ENV = "OCCULT_DEEPSEEK_PUBLISHED_DIR"
TOLERANCE = 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().norm() / expected.detach().norm().clamp_min(1e-30))


def published_keys(config) -> dict[str, tuple[int, ...]]:
    """Every weight key of the published model for `config`, with its shape (from the published layout)."""
    hidden, inter, moe_inter = config.hidden_size, config.intermediate_size, config.moe_intermediate_size
    head_dim = hidden // config.num_attention_heads
    keys = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    keys["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        keys[p + "self_attn.q_proj.weight"] = (config.num_attention_heads * head_dim, hidden)
        keys[p + "self_attn.k_proj.weight"] = (config.num_key_value_heads * head_dim, hidden)
        keys[p + "self_attn.v_proj.weight"] = (config.num_key_value_heads * head_dim, hidden)
        keys[p + "self_attn.o_proj.weight"] = (hidden, config.num_attention_heads * head_dim)
        keys[p + "input_layernorm.weight"] = keys[p + "post_attention_layernorm.weight"] = (hidden,)
        mlps = {"mlp.": inter}
        if config.is_moe_layer(i):
            mlps = {f"mlp.experts.{e}.": moe_inter for e in range(config.n_routed_experts)}
            keys[p + "mlp.gate.weight"] = (config.n_routed_experts, hidden)
            if config.n_shared_experts is not None:
                mlps["mlp.shared_experts."] = moe_inter * config.n_shared_experts
        for mlp, width in mlps.items():
            keys[p + mlp + "gate_proj.weight"] = keys[p + mlp + "up_proj.weight"] = (width, hidden)
            keys[p + mlp + "down_proj.weight"] = (hidden, width)
    return keys


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(file))
    return state


# ----- loading -------------------------------------------------------------------------------------
def test_registered_with_the_auto_classes():
    assert transformers.AutoConfig.for_model("deepseek").__class__ is DeepseekMoeConfig
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("deepseek"))
    assert type(model) is DeepseekMoeForCausalLM
    occult_hf.models.register_models()  # idempotent
    assert type(transformers.AutoModel.from_config(tiny_config("deepseek"))).__name__ == "DeepseekMoeModel"


def test_published_style_config_loads_without_remote_code(tmp_path):
    """A checkpoint directory as published: `auto_map` to remote code, `rope_theta`, no `rope_parameters`."""
    reference = tiny_model("deepseek", seed=1)
    directory = tiny_checkpoint("deepseek", tmp_path / "ckpt", seed=1)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(
        architectures=["DeepseekForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_deepseek.DeepseekConfig",
            "AutoModel": "modeling_deepseek.DeepseekModel",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM",
        },
        rope_theta=10000,
        rope_scaling=None,
    )
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):  # remote code that cannot import
        (directory / name).write_text('raise ImportError("transformers 5 cannot import the published code")\n')

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()  # no trust_remote_code
    assert type(model) is DeepseekMoeForCausalLM
    trusting = transformers.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    assert type(trusting) is DeepseekMoeForCausalLM, "the registered native class must win over auto_map"
    assert model.config.rope_parameters["rope_theta"] == 10000
    ids = tiny_batch()
    assert rel_err(model(input_ids=ids).logits, reference(input_ids=ids).logits) <= 1e-6

    with_occult = transformers.AutoModelForCausalLM.from_pretrained(directory, occult_config={"num_devices": 2}).eval()
    assert occult_hf.occult_config_of(with_occult).num_devices == 2
    assert len(occult_hf.occult_modules(with_occult)) == len(MOE_LAYERS["deepseek"])
    assert rel_err(with_occult(input_ids=ids).logits, reference(input_ids=ids).logits) <= TOLERANCE


# ----- the published weight layout -----------------------------------------------------------------
def test_checkpoint_uses_the_published_layout_and_round_trips(tmp_path):
    model = tiny_model("deepseek", seed=2, n_shared_experts=2)
    model.save_pretrained(tmp_path / "saved")
    state = read_checkpoint(tmp_path / "saved")
    assert {key: tuple(value.shape) for key, value in state.items()} == published_keys(model.config)
    for layer in MOE_LAYERS["deepseek"]:
        experts = model.model.layers[layer].mlp.experts
        for e in range(model.config.n_routed_experts):
            gate_IH, up_IH = experts.gate_up_proj[e].chunk(2, dim=0)
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(state[prefix + "gate_proj.weight"], gate_IH)
            assert torch.equal(state[prefix + "up_proj.weight"], up_IH)
            assert torch.equal(state[prefix + "down_proj.weight"], experts.down_proj[e])

    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_config["model_type"] == "deepseek" and saved_config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert saved_config["architectures"] == ["DeepseekForCausalLM"]  # the published class, by which vLLM picks its model

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_a_checkpoint_written_in_the_published_layout_loads_fused(tmp_path):
    """Written by hand from per-expert tensors (as the published model's `state_dict` is), not by us."""
    config = tiny_config("deepseek")
    generator = torch.Generator().manual_seed(0)
    state = {key: torch.randn(shape, generator=generator) * 0.1 for key, shape in published_keys(config).items()}
    (tmp_path / "ckpt").mkdir()
    save_file(state, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path / "ckpt")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    layer = MOE_LAYERS["deepseek"][0]
    block = model.model.layers[layer].mlp
    prefix = f"model.layers.{layer}.mlp."
    for e in range(config.n_routed_experts):
        gate_up_2IH = torch.cat([state[f"{prefix}experts.{e}.gate_proj.weight"], state[f"{prefix}experts.{e}.up_proj.weight"]])
        assert torch.equal(block.experts.gate_up_proj[e], gate_up_2IH)
        assert torch.equal(block.experts.down_proj[e], state[f"{prefix}experts.{e}.down_proj.weight"])
    assert torch.equal(block.gate.weight, state[prefix + "gate.weight"])
    assert torch.equal(block.shared_experts.up_proj.weight, state[prefix + "shared_experts.up_proj.weight"])


# ----- structure and training ----------------------------------------------------------------------
def test_experts_run_grouped_mm_by_default_and_eager_on_request():
    """transformers' default for fused experts is `grouped_mm`; its check looks for the decorator in the model
    module's source, which the native class must pass (it failed before: `eager` loop, `grouped_mm` refused).
    Both implementations give the same logits and expert gradients."""
    ids = tiny_batch(seed=5)
    models = {"grouped_mm": tiny_model("deepseek", seed=6).train(), "eager": tiny_model("deepseek", seed=6).train()}
    assert models["grouped_mm"].config._experts_implementation == "grouped_mm"
    models["eager"].set_experts_implementation("eager")
    assert models["eager"].config._experts_implementation == "eager"
    logits, experts = {}, {}
    for name, model in models.items():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits[name], experts[name] = out.logits, model.model.layers[MOE_LAYERS["deepseek"][0]].mlp.experts
    assert rel_err(logits["grouped_mm"], logits["eager"]) <= TOLERANCE
    for param in ("gate_up_proj", "down_proj"):
        assert rel_err(getattr(experts["grouped_mm"], param).grad, getattr(experts["eager"], param).grad) <= TOLERANCE
    asked = transformers.AutoModelForCausalLM.from_config(tiny_config("deepseek"), experts_implementation="grouped_mm")
    assert asked.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize(
    ("fields", "moe_layers"),
    [
        ({"first_k_dense_replace": 1, "moe_layer_freq": 1}, [1, 2, 3]),
        ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, [2]),
        ({"first_k_dense_replace": 0, "moe_layer_freq": 3}, [0, 3]),
    ],
)
def test_moe_layers_follow_the_published_rule(fields, moe_layers):
    model = tiny_model("deepseek", num_hidden_layers=4, **fields)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert [i for i, kind in enumerate(kinds) if kind == "DeepseekMoeBlock"] == moe_layers
    assert all(kind == "DeepseekMoeMLP" for i, kind in enumerate(kinds) if i not in moe_layers)


def test_dense_config_has_no_moe_block():
    model = tiny_model("deepseek", n_routed_experts=None, num_experts_per_tok=None)
    assert all(type(layer.mlp).__name__ == "DeepseekMoeMLP" for layer in model.model.layers)


def test_balance_loss_is_trained_but_not_reported():
    """Training mode: same logits and loss as eval (the aux loss is not in the LM loss), but the
    router's gradient differs from a model with `aux_loss_alpha=0` by the balance loss's gradient."""
    ids = tiny_batch(seed=3)
    grads = {}
    for alpha in (0.0, 0.05):
        model = tiny_model("deepseek", seed=4, aux_loss_alpha=alpha)
        eval_out = model(input_ids=ids, labels=ids)
        train_out = model.train()(input_ids=ids, labels=ids)
        assert rel_err(train_out.logits, eval_out.logits) <= TOLERANCE
        assert train_out.loss.item() == pytest.approx(eval_out.loss.item(), rel=TOLERANCE)
        train_out.loss.backward()
        grads[alpha] = model.model.layers[1].mlp.gate.weight.grad.clone()
    assert rel_err(grads[0.05], grads[0.0]) > 1e-3


def test_balance_loss_trains_when_the_model_is_converted_in_eval_mode():
    """`from_pretrained` returns eval mode: a model converted then and put in training mode afterwards trains
    the balance loss too (the replaced block follows the mode), so the router's gradient is the stock model's."""
    ids = tiny_batch(seed=3)
    stock = tiny_model("deepseek", seed=4, aux_loss_alpha=0.05).train()
    stock(input_ids=ids, labels=ids).loss.backward()
    model = occult_hf.apply_occult(tiny_model("deepseek", seed=4, aux_loss_alpha=0.05), occult_hf.OccultConfig(num_devices=2))
    model.train()(input_ids=ids, labels=ids).loss.backward()
    gate = "model.layers.1.mlp.gate.weight"
    assert rel_err(model.get_parameter(gate).grad, stock.get_parameter(gate).grad) <= TOLERANCE
    model.eval()
    assert not any(m.original_block.training for m in model.modules() if isinstance(m, OccultMoE))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ({"num_experts_per_tok": None}, "set both"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and n_routed_experts=8"),
        ({"moe_layer_freq": 0}, "moe_layer_freq=0"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0 must be >= 1"),
        # the field types are checked as transformers' own configs check theirs: a string "false" is not False
        ({"norm_topk_prob": "false"}, "Field 'norm_topk_prob' expected bool, got str"),
        ({"num_experts_per_tok": 2.0}, "Field 'num_experts_per_tok' with value 2.0"),
    ],
)
def test_config_rejects_what_the_published_code_cannot_build(fields, message):
    with pytest.raises(Exception, match=message):
        tiny_config("deepseek", **fields)


@pytest.mark.parametrize(
    ("override", "message"),
    [({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
     ({"num_experts_per_tok": 20}, "num_experts_per_tok=20 must be between 1 and n_routed_experts=8")],  # fmt: skip
)
def test_loading_keywords_are_validated_before_the_model_is_built(tmp_path, override, message):
    """A keyword of `from_pretrained` is set on the config after it validated itself: "sigmoid" was taken and routed
    with softmax, k=20 of 8 experts failed inside torch.topk at the first forward."""
    tiny_model("deepseek", seed=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, occult_config=None, **override)


def test_zero_shared_experts_is_none_as_in_the_published_code():
    """The published code builds a zero-width shared MLP for `n_shared_experts=0`, which adds nothing."""
    batch = tiny_batch(seed=3)
    none, zero = (tiny_model("deepseek", seed=2, n_shared_experts=n) for n in (None, 0))
    assert zero.model.layers[1].mlp.shared_experts is None
    assert torch.equal(zero(batch).logits, none(batch).logits)
    with pytest.raises(Exception, match=r"n_shared_experts=-1 must be >= 0 or None"):
        tiny_config("deepseek", n_shared_experts=-1)


# ----- equivalence with the published modeling_deepseek.py -----------------------------------------
class _PublishedConfig(transformers.PretrainedConfig):
    """The published `configuration_deepseek.DeepseekConfig` fields and defaults, used when the
    supplied folder has only `modeling_deepseek.py`."""

    model_type = "deepseek"

    def __init__(
        self, vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
        num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=None,
        n_routed_experts=None, num_experts_per_tok=None, moe_layer_freq=1, first_k_dense_replace=0,
        norm_topk_prob=False, scoring_func="softmax", aux_loss_alpha=0.001, seq_aux=True, hidden_act="silu",
        max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
        pad_token_id=None, bos_token_id=100000, eos_token_id=100001, pretraining_tp=1,
        tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
        attention_dropout=0.0, **kwargs,
    ):  # fmt: skip
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.moe_intermediate_size, self.num_hidden_layers = moe_intermediate_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.n_shared_experts, self.n_routed_experts = n_shared_experts, n_routed_experts
        self.num_experts_per_tok, self.moe_layer_freq = num_experts_per_tok, moe_layer_freq
        self.first_k_dense_replace, self.norm_topk_prob, self.scoring_func = first_k_dense_replace, norm_topk_prob, scoring_func
        self.aux_loss_alpha, self.seq_aux, self.hidden_act = aux_loss_alpha, seq_aux, hidden_act
        self.max_position_embeddings, self.initializer_range = max_position_embeddings, initializer_range
        self.rms_norm_eps, self.use_cache, self.pretraining_tp = rms_norm_eps, use_cache, pretraining_tp
        self.rope_theta, self.attention_bias, self.attention_dropout = rope_theta, attention_bias, attention_dropout
        self.rope_scaling = rope_scaling
        super().__init__(
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )  # fmt: skip


def _additive_causal_mask(attention_mask_BA, input_shape, inputs_embeds, past_key_values_length, sliding_window=None):
    """`[B, 1, S, past+S]` additive mask (what `_prepare_4d_causal_attention_mask` of transformers 4 gives)."""
    batch, seq = input_shape
    kv_len = past_key_values_length + seq
    device, dtype = inputs_embeds.device, inputs_embeds.dtype
    query_pos = torch.arange(past_key_values_length, kv_len, device=device)[:, None]
    allowed = (torch.arange(kv_len, device=device)[None, :] <= query_pos)[None, None].expand(batch, 1, seq, kv_len)
    if attention_mask_BA is not None:
        allowed = allowed & attention_mask_BA[:, None, None, -kv_len:].bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def _import_published(folder: Path, tmp_path: Path):
    """Import the published `modeling_deepseek.py` under transformers 5 with a minimal shim.

    The shim supplies what transformers 5 removed and nothing else: `is_torch_fx_available` (False)
    and a `transformers.modeling_attn_mask_utils` with the 4D causal-mask helpers (where transformers
    no longer has it); lets the model-output classes accept `past_key_values` where transformers
    renamed that field to `cache`; and gives the config back its transformers 4 `rope_scaling` (None
    for plain RoPE), which transformers 5 turned into an alias of the standardised `rope_parameters`.
    """
    import transformers.utils.import_utils as import_utils

    if not hasattr(import_utils, "is_torch_fx_available"):
        import_utils.is_torch_fx_available = lambda: False
    if "transformers.modeling_attn_mask_utils" not in sys.modules:
        try:
            import transformers.modeling_attn_mask_utils  # noqa: F401  (transformers 5.17 still has it)
        except ImportError:
            shim = types.ModuleType("transformers.modeling_attn_mask_utils")
            shim.AttentionMaskConverter = type("AttentionMaskConverter", (), {})
            shim._prepare_4d_causal_attention_mask = _additive_causal_mask
            shim._prepare_4d_causal_attention_mask_for_sdpa = _additive_causal_mask
            shim._prepare_4d_attention_mask = None  # used only by the published deprecated helpers
            sys.modules[shim.__name__] = shim
    package = tmp_path / "published_deepseek"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(folder / "modeling_deepseek.py", package)
    if (folder / "configuration_deepseek.py").is_file():
        shutil.copy(folder / "configuration_deepseek.py", package)
    else:
        configuration = types.ModuleType("published_deepseek.configuration_deepseek")
        configuration.DeepseekConfig = _PublishedConfig
        sys.modules[configuration.__name__] = configuration
    sys.path.insert(0, str(tmp_path))
    try:
        import published_deepseek.modeling_deepseek as published
    finally:
        sys.path.remove(str(tmp_path))
    for name in ("BaseModelOutputWithPast", "CausalLMOutputWithPast"):
        output_class = getattr(published, name)
        if "past_key_values" not in output_class.__dataclass_fields__:
            setattr(published, name, lambda past_key_values=None, _cls=output_class, **kw: _cls(cache=past_key_values, **kw))

    class LegacyRopeConfig(published.DeepseekConfig):
        @property
        def rope_scaling(self):
            return self.__dict__.get("legacy_rope_scaling")

        @rope_scaling.setter
        def rope_scaling(self, value):
            self.__dict__["legacy_rope_scaling"] = value

    published.DeepseekConfig = LegacyRopeConfig
    return published


def _published_named_grads(model) -> dict[str, torch.Tensor]:
    """The native model's gradients under the published parameter names (fused experts split)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if name.endswith("experts.gate_up_proj"):
            for e, gate_up_2IH in enumerate(grad):
                gate_IH, up_IH = gate_up_2IH.chunk(2, dim=0)
                grads[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate_IH
                grads[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up_IH
        elif name.endswith("experts.down_proj"):
            for e, down_HI in enumerate(grad):
                grads[name.replace("down_proj", f"{e}.down_proj.weight")] = down_HI
        else:
            grads[name] = grad
    return grads


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The published `modeling_deepseek` module (imported once per session: it registers global state)."""
    if not os.environ.get(PUBLISHED_DIR_ENV):
        pytest.skip(
            f"needs a copy of the published deepseek-moe-16b modeling_deepseek.py: set {PUBLISHED_DIR_ENV} to its "
            "folder (it cannot be shipped with occult_hf or downloaded on the test machines)"
        )
    if "published_deepseek.modeling_deepseek" in sys.modules:
        return sys.modules["published_deepseek.modeling_deepseek"]
    return _import_published(Path(os.environ[PUBLISHED_DIR_ENV]), tmp_path_factory.mktemp("published"))


@pytest.mark.parametrize("variant", ["seq_aux", "token_aux-norm_topk"])
def test_native_model_equals_the_published_code(published, tmp_path, variant):
    overrides = {"seq_aux": False, "norm_topk_prob": True, "top_k": 3} if variant != "seq_aux" else {}
    native = tiny_model("deepseek", seed=6, aux_loss_alpha=0.02, **overrides)
    directory = tmp_path / "native"
    native.save_pretrained(directory)

    fields = {k: v for k, v in json.loads((directory / "config.json").read_text()).items() if k in _PublishedConfig.__init__.__code__.co_varnames}
    config = published.DeepseekConfig(**fields)
    config._attn_implementation = "eager"
    reference = published.DeepseekForCausalLM(config)
    missing, unexpected = reference.load_state_dict(read_checkpoint(directory), strict=True)
    assert not missing and not unexpected
    reference = reference.float()
    assert all(type(layer.self_attn).__name__ == "DeepseekAttention" for layer in reference.model.layers)

    ids = tiny_batch(batch=3, seq=12, seed=7)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one sequence
    for model in (native, reference):
        model.eval()
    with torch.no_grad():
        ours = native(input_ids=ids, labels=ids)
        theirs = reference(input_ids=ids, labels=ids, use_cache=False)
        assert rel_err(ours.logits, theirs.logits) <= TOLERANCE
        assert ours.loss.item() == pytest.approx(theirs.loss.item(), rel=TOLERANCE)
        ours_masked = native(input_ids=ids, attention_mask=mask).logits
        theirs_masked = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
        kept = mask.bool()
        assert rel_err(ours_masked[kept], theirs_masked[kept]) <= TOLERANCE

    # training: the published token-by-expert path and AddAuxiliaryLoss against ours, gradients included
    ours = native.train()(input_ids=ids, labels=ids)
    theirs = reference.train()(input_ids=ids, labels=ids, use_cache=False)
    assert rel_err(ours.logits, theirs.logits) <= TOLERANCE
    assert ours.loss.item() == pytest.approx(theirs.loss.item(), rel=TOLERANCE)
    ours.loss.backward()
    theirs.loss.backward()
    our_grads = _published_named_grads(native)
    their_grads = {name: p.grad for name, p in reference.named_parameters()}
    assert set(our_grads) == set(their_grads)
    for name, want in their_grads.items():
        want = want if want is not None else torch.zeros_like(our_grads[name])
        assert rel_err(our_grads[name], want) <= TOLERANCE, name
