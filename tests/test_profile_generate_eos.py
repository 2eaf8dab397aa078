"""A routing profile collected around batch `generate` counts only the tokens of each sequence's text: once a
sequence has stopped (emitted EOS), transformers keeps feeding it pad tokens, under an attention mask of ones, until
every sequence has stopped, and those positions must not enter the co-activation statistics placement is planned
from. The expectation is independent of generation: plain forwards over exactly the tokens each sequence fed."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tiny_models import tiny_batch, tiny_model

from occult_hf.profile import ProfileCollector, RoutingProfile

PROMPT, NEW = 6, 6


def _generate(model, ids_BS, mask_BS, **kwargs):
    return model.generate(
        input_ids=ids_BS, attention_mask=mask_BS, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs
    )


def _peft(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))  # B = 0: the same tokens


@pytest.mark.parametrize("how", ["generate of the model", "generate of a peft model around it", "two collectors at once"])
def test_tokens_fed_after_a_sequence_stopped_are_not_counted(how):
    model = tiny_model("olmoe", output_router_logits=False)
    ids_BS = tiny_batch(batch=2, seq=PROMPT, seed=3)
    mask_BS = torch.ones(2, PROMPT, dtype=torch.long)
    mask_BS[1, :2] = 0  # left padding, left out through the mask
    with torch.no_grad():
        free_BS = _generate(model, ids_BS, mask_BS)
    eos = int(free_BS[0, PROMPT + 1])  # row 0 stops after its second new token, row 1 runs to max_new_tokens
    assert eos not in free_BS[1, PROMPT:].tolist() and eos not in free_BS[0, PROMPT : PROMPT + 1].tolist()

    generator = _peft(model) if how == "generate of a peft model around it" else model
    collectors = [ProfileCollector(model, sample_size=0) for _ in range(2 if how == "two collectors at once" else 1)]
    with contextlib.ExitStack() as attached, torch.no_grad():
        for collector in collectors:
            attached.enter_context(collector)
        out_BS = _generate(generator, ids_BS, mask_BS, eos_token_id=eos)
    assert out_BS[0, PROMPT + 2 :].tolist() == [0] * (NEW - 2)  # row 0 was fed pad tokens after its EOS
    assert "_get_stopping_criteria" not in model.__dict__  # the last detach put the model back

    # each row's real prompt tokens, then its new tokens but the last (a row's last token is never fed back)
    fed = [torch.cat([ids_BS[0], out_BS[0, PROMPT : PROMPT + 1]]), torch.cat([ids_BS[1, 2:], out_BS[1, PROMPT:-1]])]
    with ProfileCollector(model, sample_size=0) as reference, torch.no_grad():
        for tokens in fed:
            model(input_ids=tokens[None])
    expected = RoutingProfile.from_collector(reference)
    for collector in collectors:
        profile = RoutingProfile.from_collector(collector)
        assert sorted(profile.layers) == sorted(expected.layers)
        for layer in expected.layers:
            routing, want = profile.layer(layer), expected.layer(layer)
            assert routing.token_count == want.token_count == (PROMPT + 1) + (PROMPT - 2 + NEW - 1)
            np.testing.assert_array_equal(routing.expert_counts, want.expert_counts)
            np.testing.assert_array_equal(routing.coactivation, want.coactivation)


def test_forwards_after_generate_count_every_token_and_detach_leaves_the_model_as_it_was():
    model = tiny_model("olmoe", output_router_logits=False)
    ids_BS = tiny_batch(batch=2, seq=PROMPT, seed=3)
    mask_BS = torch.ones(2, PROMPT, dtype=torch.long)
    with torch.no_grad():
        eos = int(_generate(model, ids_BS, mask_BS)[0, PROMPT])
    with ProfileCollector(model) as collector, torch.no_grad():
        _generate(model, ids_BS, mask_BS, eos_token_id=eos)
        before = collector.token_count
        model(input_ids=ids_BS, attention_mask=mask_BS)  # the same batch size: no row of it has stopped
        assert collector.token_count == before + 2 * PROMPT
    assert "_get_stopping_criteria" not in model.__dict__
