"""OccultConfig validation and JSON round trip."""

import json

import pytest

from occult_hf import OccultConfig, Placement


def test_json_round_trip_with_inline_placement(tmp_path):
    placement = Placement.contiguous(num_experts=6, num_devices=4, layers=[0, 2])
    config = OccultConfig(placement=placement, prune="router", max_devices_per_token=2, dispatch="per_expert")
    path = tmp_path / "occult.json"
    config.save(path)
    loaded = OccultConfig.coerce(str(path))
    assert loaded == config
    assert isinstance(loaded.placement, Placement) and loaded.placement.capacities(2) == [2, 1, 2, 1]
    assert OccultConfig.coerce(json.loads(path.read_text())) == config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_devices": 0}, "num_devices must be a positive integer"),
        ({"prune": "router", "max_devices_per_token": 0}, "must be an integer >= 1"),
        ({"prune": "router", "max_devices_per_token": 5, "num_devices": 4}, "cannot exceed num_devices (4)"),
        ({"prune": "router"}, "needs max_devices_per_token"),
        ({"max_devices_per_token": 2}, "prune is None"),
        ({"prune": "similarity", "max_devices_per_token": 1}, "needs a routing profile"),
        ({"prune": "random", "max_devices_per_token": 1}, "OccultConfig.prune must be one of"),
        ({"dispatch": "all"}, "OccultConfig.dispatch must be one of"),
        ({"expert_backend": "cuda"}, "OccultConfig.expert_backend must be one of"),
        ({"placement": Placement.contiguous(8, 2, [0]), "num_devices": 4}, "does not match the placement"),
    ],
)
def test_bad_settings_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OccultConfig(**kwargs)


def test_unknown_keys_and_missing_file_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['n_d'\\]"):
        OccultConfig.from_dict({"n_d": 2})
    with pytest.raises(FileNotFoundError, match="is not a file"):
        OccultConfig.coerce(str(tmp_path / "absent.json"))


def test_a_misspelt_key_gets_the_nearest_valid_name():
    """Through every door a key comes in: the constructor, a dict (from_pretrained(occult_config={...})),
    a JSON file; a key with no near valid name lists the valid keys only."""
    with pytest.raises(TypeError, match=r"OccultConfig got unknown keys \['num_device'\] \(did you mean 'num_devices'\?\)"):
        OccultConfig(num_device=2)
    with pytest.raises(ValueError, match=r"\['max_device_per_token'\] \(did you mean 'max_devices_per_token'\?\)"):
        OccultConfig.coerce({"max_device_per_token": 1, "prune": "router"})
    with pytest.raises(ValueError, match=r"unknown keys \['zzz'\]; valid keys are \['deterministic'"):
        OccultConfig.from_dict({"zzz": 1})
    assert OccultConfig(num_devices=2) == OccultConfig.coerce({"num_devices": 2})  # the constructor still works


def test_placement_validation_errors():
    with pytest.raises(ValueError, match="maps 3 experts, expected num_experts=4"):
        Placement(4, 2, {0: [0, 1, 0]})
    with pytest.raises(ValueError, match="outside \\[0, 2\\)"):
        Placement(4, 2, {0: [0, 1, 2, 0]})
    placement = Placement.contiguous(8, 4, [1, 3])
    with pytest.raises(ValueError, match="num_experts=8 but the model has 6"):
        placement.validate_for(6, [1, 3])
    with pytest.raises(ValueError, match="lacks MoE layers \\[2\\]"):
        placement.validate_for(8, [1, 2, 3])
    with pytest.raises(ValueError, match="num_devices=4 but the expert-parallel group has 2"):
        placement.validate_for(8, [1], num_devices=2)
    assert placement.local_slot(1) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert placement.experts_on(3, 2) == [4, 5]


def test_the_registries_own_the_names_the_config_accepts():
    """OccultConfig asks the pruning-policy and expert-backend registries: a newly registered name is
    accepted, a policy that reads the similarity table needs a profile, and the registries refuse a
    duplicate or a badly formed name, and suggest the closest name for a misspelt one."""
    from occult_hf import experts, pruning
    from occult_hf.registry import EXPERT_BACKENDS, PRUNING_POLICIES

    with pytest.raises(ValueError, match=r"OccultConfig.prune must be one of \[None, 'router', 'similarity'\], got 'nearest'"):
        OccultConfig(prune="nearest", max_devices_per_token=1)
    pruning.register_pruning_policy("nearest", pruning.prune_similarity, needs_similarity=True)
    experts.register_expert_backend("mine", EXPERT_BACKENDS.get("torch"))
    try:
        with pytest.raises(ValueError, match=r"OccultConfig.prune='nearest' needs a routing profile"):
            OccultConfig(prune="nearest", max_devices_per_token=1)
        assert OccultConfig(prune="nearest", max_devices_per_token=1, profile="p.safetensors").prune == "nearest"
        with pytest.raises(ValueError, match="pruning policy 'router' is already registered"):
            pruning.register_pruning_policy("router", pruning.prune_similarity)
        with pytest.raises(ValueError, match="lowercase"):
            pruning.register_pruning_policy("Router2", pruning.prune_router)
        assert OccultConfig(expert_backend="mine").expert_backend == "mine"
        for name in ("torch", "auto", "Mine"):
            with pytest.raises(ValueError, match="expert backend"):
                experts.register_expert_backend(name, EXPERT_BACKENDS.get("grouped_mm_fused"))
        with pytest.raises(ValueError, match=r"got 'tritn' \(did you mean 'triton'\?\)"):
            OccultConfig(expert_backend="tritn")
    finally:
        PRUNING_POLICIES.unregister("nearest")
        EXPERT_BACKENDS.unregister("mine")
    with pytest.raises(ValueError, match="OccultConfig.expert_backend must be one of"):
        OccultConfig(expert_backend="mine")

