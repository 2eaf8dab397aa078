"""Decoding through transformers' static-cache `generate()` (`occult_hf.hf.decode`): the stock model's greedy
tokens, with every MoE block of every step (one process, and 2-rank EP on the static "padded" dispatcher) free of host
reads, which is what lets the compiled step run as CUDA graphs on the GPU."""

import contextlib

import pytest
import torch

from distributed import run_world
from tiny_models import tiny_model

NEW_TOKENS = 6


@contextlib.contextmanager
def _moe_blocks_under_no_host_sync(model):
    """Every `OccultMoE` forward of `model` runs inside `no_host_sync()` in the block."""
    from occult_hf.hf.decode import no_host_sync
    from occult_hf.moe import OccultMoE

    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    assert layers

    def checked(forward):
        def run(*args, **kwargs):
            with no_host_sync():
                return forward(*args, **kwargs)

        return run

    for layer in layers:
        layer.forward = checked(layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _static_generate(model, prompt_BS, new_tokens=NEW_TOKENS):
    """Exactly `new_tokens` greedy tokens of `generate(cache_implementation="static")`, every MoE block checked for host
    reads: the tokens, and True or the `HostSyncError`'s text."""
    from occult_hf.benchmarks.decode import generate_greedy
    from occult_hf.hf.decode import HostSyncError

    try:
        with _moe_blocks_under_no_host_sync(model):
            tokens = generate_greedy(model, prompt_BS, new_tokens, "static")
    except HostSyncError as error:
        return None, str(error)
    return tokens[:, prompt_BS.shape[1] :], True


def _generate(model, prompt_BS, new_tokens=NEW_TOKENS):
    """The stock model's greedy tokens through transformers' default dynamic-cache `generate()` (same stopping rule)."""
    from occult_hf.benchmarks.decode import generate_greedy

    return generate_greedy(model, prompt_BS, new_tokens, "dynamic")[:, prompt_BS.shape[1] :]


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


def test_static_generate_matches_greedy_with_host_read_free_moe_blocks():
    from occult_hf import apply_occult

    model = tiny_model("olmoe").eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    expected = _generate(model, prompt)
    apply_occult(model, {"num_devices": 2})
    tokens, sync_free = _static_generate(model, prompt)
    assert sync_free is True, sync_free
    assert torch.equal(tokens, expected)


def test_the_host_read_check_sees_a_moe_block_that_reads_the_host(monkeypatch):
    """The check above can fail: a MoE block that reads a device value on the host is reported."""
    from occult_hf import apply_occult
    from occult_hf.moe import OccultMoE

    model = apply_occult(tiny_model("olmoe").eval(), {"num_devices": 2})
    original = OccultMoE.forward

    def reads_the_host(self, hidden_states, *args, **kwargs):
        hidden_states.sum().item()
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(OccultMoE, "forward", reads_the_host)
    _, sync_free = _static_generate(model, torch.zeros(1, 3, dtype=torch.long))
    assert "reads a device value on the host" in sync_free


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


def _ep_static_generate(rank, world, batch, lengths):
    """Rank r decodes `lengths[r]` = (prompt length, new tokens) of its own prompts on the "padded" dispatcher: whether
    its tokens equal the one-process stock model's, and True or the host read its MoE blocks made."""
    from occult_hf import apply_occult
    from occult_hf.hf.decode import use_dispatcher

    model = tiny_model("olmoe").eval()
    prompt_length, new_tokens = lengths[rank]
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_length), generator=torch.Generator().manual_seed(rank))
    expected = _generate(model, prompt, new_tokens)
    apply_occult(model)
    with use_dispatcher(model, "padded"):
        tokens, sync_free = _static_generate(model, prompt, new_tokens)
    return tokens is not None and torch.equal(tokens, expected), sync_free


@pytest.mark.world_size(2)
def test_static_cache_generate_under_ep_with_different_lengths_per_rank():
    """Ranks with different prompt lengths and token counts decode in lockstep with transformers' static cache on
    the static-capacity dispatcher: each gets its own greedy tokens (the rank that stops first keeps stepping for
    the other, so every rank's cache is sized for the longest; before, its cache overflowed in transformers)."""
    assert run_world(_ep_static_generate, 2, 2, [(5, NEW_TOKENS), (3, 2)]) == [(True, True), (True, True)]
    # the longer prompt on one rank, more new tokens on the other: the cache holds the longest prompt plus the most
    # new tokens (the ranks had agreed on the largest own sum, one rank's cache overflowed with an IndexError)
    assert run_world(_ep_static_generate, 2, 1, [(9, 2), (2, NEW_TOKENS)]) == [(True, True), (True, True)]


def _generate_cases(rank, world):
    """What `generate` under EP does with a positional generation config, a cache passed in that is too short for the
    other rank's tokens, an assistant model, and a call only rank 1 makes."""
    import time

    from transformers import GenerationConfig, StaticCache
    from transformers.utils import logging as hf_logging

    from occult_hf import apply_occult
    from occult_logs import RecordList

    model = tiny_model("olmoe").eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, (6, 3)[rank]), generator=torch.Generator().manual_seed(rank))
    new_tokens = (2, 5)[rank]
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static", eos_token_id=None, pad_token_id=0)
    expected = model.generate(prompt, config)
    apply_occult(model)
    transformers_logs = RecordList()
    hf_logging.add_handler(transformers_logs)
    report = {"positional config": torch.equal(model.generate(prompt, config), expected)}  # was an IndexError
    hf_logging.remove_handler(transformers_logs)
    report["warnings"] = [r.getMessage() for r in transformers_logs.records if "deprecated" in r.getMessage()]
    for case, call in (
        ("short cache", lambda: model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                               past_key_values=StaticCache(config=model.config, max_cache_len=8))),
        ("assistant", lambda: model.generate(prompt, max_new_tokens=2, assistant_model=tiny_model("olmoe"))),
    ):  # fmt: skip
        try:
            call()
            report[case] = "ran"
        except ValueError as error:
            report[case] = str(error)
    start = time.monotonic()
    if rank == 1:  # rank 0 never calls it
        try:
            model.generate(prompt, max_new_tokens=2, do_sample=False)
        except Exception as error:  # noqa: BLE001 - what it raises is the point
            report["alone"] = f"{type(error).__name__}: {error}"
    report["alone seconds"] = time.monotonic() - start
    return report


@pytest.mark.world_size(2)
def test_generate_under_ep_sizes_refuses_and_names_what_it_cannot_do():
    reports = run_world(_generate_cases, 2, env={"OCCULT_JOIN_TIMEOUT_S": "3"}, timeout_s=200)
    for report in reports:
        assert report["positional config"] is True and report["warnings"] == [], report["warnings"]  # max_cache_len
        # went beside the given config as a keyword, which transformers deprecates
        assert report["short cache"].startswith(
            "generate under expert parallelism: a cache passed as past_key_values holds 8 positions, but the ranks decode "
            "in lockstep until the last is done: 10 (the longest prompt plus the most new tokens of any rank, less one)"
        ), report["short cache"]
        assert report["assistant"].startswith("generate(assistant_model=...) under expert parallelism"), report["assistant"]
    alone = reports[1]
    assert alone["alone"].startswith("EPPeerError: occult_hf: generate on rank 1: EP ranks [0] did not reach it within 3 s")
    assert "generate is collective, like every forward: call it on every rank" in alone["alone"] and alone["alone seconds"] < 30


@pytest.mark.world_size(2)
def test_static_generate_under_ep_padded_dispatcher():
    assert run_world(_ep_static_generate, 2, 1, [(4, NEW_TOKENS)] * 2) == [(True, True), (True, True)]
