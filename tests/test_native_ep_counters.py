"""`occult_modules`, `reset_counters` and `track_routing` on a model that transformers' own EP runs with occult_hf
(`ep_implementation="occult"`), as on one `apply_occult` converted: they raised "does not have occult_hf applied"
there, though `occult_config_of` worked on the same model (2 gloo ranks)."""

from __future__ import annotations

import pytest

from distributed import run_world
from tiny_models import MOE_LAYERS, tiny_batch, tiny_checkpoint


def _counters_world(rank, world_size, checkpoint):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from occult_hf import OccultConfig, occult_modules, reset_counters, track_routing

    config = DistributedConfig(ep_size=world_size, fsdp_size=world_size, ep_implementation="occult")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config, dtype=torch.float32, occult_config=OccultConfig())
    layers = occult_modules(model)
    rows = lambda: [int(layer.stats.sent_D2[:, 0].sum()) for layer in layers.values()]  # noqa: E731
    ids = tiny_batch(seed=rank)
    with torch.no_grad():
        model(ids)
        counted = rows()
        reset_counters(model)
        reset = rows()
        with track_routing(model, False):
            model(ids)
            untracked = rows()
        model(ids)
    return {"paths": list(layers), "counted": counted, "reset": reset, "untracked": untracked, "again": rows(),
            "tracked_after": [layer.track for layer in layers.values()]}  # fmt: skip


@pytest.mark.world_size(2)
def test_counters_and_tracking_of_a_transformers_ep_model(tmp_path):
    checkpoint = str(tiny_checkpoint("olmoe", tmp_path / "olmoe", seed=4))
    for found in run_world(_counters_world, 2, checkpoint, timeout_s=300):
        assert found["paths"] == [f"model.layers.{layer}.mlp" for layer in MOE_LAYERS["olmoe"]], found
        assert all(n > 0 for n in found["counted"]) and found["reset"] == [0] * len(found["paths"]), found
        assert found["untracked"] == found["reset"] and found["again"] == found["counted"], found
        assert all(found["tracked_after"]), found
