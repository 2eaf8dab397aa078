"""Routing profiles: streaming counts, reservoir sample, trace import, safetensors round trip,
collection through the real routers of every supported family, compatibility errors."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_config, tiny_model

from occult_hf.profile import LayerAccumulator, LayerRouting, ProfileCollector, ReservoirSample, RoutingProfile
from occult_hf.profile import stats as routing_stats

ROUTING = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "routing"
QWEN_TRACE = ROUTING / "qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
MIXTRAL_TRACE = ROUTING / "mixtral8x7b_instruct_fp8_humaneval0_raw_prefill_decode_trace.npz"
OLMOE_PAIRS = ROUTING / "olmoe1b7b0125__runB_2025-03-07__wikitext2_8192tok_coact.npz"


def random_topk(num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """`[T, k]` distinct expert ids per row."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])


def brute_force_counts(topk_Tk: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    coactivation = np.zeros((num_experts, num_experts), dtype=np.int64)
    counts = np.zeros(num_experts, dtype=np.int64)
    for row in topk_Tk:
        for e in row:
            counts[e] += 1
        for i, j in itertools.permutations(row, 2):
            coactivation[i, j] += 1
    return coactivation, counts


def assert_counts_consistent(routing: LayerRouting, top_k: int) -> None:
    """The invariants every profile layer obeys, whatever made it."""
    c = routing.coactivation
    assert (c == c.T).all() and not np.diagonal(c).any()
    assert (c.sum(axis=1) == routing.expert_counts * (top_k - 1)).all()
    assert routing.expert_counts.sum() == routing.token_count * top_k
    if routing.topk_sample is not None:
        s = np.sort(routing.topk_sample, axis=1)
        assert (s[:, 1:] != s[:, :-1]).all(), "a sampled token repeats an expert"


# ----- accumulation ----------------------------------------------------------------------------
def test_accumulator_matches_brute_force_and_excludes_masked_tokens():
    E, k = 7, 3
    ids_Tk = random_topk(50, E, k, seed=1)
    logits_TE = torch.randn(50, E, generator=torch.Generator().manual_seed(2))
    mask_T = torch.rand(50, generator=torch.Generator().manual_seed(3)) > 0.3
    acc = LayerAccumulator(E, k, sample_size=None)
    acc.update(ids_Tk[:20], logits_TE[:20], mask_T[:20])
    acc.update(ids_Tk[20:], logits_TE[20:].half(), mask_T[20:])  # any float dtype
    routing = acc.to_layer_routing()
    kept = ids_Tk[mask_T].numpy()
    coactivation, counts = brute_force_counts(kept, E)
    np.testing.assert_array_equal(routing.coactivation, coactivation)
    np.testing.assert_array_equal(routing.expert_counts, counts)
    assert routing.token_count == int(mask_T.sum())
    np.testing.assert_array_equal(routing.topk_sample, kept)  # sample_size=None keeps all, in order
    expected_gram = torch.cat([logits_TE[:20][mask_T[:20]], logits_TE[20:].half().double()[mask_T[20:]]]).double()
    np.testing.assert_allclose(routing.logit_gram, (expected_gram.T @ expected_gram).numpy(), rtol=1e-12)
    assert_counts_consistent(routing, k)


def test_accumulator_chunking_does_not_change_counts(monkeypatch):
    ids_Tk, logits_TE = random_topk(40, 6, 2, seed=4), torch.randn(40, 6)
    whole = LayerAccumulator(6, 2, sample_size=0)
    whole.update(ids_Tk, logits_TE)
    monkeypatch.setattr(routing_stats, "_CHUNK_TOKENS", 7)
    chunked = LayerAccumulator(6, 2, sample_size=0)
    chunked.update(ids_Tk, logits_TE)
    np.testing.assert_array_equal(whole.coactivation(), chunked.coactivation())
    np.testing.assert_allclose(whole.logit_gram(), chunked.logit_gram(), rtol=1e-12)
    assert chunked.to_layer_routing().topk_sample is None


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda acc: acc.update(torch.zeros(4, 3, dtype=torch.long)), r"shape \[T, top_k=2\]"),
        (lambda acc: acc.update(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 5)), r"\[T=4, E=6\]"),
        (lambda acc: acc.update(torch.zeros(4, 2, dtype=torch.long), None, torch.ones(3)), r"\[T=4\]"),
    ],
)
def test_accumulator_rejects_bad_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call(LayerAccumulator(6, 2))


