"""Validation of routing profiles against damaged or foreign inputs (QA report qa_prof.md D4, D5, D6, D7, D10):
a profile file's logit Gram matrix, its model type against the model's and in its header, a pair-count trace's
count arrays, and the ids `LayerAccumulator.update` counts. Each refusal names the file (or input) and the rule."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from tiny_models import FAMILIES, tiny_batch, tiny_model

from occult_hf.profile import LayerAccumulator, ProfileCollector, RoutingProfile
from occult_hf.profile.routing_profile import PROFILE_METADATA_KEY


# ----- helpers ---------------------------------------------------------------------------------
def collected_profile(family: str = "olmoe", seed: int = 1) -> RoutingProfile:
    """A profile the collector makes of a tiny model over two forwards of a batch with right and left padding."""
    model = tiny_model(family, seed=seed)
    ids_BS = tiny_batch(batch=3, seq=12, seed=5)
    mask_BS = torch.ones_like(ids_BS)
    mask_BS[1, 7:] = 0
    mask_BS[2, :4] = 0
    with ProfileCollector(model, sample_size=16) as collector, torch.no_grad():
        model(input_ids=ids_BS, attention_mask=mask_BS)
        model(input_ids=ids_BS.flip(0), attention_mask=mask_BS.flip(0))
    return RoutingProfile.from_collector(collector, source="test")


@pytest.fixture(scope="module")
def olmoe_profile_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "olmoe.safetensors"
    collected_profile().save(path)
    return path


def rewritten(source, target, tensors=None, header=None):
    """`source` written to `target` with some tensors replaced (`tensors(dict)` edits them) or its header edited."""
    with safe_open(str(source), "np") as f:
        metadata, arrays = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    if tensors is not None:
        tensors(arrays)
    if header is not None:
        fields = json.loads(metadata[PROFILE_METADATA_KEY])
        header(fields)
        metadata[PROFILE_METADATA_KEY] = json.dumps(fields)
    save_file(arrays, str(target), metadata=metadata)
    return target


def with_gram(edit):
    """A tensor edit that applies `edit(gram)` to a copy of layer 0's logit Gram matrix."""

    def apply(arrays):
        gram = arrays["layer.0.logit_gram"].copy()
        edit(gram)
        arrays["layer.0.logit_gram"] = gram

    return apply


def pair_count_file(path, coact, freq, top_k=2, **arrays):
    np.savez(path, coact=coact, freq=freq, meta=np.array(json.dumps({"top_k": top_k})), **arrays)
    return path


def pair_counts(num_experts=4, top_k=2, tokens=100, seed=0):
    """`(coact [1, E, E], freq [1, E])` int64 counts of `tokens` random top-k sets."""
    generator = np.random.default_rng(seed)
    coact, freq = np.zeros((num_experts, num_experts), dtype=np.int64), np.zeros(num_experts, dtype=np.int64)
    for _ in range(tokens):
        experts = generator.permutation(num_experts)[:top_k]
        freq[experts] += 1
        for i in experts:
            for j in experts:
                coact[i, j] += i != j
    return coact[None], freq[None]


# ----- D4: the logit Gram matrix of a profile file --------------------------------------------
def test_load_refuses_an_asymmetric_logit_gram(olmoe_profile_file, tmp_path):
    def damage(gram):
        gram[0, 1], gram[1, 0] = 1e300, -1e300

    path = rewritten(olmoe_profile_file, tmp_path / "asym.safetensors", tensors=with_gram(damage))
    with pytest.raises(ValueError, match=rf"routing profile {re.escape(repr(str(path)))}: tensor 'layer.0.logit_gram' is not symmetric"):
        RoutingProfile.load(path)


