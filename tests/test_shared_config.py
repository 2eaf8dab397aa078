"""Models built from one transformers config object (`from_config(config)` twice, as a notebook does) and converted
with different setups: each keeps, saves and reloads its own. The setup lives on `model.config`, which they shared:
the last converted model's setup was every model's, so the first one saved the second one's device count and pruning
beside its own placement file and reloaded as that model (logits 0.077 off), and `unapply_occult` of one took the
setup off the other."""

from __future__ import annotations

import json

import torch
import transformers

from tiny_models import tiny_batch, tiny_config

from occult_hf import OccultConfig, apply_occult, occult_config_of, unapply_occult


def _model(config, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_models_built_from_one_config_keep_their_own_setups(tmp_path):
    config = tiny_config("olmoe")
    first, second, plain = _model(config, 0), _model(config, 1), _model(config, 2)
    assert first.config is second.config is plain.config  # what transformers does: the premise of this test
    apply_occult(first, OccultConfig(num_devices=2))
    apply_occult(second, OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    assert all(module.config is first.config for module in first.modules() if "config" in module.__dict__)
    assert not hasattr(plain.config, "occult_config")

    first.save_pretrained(tmp_path / "first")
    saved = json.loads((tmp_path / "first" / "config.json").read_text())["occult_config"]
    assert (saved["num_devices"], saved["prune"]) == (2, None)
    unapply_occult(second)
    assert first.config.occult_config["num_devices"] == 2

    ids = tiny_batch(seed=3)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "first")
    assert (occult_config_of(reloaded).num_devices, occult_config_of(reloaded).prune) == (2, None)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, first(ids).logits)


def test_a_model_built_from_a_converted_models_config_is_plain_and_saves_plain(tmp_path):
    """`from_config(converted.config)` (same architecture, new weights) builds a plain model: it saved the converted
    model's setup, and its reload ran that setup (pruning: logits 0.088 off the model that was saved)."""
    converted = apply_occult(_model(tiny_config("olmoe"), 0), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    built = _model(converted.config, 1)
    assert not hasattr(built.config, "occult_config") and converted.config.occult_config["num_devices"] == 4
    built.save_pretrained(tmp_path / "built")
    assert "occult_config" not in json.loads((tmp_path / "built" / "config.json").read_text())
    ids = tiny_batch(seed=3)
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "built")(ids).logits, built(ids).logits)
