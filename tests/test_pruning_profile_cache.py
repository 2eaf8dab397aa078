"""A routing profile loaded for pruning is read once per file, but no caller's changes reach another caller.

`load_pruning_profile` caches the file's contents; a model keeps the profile its pruners were built from (and bundles
it into its checkpoints). Changing that object in place (an array, the layers dict) must not change what the next
model loaded from the same file is pruned with.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import MOE_LAYERS, tiny_batch, tiny_model

from occult_hf.config import OccultConfig
from occult_hf.hf.apply import apply_occult
from occult_hf.hf.state import state_of
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile
from occult_hf.pruning import load_pruning_profile, pruners_of

NUM_EXPERTS, TOP_K, NUM_DEVICES = 16, 4, 4
SIZES = dict(num_experts=NUM_EXPERTS, top_k=TOP_K)


def assert_same(profile: RoutingProfile, expected: RoutingProfile) -> None:
    assert (profile.num_experts, profile.top_k, profile.model_type, profile.meta) == (
        expected.num_experts, expected.top_k, expected.model_type, expected.meta,
    )  # fmt: skip
    assert sorted(profile.layers) == sorted(expected.layers)
    for layer, routing in expected.layers.items():
        for name, value in vars(routing).items():
            np.testing.assert_array_equal(getattr(profile.layers[layer], name), value, err_msg=f"layer {layer} {name}")


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> str:
    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    profile = RoutingProfile.collect(tiny_model("olmoe", **SIZES), documents, progress=False)
    path = tmp_path_factory.mktemp("profiles") / "olmoe.safetensors"
    profile.save(path)
    return str(path)


def test_changing_a_loaded_profile_leaves_the_next_load_alone(profile_path):
    on_file = RoutingProfile.load(profile_path)
    first = load_pruning_profile(profile_path)
    layer = sorted(first.layers)[0]
    first.layers[layer].logit_gram[:] = 0.0
    first.layers[layer].expert_counts += 1
    del first.layers[sorted(first.layers)[-1]]
    first.meta["source"] = "changed"

    second = load_pruning_profile(profile_path)
    assert_same(second, on_file)
    np.testing.assert_array_equal(second.similarity(layer), on_file.similarity(layer))


def test_a_models_profile_is_its_own(profile_path):
    order = list(range(NUM_EXPERTS))
    random.Random(7).shuffle(order)
    device_of_E = [0] * NUM_EXPERTS
    for position, expert in enumerate(order):
        device_of_E[expert] = position * NUM_DEVICES // NUM_EXPERTS
    layers = MOE_LAYERS["olmoe"]
    config = OccultConfig(
        placement=Placement(NUM_EXPERTS, NUM_DEVICES, {layer: list(device_of_E) for layer in layers}),
        prune="similarity", max_devices_per_token=1, profile=profile_path,
    )  # fmt: skip
    first = apply_occult(tiny_model("olmoe", **SIZES), config)
    shared = state_of(first).pruning_profile
    shared.layers[layers[0]].logit_gram[:] = np.eye(NUM_EXPERTS)

    second = apply_occult(tiny_model("olmoe", **SIZES), config)
    assert_same(state_of(second).pruning_profile, RoutingProfile.load(profile_path))
    for layer, pruner in pruners_of(second).items():
        expected = RoutingProfile.load(profile_path).similarity(layer)
        np.testing.assert_allclose(pruner.similarity_EE.numpy(), expected, rtol=1e-6)
