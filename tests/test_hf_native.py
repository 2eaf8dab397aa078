"""The paths a Hugging Face user takes, end to end (issue 13).

- `OccultConfig` serialises like transformers' own configs and sits on the HF config as JSON-native
  data: `from_pretrained(saved_dir, occult_config=OccultConfig(...))` through the Auto class works
  with transformers' info logging on (it used to fail JSON-dumping the object in the "Model config"
  log line), and the loaded model's config dumps and saves.
"""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import tiny_batch, tiny_model


@pytest.fixture
def info_logging():
    """transformers' verbosity at INFO for the test (its config loading logs the whole config)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    yield
    hf_logging.set_verbosity(before)


def test_occult_config_serialises_like_hf_configs():
    from occult_hf import OccultConfig, Placement

    placement = Placement.contiguous(num_experts=8, num_devices=2, layers=range(16))
    config = OccultConfig(placement=placement, prune="router", max_devices_per_token=1)
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data  # JSON-native
    assert data["placement"]["layers"]["15"] == placement.device_of(15)
    assert OccultConfig.from_dict(data) == config and dict(config) == data
    assert json.loads(config.to_json_string()) == data
    assert json.loads(config.to_json_string(use_diff=True)) == {
        "placement": placement.to_dict(), "prune": "router", "max_devices_per_token": 1,
    }  # fmt: skip
    text = repr(config)
    assert text.startswith("OccultConfig {") and "num_experts=8 num_devices=2 layers=16 [0..15]" in text
    assert len(text) < 400  # a summary, not 16 x 8 device ids


def test_from_pretrained_with_an_occult_config_object_and_info_logging(tmp_path, info_logging):
    from transformers import AutoConfig, AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult, occult_config_of

    saved = tmp_path / "saved"
    apply_occult(tiny_model("olmoe", seed=2), OccultConfig(num_devices=2)).save_pretrained(saved)
    wanted = OccultConfig(num_devices=4, prune="router", max_devices_per_token=2)
    model = AutoModelForCausalLM.from_pretrained(saved, occult_config=wanted)
    assert occult_config_of(model).num_devices == 4 and occult_config_of(model).max_devices_per_token == 2
    assert isinstance(model.config.occult_config, dict)
    assert json.loads(model.config.to_json_string())["occult_config"]["num_devices"] == 4
    model.save_pretrained(tmp_path / "again")
    assert AutoConfig.from_pretrained(tmp_path / "again").occult_config["prune"] == "router"
    with torch.no_grad():
        assert torch.isfinite(model(tiny_batch()).logits).all()
