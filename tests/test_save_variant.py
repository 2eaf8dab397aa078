"""`save_pretrained(variant=...)` of an occult model, one file and sharded: the files stock transformers writes for that
variant (`model.fp16.safetensors`, or `model.fp16-0000k-of-0000n.safetensors` and `model.safetensors.index.fp16.json`),
which `from_pretrained(..., variant=...)` loads back; a plain save and a variant save share a directory, as in Hub
repositories. The save raised a bare `StopIteration` and wrote nothing: its publishing step knew only the plain names."""

from __future__ import annotations

import pytest
import torch
import transformers

from tiny_models import tiny_batch, tiny_checkpoint

from occult_hf import OccultConfig, occult_config_of


@pytest.mark.parametrize("shard", [None, "50KB"], ids=["one file", "sharded"])
def test_a_variant_save_loads_back_beside_the_plain_one(tmp_path, shard):
    checkpoint = tiny_checkpoint("olmoe", tmp_path / "checkpoint")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, occult_config=OccultConfig(num_devices=2))
    stock = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    sizes = {} if shard is None else {"max_shard_size": shard}
    stock.save_pretrained(tmp_path / "stock", variant="fp16", **sizes)
    saved = tmp_path / "saved"
    for variant in (None, "fp16", None):  # each save leaves the other variant's files alone
        model.save_pretrained(saved, variant=variant, **sizes)
    variant_files = lambda directory: sorted(p.name for p in directory.iterdir() if "fp16" in p.name)  # noqa: E731
    assert len(variant_files(saved)) == len(variant_files(tmp_path / "stock")) > 0
    assert (saved / ("model.safetensors" if shard is None else "model.safetensors.index.json")).is_file()

    ids = tiny_batch(seed=2)
    with torch.no_grad():
        expected = model(ids).logits
        for variant in ("fp16", None):
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, variant=variant)
            assert occult_config_of(reloaded).num_devices == 2 and torch.equal(reloaded(ids).logits, expected), variant