def test_load_refuses_a_negative_gram_diagonal(olmoe_profile_file, tmp_path):
    path = rewritten(olmoe_profile_file, tmp_path / "negdiag.safetensors", tensors=with_gram(lambda g: g.__setitem__((0, 0), -5.0)))
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(path)))}: tensor 'layer.0.logit_gram' has a negative diagonal entry \(\[0, 0\]"):
        RoutingProfile.load(path)


def test_save_refuses_a_profile_whose_gram_load_would_refuse(tmp_path):
    profile = collected_profile()
    profile.layer(0).logit_gram[2, 3] += profile.layer(0).logit_gram[2, 2]
    path = tmp_path / "p.safetensors"
    with pytest.raises(ValueError, match=r"not written: RoutingProfile.load would refuse it: tensor 'layer.0.logit_gram' is not symmetric"):
        profile.save(path)
    assert not path.exists()


def test_gram_asymmetric_only_to_rounding_loads(olmoe_profile_file, tmp_path):
    """A float64 matmul (cuBLAS blocking) or a merge may sum G[i, j] and G[j, i] in different orders: off by rounding."""

    def round_off(gram):
        gram[0, 1] += 1e-12 * np.sqrt(gram[0, 0] * gram[1, 1])

    path = rewritten(olmoe_profile_file, tmp_path / "rounding.safetensors", tensors=with_gram(round_off))
    loaded = RoutingProfile.load(path)
    assert loaded.layer(0).logit_gram[0, 1] != loaded.layer(0).logit_gram[1, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_profile_the_collector_writes_loads(family, tmp_path):
    profile = collected_profile(family)
    merged = RoutingProfile.merge([profile, collected_profile(family, seed=2)])
    for name, made in (("one", profile), ("merged", merged)):
        made.save(tmp_path / f"{name}.safetensors")
        loaded = RoutingProfile.load(tmp_path / f"{name}.safetensors")
        for layer, routing in made.layers.items():
            np.testing.assert_array_equal(loaded.layer(layer).logit_gram, routing.logit_gram)


# ----- D7: the model type ------------------------------------------------------------------------
def test_load_with_a_model_of_another_type_is_refused(olmoe_profile_file):
    qwen = tiny_model("qwen3_moe", seed=1)
    with pytest.raises(ValueError, match=r"is of model_type 'olmoe' but the model is of model_type 'qwen3_moe'"):
        RoutingProfile.load(olmoe_profile_file, model=qwen)
    with pytest.raises(ValueError, match=rf"routing profile {re.escape(repr(str(olmoe_profile_file)))} is of model_type 'olmoe'"):
        RoutingProfile.load(olmoe_profile_file).check_compatible(qwen.config)


def test_profile_without_a_model_type_is_checked_on_shape_alone(olmoe_profile_file, tmp_path):
    path = rewritten(olmoe_profile_file, tmp_path / "untyped.safetensors", header=lambda h: h.update(model_type=None))
    RoutingProfile.load(path, model=tiny_model("qwen3_moe", seed=1))  # same E, k and MoE layers
    RoutingProfile.load(olmoe_profile_file, model=tiny_model("olmoe", seed=3))


def test_load_refuses_an_unknown_model_type_in_the_header_as_from_trace_does(olmoe_profile_file, tmp_path):
    path = rewritten(olmoe_profile_file, tmp_path / "llama.safetensors", header=lambda h: h.update(model_type="llama"))
    with pytest.raises(ValueError) as from_trace:
        RoutingProfile.from_trace(pair_count_file(tmp_path / "t.npz", *pair_counts()), model_type="llama")
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(path)))}: header 'model_type': ") as loaded:
        RoutingProfile.load(path)
    assert str(from_trace.value) in str(loaded.value)


# ----- D5, D6: pair-count traces -------------------------------------------------------------
def _float_counts(factor, shift):
    coact, freq = pair_counts()
    return coact * factor + shift * (1 - np.eye(4)), freq * factor + shift


@pytest.mark.parametrize(
    "arrays, message",
    [
        (_float_counts(1.0, 0.4), r"'coact' of layer 0 must hold integer counts, got float64 with fractions \(first: \d+\.4 at \[0, 1\]\)"),
        (_float_counts(0.01, 0.0), r"'coact' of layer 0 must hold integer counts, got float64 with fractions"),
        ((np.full((1, 4, 4), np.nan), np.full((1, 4), np.nan)), r"'coact' of layer 0 holds NaN or infinite values"),
        ((pair_counts()[0], np.full((1, 4), np.inf)), r"'freq' of layer 0 holds NaN or infinite values"),
        ((pair_counts()[0].astype(bool), pair_counts()[1]), r"'coact' of layer 0 must hold integer counts, got dtype bool"),
    ],
    ids=["fractions", "normalised", "nan", "inf", "bool"],
)
def test_pair_counts_must_be_whole_numbers(arrays, message, tmp_path):
    path = pair_count_file(tmp_path / "counts.npz", *arrays)
    with pytest.raises(ValueError, match=rf"pair-count trace {re.escape(repr(str(path)))}: {message}"):
        RoutingProfile.from_trace(path)


