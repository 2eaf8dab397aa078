"""Greedy decoding on static buffers (`occult_hf.hf.decode`): the tokens of a plain greedy loop, and a
decode step (one process and 2-rank EP with the static "padded" dispatcher) that never reads the device
on the host, which is what lets it run as one CUDA graph on the GPU."""

import pytest
import torch

from distributed import run_world
from tiny_models import tiny_model

NEW_TOKENS = 6


def _decode_checks(model, prompt_BS):
    """Tokens of the static decoder and of `generate` for `prompt_BS`, and whether a step is free of host reads."""
    from occult_hf.hf.decode import GreedyDecoder, HostSyncError, no_host_sync

    decoder = GreedyDecoder(model, batch_size=prompt_BS.shape[0], max_length=prompt_BS.shape[1] + NEW_TOKENS + 1, graph=False)
    ours = decoder.generate(prompt_BS, NEW_TOKENS).tokens
    decoder.prefill(prompt_BS)
    try:
        with torch.no_grad(), no_host_sync():
            decoder.step()
        sync_free = True
    except HostSyncError as error:
        sync_free = str(error)
    return ours, sync_free


@torch.no_grad()
def _generate(model, prompt_BS):
    """Greedy tokens recomputing the whole sequence at every step (no cache, no EOS handling)."""
    sequence = prompt_BS
    for _ in range(NEW_TOKENS):
        sequence = torch.cat([sequence, model(sequence).logits[:, -1:].argmax(-1)], dim=1)
    return sequence[:, prompt_BS.shape[1] :]


def test_no_host_sync_catches_host_reads():
    from occult_hf.hf.decode import HostSyncError, no_host_sync

    t = torch.arange(4)
    with pytest.raises(HostSyncError):
        with no_host_sync():
            t.sum().item()
    with pytest.raises(HostSyncError):
        with no_host_sync():
            t[t > 1]
    with no_host_sync():
        torch.where(t > 1, t, 0).cumsum(0)


def test_static_decoder_matches_generate_one_process():
    from occult_hf import apply_occult

    model = tiny_model("olmoe").eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    expected = _generate(model, prompt)
    apply_occult(model, {"num_devices": 2})
    ours, sync_free = _decode_checks(model, prompt)
    assert torch.equal(ours, expected)
    assert sync_free is True, sync_free


@pytest.mark.parametrize("family", ["olmoe", "deepseek"])
def test_static_decoder_passes_the_cache_by_the_models_own_keyword(family):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40);
    the decoder passes the name the installed version's forward takes, so it neither warns nor breaks later."""
    import inspect
    import warnings

    from occult_hf.hf.compat import cache_keyword
    from occult_hf.hf.decode import GreedyDecoder

    model = tiny_model(family).eval()
    keyword = cache_keyword(model)
    assert keyword in inspect.signature(model.forward).parameters
    decoder = GreedyDecoder(model, batch_size=1, max_length=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder.prefill(torch.zeros(1, 3, dtype=torch.long))
        decoder.step()
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


def _ep_world(rank, world):
    from occult_hf import apply_occult
    from occult_hf.hf.decode import use_dispatcher

    model = tiny_model("olmoe").eval()
    prompts = torch.randint(0, model.config.vocab_size, (world, 1, 4), generator=torch.Generator().manual_seed(1))
    expected = _generate(model, prompts[rank])
    apply_occult(model)
    with use_dispatcher(model, "padded"):
        ours, sync_free = _decode_checks(model, prompts[rank])
    return torch.equal(ours, expected), sync_free


def test_use_dispatcher_keeps_the_layers_replica_choice_and_pin_slack(monkeypatch):
    """The decode's dispatcher routes replicated experts as the layer's own: same `replica_choice` and pin slack
    (before, it fell back to the static rule and the default slack)."""
    from dataclasses import replace

    import occult_hf.hf.decode
    from occult_hf import apply_occult
    from occult_hf.hf.decode import use_dispatcher
    from occult_hf.moe import OccultMoE

    model = tiny_model("olmoe").eval()
    apply_occult(model, {"num_devices": 2, "replica_choice": "load_aware"})
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    built = []
    monkeypatch.setattr(occult_hf.hf.decode, "build_dispatcher", lambda settings, ep, layout, device: built.append((settings, layout)))
    with use_dispatcher(model, "padded"):
        pass
    assert len(built) == len(layers) > 0
    for (settings, layout), layer in zip(built, layers):
        assert settings == replace(layer.settings, dispatcher="padded") and settings.replica_choice == "load_aware"
        assert layout is layer.layout


def _ep_static_generate(rank, world):
    from occult_hf import apply_occult
    from occult_hf.hf.decode import use_dispatcher

    model = tiny_model("olmoe").eval()
    prompt_length, new_tokens = (5, NEW_TOKENS) if rank == 0 else (3, 2)
    prompt = torch.randint(0, model.config.vocab_size, (2, prompt_length), generator=torch.Generator().manual_seed(rank))
    expected = _generate(model, prompt)[:, :new_tokens]
    apply_occult(model)
    with use_dispatcher(model, "padded"):
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static", output_router_logits=False)
    return torch.equal(tokens[:, prompt_length:], expected)


@pytest.mark.world_size(2)
def test_static_cache_generate_under_ep_with_different_lengths_per_rank():
    """Ranks with different prompt lengths and token counts decode in lockstep with transformers' static cache on
    the static-capacity dispatcher: each gets its own greedy tokens (the rank that stops first keeps stepping for
    the other, so every rank's cache is sized for the longest; before, its cache overflowed in transformers)."""
    assert run_world(_ep_static_generate, 2) == [True, True]


@pytest.mark.world_size(2)
def test_static_decoder_under_ep_padded_dispatcher():
    assert run_world(_ep_world, 2) == [(True, True), (True, True)]
