"""`apply_occult` fails before it changes anything, naming the cause (issues found by a QA pass of loading paths).

- A MoE layer that accelerate's `device_map` offloads (to disk here) has its experts on the meta device: the
  error used to blame a per-rank loading mismatch ("load with from_pretrained(..., occult_config=...) on every
  rank", in one process); it now says the layer is offloaded and what to do, before any block is replaced.
- A layer that fails to build used to leave the earlier layers replaced (and, under EP, their other experts'
  storage released) with no occult state: `unapply_occult` refused the model and a plain save wrote a broken
  checkpoint. Every block is now built before any is swapped in.
- Ranks whose `device_map`s both put the model on the CPU, one read whole and one read per rank, were refused as
  disagreeing on the device type ("cpu" vs the placeholder "meta").
"""

from __future__ import annotations

import time

import pytest
import torch

from distributed import run_world
from tiny_models import tiny_batch, tiny_checkpoint, tiny_model

DISK_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
    "model.layers.0": "cpu", "model.layers.1": "disk",
}  # fmt: skip


def test_an_offloaded_moe_layer_is_named_before_anything_changes(tmp_path):
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult

    path = tiny_checkpoint("olmoe", tmp_path / "checkpoint")
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(
            path, occult_config=OccultConfig(num_devices=2), device_map=DISK_MAP, offload_folder=str(tmp_path / "offload")
        )
    assert time.monotonic() - start < 30
    assert str(error.value).startswith(
        "layer 1 (model.layers.1.mlp): the routed experts are not in memory (on the meta device, offloaded by "
        "accelerate's device_map); occult_hf's blocks compute with the experts' own weights, so the MoE layers must be resident"
    ), str(error.value)
    model = AutoModelForCausalLM.from_pretrained(path, occult_config=None, device_map=DISK_MAP, offload_folder=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match="layer 1 .* offloaded by accelerate's device_map"):
        apply_occult(model, OccultConfig(num_devices=2))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["OlmoeSparseMoeBlock"] * 2


def test_a_layer_that_fails_to_build_leaves_the_model_as_it_was(monkeypatch):
    import occult_hf.hf.apply as apply_module
    from occult_hf import OccultConfig, apply_occult, unapply_occult

    model = tiny_model("olmoe", seed=3)
    ids = tiny_batch(seed=4)
    with torch.no_grad():
        expected = model(ids).logits
    real_build, built = apply_module.build_occult_block, []

    def build_failing_at_layer_1(block, adapter, layout, *args, **kwargs):
        if layout.layer == 1:
            raise RuntimeError("layer 1 cannot be built")
        built.append(layout.layer)
        return real_build(block, adapter, layout, *args, **kwargs)

    monkeypatch.setattr(apply_module, "build_occult_block", build_failing_at_layer_1)
    with pytest.raises(RuntimeError, match="layer 1 cannot be built"):
        apply_occult(model, OccultConfig(num_devices=2))
    assert built == [0]  # layer 0 was built, and then not swapped in
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["OlmoeSparseMoeBlock"] * 2
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    monkeypatch.setattr(apply_module, "build_occult_block", real_build)
    unapply_occult(apply_occult(model, OccultConfig(num_devices=2)))  # the model takes occult_hf again, and back


def _load_with_map(rank, world_size, path):
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig

    device_map = "auto" if rank == 0 else "cpu"  # rank 0 reads every expert, rank 1 its own (per-rank loading)
    model = AutoModelForCausalLM.from_pretrained(path, occult_config=OccultConfig(num_devices=2), device_map=device_map)
    with torch.no_grad():
        return model(tiny_batch(seed=700 + rank)).logits.tolist()


@pytest.mark.world_size(2)
def test_ranks_on_the_cpu_agree_whether_they_read_all_experts_or_their_own(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("olmoe", tmp_path / "checkpoint")
    stock = AutoModelForCausalLM.from_pretrained(path, occult_config=None)
    for rank, logits in enumerate(run_world(_load_with_map, 2, str(path), timeout_s=200)):
        with torch.no_grad():
            assert torch.allclose(torch.tensor(logits), stock(tiny_batch(seed=700 + rank)).logits, atol=1e-5), rank
