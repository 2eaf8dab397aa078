"""A checkpoint saved with collaboration pruning says what it is, and every occult_hf load applies the pruning
(issue 32 item 2).

Plain transformers cannot be warned from outside: it runs the model's unpruned routing, which differs from the
pruned model. So the saved `config.json` holds `occult_pruning` (mode, N_d, devices, placement file) and the
README model card opens with a section saying that plain transformers runs the unpruned routing; loads through
occult_hf (`from_pretrained` with occult_hf imported, `occult eval`'s loader) give the pruned model's logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import tiny_batch, tiny_model


def test_a_pruned_checkpoint_says_so_and_occult_hf_loads_apply_the_pruning(tmp_path):
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult, occult_config_of
    from occult_hf.hf.apply import install

    install()
    ids = tiny_batch(seed=3)
    card = tmp_path / "README.md"
    card.write_text("---\nlicense: apache-2.0\n---\n# my fine-tune\n\nnotes of my own\n")
    pruned = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    pruned.save_pretrained(tmp_path)
    expected = pruned(ids).logits

    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["occult_pruning"]["prune"] == "router" and saved["occult_pruning"]["max_devices_per_token"] == 1
    assert saved["occult_pruning"]["num_devices"] == 4 and saved["occult_pruning"]["placement"] == "occult_placement.json"
    text = card.read_text()
    assert text.startswith("---\nlicense: apache-2.0\n---\n<!-- occult_hf:pruning -->\n**Fine-tuned with collaboration pruning")
    assert "N_d = 1 of 4 devices" in text and "runs the **unpruned** routing" in text and text.endswith("notes of my own\n")

    vanilla = AutoModelForCausalLM.from_pretrained(tmp_path, occult_config=None)  # what plain transformers runs
    assert not torch.allclose(vanilla(ids).logits, expected, atol=1e-4)  # the pruning matters on this model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # occult_hf imported: the stored pruning applies
    assert occult_config_of(loaded).prune == "router" and torch.allclose(loaded(ids).logits, expected, atol=1e-6)

    # loaded without the pruning, the model is not pruned, and its saves must not say it is
    unpruned = AutoModelForCausalLM.from_pretrained(tmp_path, occult_config=OccultConfig(num_devices=4))
    for model, directory in ((vanilla, tmp_path / "vanilla"), (unpruned, tmp_path / "unpruned")):
        assert not hasattr(model.config, "occult_pruning")
        model.save_pretrained(directory)
        assert "occult_pruning" not in json.loads((directory / "config.json").read_text())
        assert not (directory / "README.md").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "unpruned").config.occult_config["prune"] is None

    exact = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(num_devices=4))
    exact.save_pretrained(tmp_path)  # the same directory saved exact: the card and config say nothing of pruning
    assert card.read_text() == "---\nlicense: apache-2.0\n---\n# my fine-tune\n\nnotes of my own\n"
    assert "occult_pruning" not in json.loads((tmp_path / "config.json").read_text())


def test_occult_eval_loads_a_pruned_checkpoint_pruned(tmp_path):
    pytest.importorskip("lm_eval")
    from occult_hf import OccultConfig, apply_occult, occult_config_of
    from occult_hf.eval.model import load_occult_model

    apply_occult(tiny_model("olmoe", seed=4), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1)).save_pretrained(tmp_path)
    model = load_occult_model(str(tmp_path), None, device=torch.device("cpu"), dtype="float32")
    assert occult_config_of(model).prune == "router" and occult_config_of(model).max_devices_per_token == 1


def test_a_similarity_pruned_checkpoint_holds_its_profile(tmp_path, monkeypatch):
    """The profile similarity pruning needs is saved inside the checkpoint and named relative to it: the checkpoint
    loads from anywhere, after the original profile is gone."""
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, RoutingProfile, apply_occult, occult_config_of
    from occult_hf.hf.apply import install

    install()
    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    profile = tmp_path / "elsewhere" / "profile.safetensors"
    profile.parent.mkdir()
    RoutingProfile.collect(tiny_model("olmoe", seed=4), documents, progress=False).save(profile)
    config = OccultConfig(num_devices=4, prune="similarity", max_devices_per_token=1, profile=str(profile))
    model = apply_occult(tiny_model("olmoe", seed=4), config)
    model.save_pretrained(tmp_path / "checkpoint")
    expected = model(tiny_batch(seed=3)).logits
    assert json.loads((tmp_path / "checkpoint" / "config.json").read_text())["occult_config"]["profile"] == "occult_profile.safetensors"
    profile.unlink()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert occult_config_of(loaded).profile == str(tmp_path / "checkpoint" / "occult_profile.safetensors")
    assert torch.allclose(loaded(tiny_batch(seed=3)).logits, expected, atol=1e-6)

    # the profile a model was built from is saved from memory: its file may be gone by the next save (a checkpoint
    # rotated away under a run that resumed from it)
    model.save_pretrained(tmp_path / "saved_after_the_profile_went")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved_after_the_profile_went")
    assert torch.allclose(again(tiny_batch(seed=3)).logits, expected, atol=1e-6)


def test_a_node_limited_checkpoint_states_its_node_limit(tmp_path):
    """Node-limited pruning alone (N_n, no N_d): the card and `occult_pruning` name the node limit and layout."""
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult, occult_config_of
    from occult_hf.hf.apply import install

    install()
    config = OccultConfig(num_devices=4, devices_per_node=2, prune="router", max_nodes_per_token=1)
    pruned = apply_occult(tiny_model("olmoe", seed=4), config)
    pruned.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["occult_pruning"]
    assert (saved["max_nodes_per_token"], saved["devices_per_node"], saved["max_devices_per_token"]) == (1, 2, None)
    assert "limited to N_n = 1 of 2 nodes (2 devices each) (`prune='router'`" in (tmp_path / "README.md").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert occult_config_of(loaded).max_nodes_per_token == 1
    assert torch.allclose(loaded(tiny_batch(seed=3)).logits, pruned(tiny_batch(seed=3)).logits, atol=1e-6)