def test_accumulator_rejects_logits_in_some_batches_only():
    acc = LayerAccumulator(6, 2)
    acc.update(random_topk(4, 6, 2), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="every batch of a layer or for none"):
        acc.update(random_topk(4, 6, 2))


def test_reservoir_is_bounded_deterministic_and_uniform():
    stream = torch.arange(2000).reshape(-1, 1)
    batches = [stream[a:b] for a, b in [(0, 1), (1, 300), (300, 1100), (1100, 1101), (1101, 2000)]]
    inclusion = np.zeros(10)
    for seed in range(300):
        sample = ReservoirSample(200, seed=seed)
        for batch in batches:
            sample.add(batch)
        rows = sample.rows()[:, 0]
        assert len(rows) == 200 and len(set(rows.tolist())) == 200
        assert (np.diff(rows) > 0).all(), "the sample is returned in stream order"
        inclusion += np.bincount(rows // 200, minlength=10)
    # each tenth of the stream holds 10% of the sampled rows: 6000 expected, sd about 73
    assert np.abs(inclusion - 6000).max() < 350, inclusion
    again = ReservoirSample(200, seed=7)
    for batch in batches:
        again.add(batch)
    first = ReservoirSample(200, seed=7)
    for batch in batches:
        first.add(batch)
    np.testing.assert_array_equal(first.rows(), again.rows())
    assert first.rows_seen == 2000


def test_reservoir_rejects_bad_capacity():
    with pytest.raises(ValueError, match="sample_size must be None"):
        ReservoirSample(-1)


# ----- traces ----------------------------------------------------------------------------------
@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason=f"real routing data the project does not ship: {QWEN_TRACE} not present")
def test_qwen_trace_drops_warmup_rows_and_keeps_every_real_token():
    profile = RoutingProfile.from_trace(QWEN_TRACE)
    raw = np.load(QWEN_TRACE)
    real = raw["topk_ids"][~raw["is_warmup_dummy"]].astype(np.int64)
    assert (profile.num_experts, profile.top_k, sorted(profile.layers)) == (60, 4, [0])
    routing = profile.layer(0)
    assert routing.token_count == 4384 == len(real)
    np.testing.assert_array_equal(routing.topk_sample, real)
    coactivation, counts = brute_force_counts(real, 60)
    np.testing.assert_array_equal(routing.coactivation, coactivation)
    np.testing.assert_array_equal(routing.expert_counts, counts)
    assert routing.logit_gram is None
    assert profile.meta["num_experts_inferred"] is True and profile.meta["tokens_masked_out"] == 16640


@pytest.mark.skipif(not MIXTRAL_TRACE.is_file(), reason=f"real routing data the project does not ship: {MIXTRAL_TRACE} not present")
def test_mixtral_trace_drops_rows_with_missing_entries_per_layer():
    profile = RoutingProfile.from_trace(MIXTRAL_TRACE)
    raw = np.load(MIXTRAL_TRACE)
    ids = np.concatenate([raw["prefill_experts"], raw["decode_experts"]])  # [218, 32, 2]
    assert (profile.num_experts, profile.top_k, sorted(profile.layers)) == (8, 2, list(range(32)))
    assert profile.meta["trace_keys"] == ["prefill_experts", "decode_experts"]
    for layer in (0, 5, 31):
        complete = (ids[:, layer] >= 0).all(axis=1)
        routing = profile.layer(layer)
        assert routing.token_count == complete.sum() == 218 - profile.meta["dropped_rows"][str(layer)]
        np.testing.assert_array_equal(routing.topk_sample, ids[complete, layer])
        assert_counts_consistent(routing, 2)
    assert sum(profile.meta["dropped_rows"].values()) == 122 + 77
    decode_only = RoutingProfile.from_trace(MIXTRAL_TRACE, key="decode_experts")
    assert decode_only.layer(0).token_count == (raw["decode_experts"][:, 0] >= 0).all(axis=1).sum()


