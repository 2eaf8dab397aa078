"""A routing profile collected around a static-cache `generate` (`cache_implementation="static"`, transformers'
compiled decoding path) counts exactly the tokens of the same dynamic-cache `generate`: there transformers hands the
forward a 4-D mask built for the cache instead of the 2-D padding mask, and the collector reads the padding from the
2-D mask `generate` holds. Left padding of different lengths and a sequence stopped early by EOS are left out alike,
for greedy, sampled and beam-search decoding, of a transformers model and of one converted by `apply_occult`, eager
and compiled. The expectation is the dynamic-cache profile of the same call, whose token count is also checked
against the tokens each sequence fed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import CompileConfig

from tiny_models import tiny_batch, tiny_model

from occult_hf import OccultConfig, apply_occult
from occult_hf.profile import ProfileCollector

PROMPT, NEW, SEED = 7, 10, 11
LEFT_PADDING = (0, 2, 3)  # per row: a full prompt, and two shorter ones


def _model(kind: str):
    model = tiny_model("olmoe", output_router_logits=False)  # the aux loss takes no padded mask during generate
    return apply_occult(model, OccultConfig(num_devices=2)).eval() if kind == "occult" else model


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids_BS = tiny_batch(batch=len(LEFT_PADDING), seq=PROMPT, seed=3)
    mask_BS = torch.ones_like(ids_BS)
    for row, padding in enumerate(LEFT_PADDING):
        mask_BS[row, :padding] = 0
    return ids_BS.masked_fill(mask_BS == 0, 0), mask_BS


def _generate(model, do_sample: bool, **kwargs) -> torch.Tensor:
    ids_BS, mask_BS = _prompt()
    torch.manual_seed(SEED)
    with torch.no_grad():
        return model.generate(
            input_ids=ids_BS, attention_mask=mask_BS, max_new_tokens=NEW, do_sample=do_sample, pad_token_id=0, **kwargs
        )


def _profiled(model, do_sample: bool, **kwargs) -> tuple[torch.Tensor, dict]:
    with ProfileCollector(model, sample_size=64) as collector:
        out_BL = _generate(model, do_sample, **kwargs)
    return out_BL, collector.routing_fields()


def _fed_tokens(out_BL: torch.Tensor, eos: int) -> int:
    """The tokens the sequences of `out_BL` fed: each row's prompt without padding, then its new tokens up to the one
    it stopped at (EOS, or the last), which is never fed back."""
    total = 0
    for row, padding in enumerate(LEFT_PADDING):
        new = out_BL[row, PROMPT:].tolist()
        stop = new.index(eos) if eos in new else NEW - 1
        total += PROMPT - padding + stop
    return total


def _assert_same_profile(static: dict, dynamic: dict) -> None:
    assert sorted(static["layers"]) == sorted(dynamic["layers"])
    for layer, want in dynamic["layers"].items():
        got = static["layers"][layer]
        assert got.token_count == want.token_count
        np.testing.assert_array_equal(got.expert_counts, want.expert_counts)
        np.testing.assert_array_equal(got.coactivation, want.coactivation)
        np.testing.assert_array_equal(got.topk_sample, want.topk_sample)
        np.testing.assert_allclose(got.logit_gram, want.logit_gram, rtol=1e-4, atol=1e-4)  # the same routing logits


def _aot_eager() -> CompileConfig:
    """The compiled decoding step on the CPU too (transformers compiles it on accelerators only); `fullgraph=True`
    and static shapes: a step compiled again each time would fail past dynamo's recompile limit (8)."""
    config = CompileConfig(backend="aot_eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("kind", ["transformers", "occult"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_static_cache_generate_counts_the_tokens_of_dynamic_cache_generate(kind, do_sample):
    model = _model(kind)
    eos = int(_generate(model, do_sample)[0, PROMPT + 2])  # row 0 stops at its third new token
    dynamic_BL, dynamic = _profiled(model, do_sample, eos_token_id=eos)
    static_BL, static = _profiled(model, do_sample, eos_token_id=eos, cache_implementation="static")
    assert torch.equal(static_BL, dynamic_BL)
    assert any(eos not in row[PROMPT:].tolist() for row in dynamic_BL)  # the others ran on, row 0 was fed padding
    assert dynamic_BL[0, PROMPT + 3 :].eq(0).all()
    assert dynamic["layers"][0].token_count == _fed_tokens(dynamic_BL, eos)
    _assert_same_profile(static, dynamic)


@pytest.mark.parametrize("kind", ["transformers", "occult"])
def test_static_cache_beam_search_counts_the_tokens_of_dynamic_cache_beam_search(kind):
    """Beam search feeds every beam (no row stops early): the padding of its prompts is left out alike."""
    model = _model(kind)
    dynamic_BL, dynamic = _profiled(model, False, num_beams=2)
    static_BL, static = _profiled(model, False, num_beams=2, cache_implementation="static")
    assert torch.equal(static_BL, dynamic_BL)
    beam_tokens = 2 * (len(LEFT_PADDING) * PROMPT - sum(LEFT_PADDING) + len(LEFT_PADDING) * (NEW - 1))
    assert dynamic["layers"][0].token_count == beam_tokens
    _assert_same_profile(static, dynamic)


def test_compiled_static_cache_decoding_counts_the_tokens_of_dynamic_cache_generate():
    """Past dynamo's recompile limit of decoding steps (NEW > 8), the compiled step compiles once."""
    model = _model("occult")
    eos = int(_generate(model, False)[0, PROMPT + 2])
    dynamic_BL, dynamic = _profiled(model, False, eos_token_id=eos)
    torch._dynamo.reset()
    static_BL, static = _profiled(
        model, False, eos_token_id=eos, cache_implementation="static", compile_config=_aot_eager()
    )
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile the decoding step"
    assert torch.equal(static_BL, dynamic_BL)
    _assert_same_profile(static, dynamic)


def test_a_forward_outside_generate_still_needs_a_2d_mask():
    """The 2-D mask of a static-cache `generate` that has returned is not taken for a later forward's padding."""
    model = _model("transformers")
    ids_BS, _ = _prompt()
    causal = torch.tril(torch.ones(PROMPT, PROMPT, dtype=torch.bool))[None, None].expand(len(LEFT_PADDING), 1, -1, -1)
    with ProfileCollector(model, sample_size=0) as collector:
        _generate(model, False, cache_implementation="static")
        counted = collector.token_count
        with pytest.raises(ValueError, match=r"needs a 2-D \[batch, seq\] attention_mask .* pass the padding mask"):
            with torch.no_grad():
                model(input_ids=ids_BS, attention_mask=causal)
        assert collector.token_count == counted
    assert "prepare_inputs_for_generation" not in model.__dict__ and "_get_stopping_criteria" not in model.__dict__
