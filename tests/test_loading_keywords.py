"""`from_pretrained` keywords a transformers user passes, on checkpoints with and without a stored `occult_config`.

- importing occult_hf must not change what transformers returns (`output_loading_info=True`: a `(model, info)` tuple),
  for any model;
- the forms of `occult_config=` the docs accept (a path, a dict holding a `Path` or a `Placement`) also work on a
  checkpoint that stores a config (the Auto classes hand the keyword to the config, which transformers JSON-dumps);
- a given config replaces the stored one whole, and says so;
- `subfolder=`: a stored config's relative files are the subfolder's, never the working directory's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from occult_logs import occult_records
from tiny_models import tiny_batch, tiny_checkpoint, tiny_model


@pytest.fixture(autouse=True)
def _installed():
    from occult_hf.hf.apply import install

    install()


@pytest.mark.parametrize("occult_config", [None, {"num_devices": 2}])
def test_output_loading_info_returns_the_model_and_its_info(tmp_path, occult_config):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from occult_hf.hf.state import STATE_ATTR

    loaded, info = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("olmoe", tmp_path / "olmoe"), occult_config=occult_config, output_loading_info=True
    )
    assert set(info) >= {"missing_keys", "unexpected_keys"} and not info["missing_keys"]
    assert (STATE_ATTR in vars(loaded)) == (occult_config is not None)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    llama.save_pretrained(tmp_path / "llama")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", output_loading_info=True)
    assert isinstance(model, LlamaForCausalLM) and not info["missing_keys"]


def test_path_forms_of_occult_config_load_a_checkpoint_that_stores_one(tmp_path):
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, Placement, apply_occult, occult_config_of

    apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=2)).save_pretrained(tmp_path / "saved")
    placement = Placement.load(tmp_path / "saved" / "occult_placement.json")
    OccultConfig(num_devices=2, dispatch="per_expert").save(tmp_path / "occult.json")
    ids = tiny_batch(seed=2)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", occult_config=None)(ids).logits
    for given in (Path(tmp_path / "occult.json"), {"placement": placement}, {"placement": tmp_path / "saved" / "occult_placement.json"}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", occult_config=given)
        assert occult_config_of(model).num_devices == 2, given
        assert torch.allclose(model(ids).logits, want, atol=1e-5), given


def test_a_given_config_replacing_the_stored_one_is_said(tmp_path):
    from transformers import AutoModelForCausalLM, OlmoeForCausalLM

    from occult_hf import OccultConfig, apply_occult, occult_config_of

    config = OccultConfig(num_devices=2, prune="router", max_devices_per_token=1)
    apply_occult(tiny_model("olmoe", seed=1), config).save_pretrained(tmp_path)
    with occult_records() as records:
        AutoModelForCausalLM.from_pretrained(tmp_path)  # the stored config: nothing to say
    assert not [r for r in records if "replaces" in r.getMessage()]
    for load in (AutoModelForCausalLM.from_pretrained, OlmoeForCausalLM.from_pretrained):  # to the config, to the model
        with occult_records() as records:
            model = load(tmp_path, occult_config={"num_devices": 2})
        assert occult_config_of(model).prune is None  # replaced whole: the stored pruning is off
        (message,) = [r.getMessage() for r in records if "replaces" in r.getMessage()]
        assert "replaces the occult_config the checkpoint stores, whole" in message and "'prune': 'router'" in message


def test_a_stored_profile_is_read_from_the_subfolder(tmp_path, monkeypatch):
    """A similarity-pruned checkpoint in `repo/sub`, loaded with `subfolder="sub"` from a working directory that holds
    another `occult_profile.safetensors`: the checkpoint's own profile, the saved model's logits."""
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, RoutingProfile, apply_occult, occult_config_of

    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    RoutingProfile.collect(tiny_model("olmoe", seed=4), documents, progress=False).save(tmp_path / "p.safetensors")
    config = OccultConfig(num_devices=4, prune="similarity", max_devices_per_token=1, profile=str(tmp_path / "p.safetensors"))
    model = apply_occult(tiny_model("olmoe", seed=4), config)
    model.save_pretrained(tmp_path / "repo" / "sub")
    want = model(tiny_batch(seed=3)).logits
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = [tiny_batch(batch=1, seq=32, seed=50 + s)[0].tolist() for s in range(4)]
    RoutingProfile.collect(tiny_model("olmoe", seed=9), other, progress=False).save(elsewhere / "occult_profile.safetensors")
    monkeypatch.chdir(elsewhere)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub")
    assert occult_config_of(loaded).profile == str(tmp_path / "repo" / "sub" / "occult_profile.safetensors")
    assert torch.allclose(loaded(tiny_batch(seed=3)).logits, want, atol=1e-6)