@pytest.mark.skipif(not OLMOE_PAIRS.is_file(), reason=f"real routing data the project does not ship: {OLMOE_PAIRS} not present")
def test_olmoe_pair_counts_become_a_profile_without_samples():
    profile = RoutingProfile.from_trace(OLMOE_PAIRS)
    raw = np.load(OLMOE_PAIRS)
    assert (profile.num_experts, profile.top_k, len(profile.layers)) == (64, 8, 16)
    assert not profile.has_samples
    np.testing.assert_array_equal(profile.layer(3).coactivation, raw["coact"][3])
    np.testing.assert_array_equal(profile.layer(3).expert_counts, raw["freq"][3])
    assert profile.layer(3).token_count == 8192
    assert_counts_consistent(profile.layer(3), 8)
    with pytest.raises(ValueError, match="has no router-logit Gram matrix"):
        profile.similarity(3)


def test_trace_errors_say_what_was_expected(tmp_path):
    # real files of other kinds (per-expert frequencies only) are refused with the expected layouts
    frequencies = ROUTING / "qwen3_30b_a3b_expert_activation_freq.npz"
    if frequencies.is_file():  # real routing data the project does not ship
        with pytest.raises(ValueError, match=r"has arrays \['act__.*expected 'topk_ids'.*'coact' \[Z, E, E\]"):
            RoutingProfile.from_trace(frequencies)
    odd = tmp_path / "odd.npz"
    np.savez(odd, experts_per_token=np.zeros((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"expected 'topk_ids' \[T, k\] or \[T, Z, k\]"):
        RoutingProfile.from_trace(odd)
    repeated = tmp_path / "repeated.npz"
    np.savez(repeated, topk_ids=np.array([[0, 1], [2, 2]]))
    with pytest.raises(ValueError, match=r"repeats an expert .* token 1"):
        RoutingProfile.from_trace(repeated)
    too_big = tmp_path / "too_big.npz"
    np.savez(too_big, topk_ids=np.array([[0, 5]]))
    with pytest.raises(ValueError, match="expert id 5 but num_experts=4"):
        RoutingProfile.from_trace(too_big, num_experts=4)
    with pytest.raises(KeyError, match="its arrays are"):
        RoutingProfile.from_trace(too_big, key="ids")
    bad_mask = tmp_path / "bad_mask.npz"
    np.savez(bad_mask, topk_ids=np.array([[0, 1]]), valid=np.array([True, False]))
    with pytest.raises(ValueError, match=r"row mask 'valid' .* expected \[T=1\]"):
        RoutingProfile.from_trace(bad_mask)


def test_single_layer_trace_layer_index_and_sample_size(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, topk_ids=random_topk(500, 10, 3).numpy().astype(np.int16), valid=np.arange(500) % 5 != 0)
    profile = RoutingProfile.from_trace(path, layer=7, num_experts=12, sample_size=50, seed=3)
    assert sorted(profile.layers) == [7] and profile.num_experts == 12
    routing = profile.layer(7)
    assert routing.token_count == 400 and routing.topk_sample.shape == (50, 3)
    assert profile.meta["num_experts_inferred"] is False


# ----- files -----------------------------------------------------------------------------------
def make_profile(with_logits: bool = True) -> RoutingProfile:
    layers = {}
    for layer in (1, 3):
        acc = LayerAccumulator(6, 2, sample_size=30, seed=0)
        logits = torch.randn(80, 6, generator=torch.Generator().manual_seed(layer)) if with_logits else None
        acc.update(random_topk(80, 6, 2, seed=layer), logits)
        layers[layer] = acc.to_layer_routing()
    return RoutingProfile(6, 2, layers, model_type="olmoe", meta={"source": "unit test", "note": [1, 2]})


def test_safetensors_round_trip(tmp_path):
    profile = make_profile()
    path = tmp_path / "p.safetensors"
    profile.save(path)
    loaded = RoutingProfile.load(path)
    assert (loaded.num_experts, loaded.top_k, loaded.model_type, loaded.meta) == (6, 2, "olmoe", profile.meta)
    for layer in (1, 3):
        a, b = profile.layer(layer), loaded.layer(layer)
        assert a.token_count == b.token_count == 80
        for name in ("coactivation", "expert_counts", "logit_gram", "topk_sample"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(b, name).dtype == (np.float64 if name == "logit_gram" else np.int64)
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        assert {"layer.1.coactivation", "layer.1.expert_counts", "layer.1.logit_gram", "layer.1.token_count",
                "layer.1.topk_sample"} <= set(f.keys())


def test_similarity_is_cosine_of_logit_columns():
    logits = torch.randn(100, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[:, 4] = 0.0  # an expert whose logits are all zero
    acc = LayerAccumulator(5, 2, sample_size=0)
    acc.update(torch.topk(logits, 2).indices, logits)
    similarity = RoutingProfile(5, 2, {0: acc.to_layer_routing()}).similarity(0)
    expected = torch.nn.functional.cosine_similarity(logits.T[:, None, :], logits.T[None, :, :], dim=-1).numpy()
    np.testing.assert_allclose(similarity[:4, :4], expected[:4, :4], rtol=1e-12)
    assert (similarity[4, :4] == 0).all() and similarity[4, 4] == 1.0


def test_load_rejects_files_that_are_not_profiles(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="lacks the 'occult_profile' entry"):
        RoutingProfile.load(path)
    with pytest.raises(FileNotFoundError):
        RoutingProfile.load(tmp_path / "missing.safetensors")


def test_load_rejects_damaged_samples_and_logit_grams(tmp_path):
    """Damage that keeps a tensor's dtype, shape and range: a top-k row naming one expert twice (a real
    top-k set never does; CT and the planners would count it as a smaller set) and a non-finite logit
    Gram (similarity pruning would compare NaN cosines)."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    path = tmp_path / "p.safetensors"
    make_profile().save(path)
    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        metadata = f.metadata()
    sample = tensors["layer.3.topk_sample"].copy()
    sample[5, 1] = sample[5, 0]
    save_file({**tensors, "layer.3.topk_sample": sample}, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=r"tensor 'layer.3.topk_sample' repeats an expert within a token's top-k \(1 rows; first: row 5"):
        RoutingProfile.load(path)
    gram = tensors["layer.1.logit_gram"].copy()
    gram[0, 2] = np.nan
    save_file({**tensors, "layer.1.logit_gram": gram}, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=r"tensor 'layer.1.logit_gram' holds non-finite values"):
        RoutingProfile.load(path)


def test_profile_validates_shapes():
    routing = make_profile().layer(1)
    with pytest.raises(ValueError, match=r"coactivation has shape \(6, 6\), expected \[7, 7\]"):
        RoutingProfile(7, 2, {0: routing})
    with pytest.raises(ValueError, match=r"expected \[N, top_k=3\]"):
        RoutingProfile(6, 3, {0: routing})
    with pytest.raises(KeyError, match=r"covers layers \[1, 3\]"):
        make_profile().layer(2)


# ----- collection through the real routers ---------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


def test_collection_counts_real_tokens_only_in_every_family(family_model):
    family, model = family_model
    ids_BS = tiny_batch(batch=3, seq=12, seed=5)
    mask_BS = torch.ones_like(ids_BS)
    mask_BS[1, 7:] = 0  # right padding
    mask_BS[2, 3:] = 0
    with ProfileCollector(model, sample_size=20, seed=1) as padded:
        model(input_ids=ids_BS, attention_mask=mask_BS)
    # the same real tokens, one unpadded sequence per forward
    with ProfileCollector(model, sample_size=None) as unpadded:
        for row, length in enumerate(mask_BS.sum(1).tolist()):
            model(input_ids=ids_BS[row : row + 1, :length])
    profile, reference = RoutingProfile.from_collector(padded, source="test"), RoutingProfile.from_collector(unpadded)
    top_k = tiny_config(family).num_experts_per_tok
    assert sorted(profile.layers) == list(MOE_LAYERS[family])
    assert (profile.num_experts, profile.top_k, profile.model_type) == (8, top_k, model.config.model_type)
    for layer in MOE_LAYERS[family]:
        routing, expected = profile.layer(layer), reference.layer(layer)
        assert routing.token_count == 12 + 7 + 3
        assert_counts_consistent(routing, top_k)
        np.testing.assert_array_equal(routing.coactivation, expected.coactivation)
        np.testing.assert_array_equal(routing.expert_counts, expected.expert_counts)
        # padded and unpadded forwards round differently in fp32: entries near zero (sums that
        # cancel) need an absolute tolerance on the matrix's own scale
        scale = np.abs(expected.logit_gram).max()
        np.testing.assert_allclose(routing.logit_gram, expected.logit_gram, rtol=1e-4, atol=1e-6 * scale)
        assert routing.topk_sample.shape == (20, top_k)
        # every sampled set is one of the real tokens' sets
        real_sets = {tuple(sorted(row)) for row in expected.topk_sample.tolist()}
        assert {tuple(sorted(row)) for row in routing.topk_sample.tolist()} <= real_sets
    profile.check_compatible(model)
    similarity = profile.similarity(MOE_LAYERS[family][0])
    assert similarity.shape == (8, 8) and np.allclose(similarity, similarity.T)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")
def test_checkpoint_recomputation_and_generation_count_each_token_once():
    model = tiny_model("olmoe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids_BS = tiny_batch(batch=2, seq=10)
    with ProfileCollector(model) as collector:
        model(input_ids=ids_BS, labels=ids_BS).loss.backward()  # backward re-runs every router
    assert collector.token_count == 20
    # (transformers' own aux loss breaks under generation with a padded mask: leave router logits off)
    model = tiny_model("olmoe", output_router_logits=False)
    mask_BS = torch.ones(2, 6, dtype=torch.long)
    mask_BS[0, :2] = 0  # left padding, as generation uses
    with ProfileCollector(model) as collector:
        model.generate(input_ids=ids_BS[:, :6], attention_mask=mask_BS, max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    # prompt tokens that are not padding, then one new token per row per step (the last one is not fed back)
    assert collector.token_count == 10 + 2 * 2


class ByteTokenizer:
    """Token ids = UTF-8 bytes offset past the special ids, as a transformers tokenizer returns them."""

    pad_token_id = 0

    def __call__(self, text, verbose=True):
        return {"input_ids": [b % 125 + 3 for b in text.encode("utf-8")]}


def test_collect_over_text_file_and_dataset(tmp_path):
    import datasets

    model = tiny_model("qwen3_moe")
    documents = ["abcdefghij" * 3, "short", "", "0123456789"]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(documents))
    from_file = RoutingProfile.collect(model, path, ByteTokenizer(), batch_size=2, max_length=8, progress=False)
    assert from_file.layer(0).token_count == 30 + 5 + 10  # long documents are split into windows, none cut
    assert "docs.txt" in from_file.meta["source"]
    dataset = datasets.Dataset.from_dict({"body": documents})
    from_dataset = RoutingProfile.collect(
        model, dataset, ByteTokenizer(), batch_size=3, max_length=8, text_column="body", progress=False
    )
    np.testing.assert_array_equal(from_dataset.layer(1).coactivation, from_file.layer(1).coactivation)
    limited = RoutingProfile.collect(model, path, ByteTokenizer(), max_tokens=12, progress=False)
    assert limited.layer(0).token_count == 12
    token_ids = [[5, 6, 7, 8], [9, 10]]
    assert RoutingProfile.collect(model, token_ids, progress=False).layer(0).token_count == 6
    with pytest.raises(ValueError, match="the data holds text: pass tokenizer="):
        RoutingProfile.collect(model, documents, progress=False)
    with pytest.raises(KeyError, match=r"no column 'text'; its columns are \['body'\]"):
        RoutingProfile.collect(model, dataset, ByteTokenizer(), progress=False)
    assert model.training is False


def test_token_ids_outside_the_vocabulary_are_named():
    """Token-id data made by another tokenizer (a dataset column of ids): an id the embedding has no row for
    must be named, not surface as torch's 'index out of range in self' from inside the model."""
    model = tiny_model("olmoe")  # vocab_size 128
    with pytest.raises(ValueError, match=r"document 1: token id 300 at position 2 is outside the model's vocabulary \[0, 128\)"):
        RoutingProfile.collect(model, [[5, 6], [7, 8, 300]], progress=False)
    with pytest.raises(ValueError, match=r"document 0: token id -1 at position 0 is outside"):
        RoutingProfile.collect(model, [[-1, 6]], progress=False)


def test_data_without_tokens_is_named():
    """Nothing to profile is the data's fault, not the collector's: the error names the data."""
    import datasets

    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match=r"the data \(list of documents\) holds no tokens to profile"):
        RoutingProfile.collect(model, [], progress=False)
    with pytest.raises(ValueError, match=r"the data \(dataset column 'text' \(2 rows\)\) holds no tokens to profile"):
        RoutingProfile.collect(model, datasets.Dataset.from_dict({"text": [[], []]}), progress=False)


def test_incompatible_profiles_are_clear_errors(tmp_path):
    model = tiny_model("olmoe")
    with ProfileCollector(model) as collector:
        model(input_ids=tiny_batch())
    profile = RoutingProfile.from_collector(collector)
    path = tmp_path / "olmoe.safetensors"
    profile.save(path)
    assert sorted(RoutingProfile.load(path, model=model).layers) == [0, 1]
    with pytest.raises(ValueError, match=r"num_experts=8 but the model \(olmoe\) has 6 routed experts"):
        RoutingProfile.load(path, model=tiny_config("olmoe", num_experts=6))
    # a loaded profile's fit errors name its file, also when checked later (apply_occult's similarity profile)
    with pytest.raises(ValueError, match=re.escape(f"routing profile {str(path)!r} is for top_k=2 but the model")):
        RoutingProfile.load(path).check_compatible(tiny_config("olmoe", top_k=3))
    with pytest.raises(ValueError, match=re.escape(f"routing profile {str(path)!r} lacks the model's MoE layers [2]")):
        RoutingProfile.load(path, model=tiny_model("olmoe", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"top_k=2 but the model \(olmoe\) routes each token to top_k=3"):
        profile.check_compatible(tiny_config("olmoe", top_k=3))
    with pytest.raises(ValueError, match=r"lacks the model's MoE layers \[2\]"):
        profile.check_compatible(tiny_model("olmoe", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"layers \[1\] that are not MoE layers"):
        profile.check_compatible(tiny_model("olmoe", num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"layers \[1\] that are not MoE layers .* model MoE layers \[0, 2\]"):
        RoutingProfile(8, 2, {0: profile.layer(0), 1: profile.layer(1)}).check_compatible(tiny_config("qwen2_moe"))
    partial = RoutingProfile(8, 2, {0: profile.layer(0)})
    partial.check_compatible(model, require_all_layers=False)
    with pytest.raises(ValueError, match=r"occult_hf does not support model_type 'llama'"):
        profile.check_compatible(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="needs a 2-D"):
        with ProfileCollector(model):
            model(input_ids=tiny_batch(), attention_mask=torch.ones(2, 1, 16, 16))


@pytest.mark.skipif(not MIXTRAL_TRACE.is_file(), reason=f"real Mixtral trace not found at {MIXTRAL_TRACE} (../shared)")
def test_real_mixtral_routing_fits_the_8x7b_architecture_and_its_placement_is_exact():
    """The recorded Mixtral-8x7B routing describes the published 8x7B architecture as the mixtral adapter
    reads it (E=8, k=2, MoE layers 0..31; the config is built on the meta device, no weights), and a
    placement planned on it runs a tiny 32-layer Mixtral exactly on 4 logical devices."""
    from occult_hf import OccultConfig, apply_occult, plan_placement

    profile = RoutingProfile.from_trace(MIXTRAL_TRACE, model_type="mixtral")
    profile.check_compatible(transformers.MixtralConfig())  # num_local_experts=8, num_experts_per_tok=2, 32 layers
    placement = plan_placement(profile, 4, "occult")
    model = tiny_model("mixtral", seed=2, num_hidden_layers=32)
    input_ids = tiny_batch(model.config.vocab_size, batch=2, seq=8)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    occult = apply_occult(tiny_model("mixtral", seed=2, num_hidden_layers=32), OccultConfig(placement=placement))
    with torch.no_grad():
        actual = occult(input_ids=input_ids).logits
    assert float((actual - expected).norm() / expected.norm()) <= 1e-5


# ----- merges, and files save refuses or load misreads ----------------------------------------
def _stream_profile(topk_Tk: torch.Tensor, sample_size: int | None, source: str) -> RoutingProfile:
    """A one-layer E=8, k=2 profile of a token stream, sampled as a collector samples it."""
    acc = LayerAccumulator(8, 2, sample_size=sample_size, seed=0)
    acc.update(topk_Tk)
    return RoutingProfile(8, 2, {0: acc.to_layer_routing()}, model_type="olmoe", meta={"source": source})


def test_merge_samples_the_union_of_streams_by_their_tokens():
    """Pooling the streams' sample rows made a stream of 200 tokens half the sample of 20200 (its CT of 2 pulled the
    sample's CT up), and a stream without a sample left the sample to the others' tokens alone."""
    small = _stream_profile(torch.tensor([[0, 1]]).repeat(200, 1), None, "small")
    order = torch.argsort(torch.rand(20000, 6, generator=torch.Generator().manual_seed(0)), dim=1)
    large = _stream_profile(order[:, :2] + 2, 200, "large")
    merged = RoutingProfile.merge([small, large])
    sample = merged.layer(0).topk_sample
    assert merged.layer(0).token_count == 20200 and len(sample) == 202  # the largest sample the large stream's rows allow
    assert int((sample < 2).all(axis=1).sum()) == 2  # the small stream's share of the tokens: 200 / 20200
    np.testing.assert_array_equal(RoutingProfile.merge([small, large]).layer(0).topk_sample, sample)  # seeded
    assert merged.meta["source"] == "merged: small, large"
    counts_only = RoutingProfile(8, 2, {0: dataclasses.replace(large.layer(0), topk_sample=None)}, "olmoe")
    assert RoutingProfile.merge([small, counts_only]).layer(0).topk_sample is None
    # streams equal in tokens and rows (a job's ranks) keep every row, in order
    ranks = [_stream_profile(order[r * 100 : (r + 1) * 100, :2], 50, "window") for r in range(2)]
    pooled = RoutingProfile.merge(ranks)
    np.testing.assert_array_equal(pooled.layer(0).topk_sample, np.concatenate([r.layer(0).topk_sample for r in ranks]))
    assert pooled.meta["source"] == "window"


@pytest.mark.parametrize(
    "layer, change, rule",
    [
        (1, {"coactivation": np.zeros((6, 6), dtype=np.int64)}, r"layer 1: coactivation row \d+ sums to 0"),
        (3, {"topk_sample": None}, r"layers \[3\] hold no top-k sample rows but layers \[1\] do"),
        (1, {"token_count": 0}, r"layer 1: a count exceeds token_count=0"),
    ],
)
def test_save_refuses_a_profile_load_would_refuse_and_leaves_the_file(tmp_path, layer, change, rule):
    """Such a profile plans in memory and was written, and every load then refused the file."""
    path = tmp_path / "p.safetensors"
    good = make_profile()
    good.save(path)
    before = path.read_bytes()
    bad = RoutingProfile(6, 2, {**good.layers, layer: dataclasses.replace(good.layer(layer), **change)}, "olmoe")
    refused = rf"routing profile {re.escape(repr(str(path)))} not written: RoutingProfile.load would refuse it: {rule}"
    with pytest.raises(ValueError, match=refused):
        bad.save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("expert_counts", (7,), r"has shape \[7\], expected \[E\] = \[6\]"),
        ("coactivation", (6, 5), r"has shape \[6, 5\], expected \[E, E\] = \[6, 6\]"),
        ("coactivation", (6,), r"has shape \[6\], expected \[E, E\] = \[6, 6\]"),
        ("topk_sample", (30,), r"has shape \[30\], expected \[N, k\] = \[N, 2\]"),
    ],
)
def test_load_names_a_misshapen_tensor_before_its_counts(tmp_path, name, shape, expected):
    """A count rule ran first and failed in numpy ("operands could not be broadcast", "diag requires an array of at
    least two dimensions"), naming neither the tensor nor the rule."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "p.safetensors"
    make_profile().save(path)
    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        metadata = f.metadata()
    tensors[f"layer.1.{name}"] = np.zeros(shape, dtype=np.int64)
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=rf"tensor 'layer.1.{name}' {expected} \(num_experts=6, top_k=2 in the header\)"):
        RoutingProfile.load(path)


def test_trace_reader_names_a_profile_given_for_a_trace(tmp_path):
    """numpy read any file that is no zip archive as a pickle: "This file contains pickled (object) data ...
    allow_pickle=", naming neither the file nor what was expected (`occult plan-cluster --case M=p.safetensors`)."""
    from occult_hf.profile.trace import read_trace_ids

    profile = tmp_path / "p.safetensors"
    make_profile().save(profile)
    text = tmp_path / "t.npz"
    text.write_text("not an archive")
    a_profile = rf"{re.escape(repr(str(profile)))} is a safetensors file \(a routing profile\?\), not a per-token trace: "
    no_archive = rf"{re.escape(repr(str(text)))} is not an .npz archive \(it does not begin as a zip file\); expected 'topk_ids'"
    for read in (RoutingProfile.from_trace, read_trace_ids):
        with pytest.raises(ValueError, match=a_profile + r".* give the .npz trace, holding 'topk_ids'"):
            read(profile)
        with pytest.raises(ValueError, match=no_archive):
            read(text)


def _profile_on_ranks(rank, world_size, documents_per_rank):
    """Each EP rank profiles its own documents through an occult model; returns its expert counts, or its error."""
    import time

    from occult_hf import OccultConfig, apply_occult

    count = documents_per_rank[rank]
    documents = [tiny_batch(batch=1, seq=12, seed=10 * rank + i)[0].tolist() for i in range(count if count != "bad" else 0)]
    if count == "bad":
        documents = [[1, 2, 3], [-5, 6]]  # the second document holds a token id outside the vocabulary
    model = apply_occult(tiny_model("olmoe", seed=4), OccultConfig())
    start = time.monotonic()
    try:
        profile = RoutingProfile.collect(model, documents, batch_size=1, progress=False)
    except (ValueError, RuntimeError) as error:  # RuntimeError: the EP agreement's EPConfigMismatchError
        return {"error": str(error), "seconds": time.monotonic() - start}
    expected = RoutingProfile.collect(tiny_model("olmoe", seed=4), documents, batch_size=1, progress=False)
    return {"same as one process": all(
        np.array_equal(profile.layer(layer).expert_counts, expected.layer(layer).expert_counts) for layer in MOE_LAYERS["olmoe"]
    )}  # fmt: skip


@pytest.mark.world_size(2)
def test_collect_under_expert_parallelism_keeps_the_ranks_together():
    """Every forward is collective under EP: with the same number of batches each rank profiles its own documents,
    and ranks whose data runs out at different batches fail together at once. Before, the rank with more data waited
    out the exchange timeout in a forward no peer joined, and the other returned a profile without a word."""
    from distributed import run_world

    env = {"OCCULT_EXCHANGE_TIMEOUT_S": "20"}
    assert run_world(_profile_on_ranks, 2, (2, 2), env=env, timeout_s=300) == [{"same as one process": True}] * 2
    for rank, outcome in enumerate(run_world(_profile_on_ranks, 2, (3, 1), env=env, timeout_s=300)):
        assert "ranks [1] have no data after 1 batches while the others have more" in outcome.get("error", ""), (rank, outcome)
        assert outcome["seconds"] < 10, outcome
    # a rank whose own data fails tells the other, which stops at once naming it
    rank0, rank1 = run_world(_profile_on_ranks, 2, (3, "bad"), env=env, timeout_s=300)
    assert "token id -5" in rank1["error"] and rank1["seconds"] < 10, rank1
    assert "rank 1 of the expert-parallel group failed at collect_routing's next batch" in rank0["error"], rank0
    assert rank0["seconds"] < 10, rank0