def test_pair_counts_saved_as_whole_floats_read_as_counts(tmp_path):
    coact, freq = pair_counts()
    exact = RoutingProfile.from_trace(pair_count_file(tmp_path / "int.npz", coact, freq))
    floats = RoutingProfile.from_trace(pair_count_file(tmp_path / "float.npz", coact.astype(np.float32), freq.astype(float)))
    for name in ("coactivation", "expert_counts"):
        counts = getattr(floats.layer(0), name)
        assert counts.dtype == np.int64 and (counts == getattr(exact.layer(0), name)).all()
    assert floats.layer(0).token_count == exact.layer(0).token_count == 100


def test_pair_counts_of_invalid_layers_are_not_read(tmp_path):
    """Layers marked False in `layer_valid` are broken by the file's own account; only valid ones are held to the rules."""
    coact, freq = pair_counts()
    coact, freq = np.concatenate([coact, np.full_like(coact, -1)]), np.concatenate([freq, np.full_like(freq, -1)])
    profile = RoutingProfile.from_trace(pair_count_file(tmp_path / "v.npz", coact, freq, layer_valid=np.array([True, False])))
    assert sorted(profile.layers) == [0]


@pytest.mark.parametrize(
    "coact, freq, top_k, message",
    [
        ([[[0, 0, 2], [0, 0, -1], [2, -1, 0]]], [[2, -1, 1]], 2, r"'coact' of layer 0 holds a negative count \(-1\)"),
        ([[[0, 0, 0]] * 3], [[3, -1, 0]], 1, r"'freq' of layer 0 holds a negative count \(-1\)"),
    ],
    ids=["coact", "freq"],
)
def test_pair_counts_must_not_be_negative(coact, freq, top_k, message, tmp_path):
    path = pair_count_file(tmp_path / "neg.npz", np.array(coact), np.array(freq), top_k=top_k)
    with pytest.raises(ValueError, match=rf"pair-count trace {re.escape(repr(str(path)))}: {message}"):
        RoutingProfile.from_trace(path)


def test_pair_counts_are_held_to_the_profile_files_count_rules(tmp_path):
    """The trace reader applies the loader's own count rules (`check_layer_counts`), naming the file: these counts
    are symmetric, non-negative, rows summing to freq * (k - 1) and a whole number of tokens (4), yet expert 0 is
    counted 5 times: more tokens than exist."""
    coact = np.array([[[0, 4, 3, 3], [4, 0, 1, 1], [3, 1, 0, 0], [3, 1, 0, 0]]])
    path = pair_count_file(tmp_path / "many.npz", coact, np.array([[5, 3, 2, 2]]), top_k=3)
    with pytest.raises(ValueError, match=rf"pair-count trace {re.escape(repr(str(path)))}: layer 0: a count exceeds token_count=4"):
        RoutingProfile.from_trace(path)


# ----- D10: the ids LayerAccumulator.update counts ---------------------------------------------
@pytest.mark.parametrize(
    "ids, message",
    [
        ([[3, 3]], r"topk_ids repeats an expert within a token's top-k \(1 rows; first: row 0 = \[3, 3\]\)"),
        ([[0, 1], [5, 2], [4, 4]], r"first: row 2 = \[4, 4\]"),
        ([[0, 8]], r"topk_ids holds expert ids in \[0, 8\]; they must lie in \[0, num_experts=8\)"),
        ([[0, -1]], r"topk_ids holds expert ids in \[-1, 0\]; they must lie in \[0, num_experts=8\)"),
    ],
    ids=["repeat", "repeat-later-row", "past-E", "negative"],
)
def test_accumulator_refuses_ids_that_are_no_top_k_set(ids, message):
    accumulator = LayerAccumulator(8, 2)
    with pytest.raises(ValueError, match=message):
        accumulator.update(torch.tensor(ids))
    assert accumulator.token_count == 0 and not accumulator.expert_counts().any(), "nothing of the batch is counted"


def test_accumulator_checks_masked_out_rows_too():
    """Row numbers in the error are those of the caller's tensor, so the check runs before padding is dropped."""
    with pytest.raises(ValueError, match=r"first: row 1 = \[2, 2\]"):
        LayerAccumulator(8, 2).update(torch.tensor([[0, 1], [2, 2]]), token_mask_T=torch.tensor([True, False]))
