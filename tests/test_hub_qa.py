"""Pushes of occult models to the Hub, and the model card they carry, checked against a Hub kept in memory.

`MemoryHub` answers transformers' Hub calls (`hf_api()` and `ModelCard.load`) with a repository of branches and
files, and checks each call's keywords against huggingface_hub's own `HfApi` signatures, so a keyword the real
client would refuse fails here too. The card's YAML front matter is read back with huggingface_hub's `ModelCard`,
the parser the Hub's clients use.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from memory_hub import MemoryHub
from tiny_models import tiny_batch, tiny_model


@pytest.fixture
def hub(monkeypatch) -> MemoryHub:
    import transformers.utils.hub as transformers_hub

    memory = MemoryHub()
    monkeypatch.setattr(transformers_hub, "hf_api", lambda: memory)
    from_file = transformers_hub.ModelCard.load.__func__  # a card on disk: read as huggingface_hub reads it

    def load(cls, name, **kwargs):
        return from_file(cls, name, **kwargs) if os.path.isfile(name) else memory.card(name)

    monkeypatch.setattr(transformers_hub.ModelCard, "load", classmethod(load))
    return memory


def _pruned():
    from occult_hf import OccultConfig, apply_occult

    config = OccultConfig(num_devices=4, prune="router", max_devices_per_token=1)
    return apply_occult(tiny_model("olmoe", seed=4), config)


def _files(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.is_file()}


@pytest.mark.parametrize(
    "card",
    ["---\nlicense: mit\n---", "\n---\nlicense: mit\n---\n# mine\n", "---\nlicense: mit\n---  \n# mine\n"],
    ids=["closing-line-ends-the-file", "blank-line-above", "blanks-after-closing-line"],
)
def test_the_cards_metadata_stays_where_the_hub_reads_it(tmp_path, card):
    """A user's card whose front matter huggingface_hub reads (a blank line above it, blanks after the closing `---`,
    or the closing `---` ending the file) got the pruning section above its front matter: the license, tags and
    base model were then body text the Hub no longer read, without a word."""
    from huggingface_hub import ModelCard

    (tmp_path / "README.md").write_text(card)
    _pruned().save_pretrained(tmp_path)
    saved = ModelCard((tmp_path / "README.md").read_text())
    assert saved.data.to_dict() == {"license": "mit"}
    assert saved.text.lstrip().startswith("<!-- occult_hf:pruning -->") and "N_d = 1 of 4 devices" in saved.text


def test_a_push_keeps_the_directorys_card_where_the_hub_has_none(tmp_path, hub):
    """`save_pretrained(dir, push_to_hub=True)` into a directory holding the user's card, to a repository without
    one: transformers' template replaced the card in the directory and on the Hub, and the user's text was lost. The
    Hub's card, where there is one, is still the one pushed."""
    from huggingface_hub import ModelCard

    mine = "---\nlicense: mit\n---\n# My model\n\nmy notes\n"
    for name in ("model", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "README.md").write_text(mine)
    hub.repos["me/other"] = {"main": {"README.md": b"---\nlicense: apache-2.0\n---\n# On the Hub\n"}}
    model = _pruned()
    model.save_pretrained(tmp_path / "model", push_to_hub=True, repo_id="me/model")
    model.save_pretrained(tmp_path / "other", push_to_hub=True, repo_id="me/other")
    pushed = hub.repos["me/model"]["main"]["README.md"].decode()
    assert pushed == (tmp_path / "model" / "README.md").read_text() and pushed.endswith("# My model\n\nmy notes\n")
    assert ModelCard(pushed).data.license == "mit" and "<!-- occult_hf:pruning -->" in pushed
    assert hub.repos["me/other"]["main"]["README.md"].decode().endswith("<!-- /occult_hf:pruning -->\n\n# On the Hub\n")


def test_push_to_hub_uploads_what_save_pretrained_writes(tmp_path, hub):
    """`push_to_hub` uploads the files a save writes, byte for byte (no staging folder), with the Hub's card and the
    pruning section above it; the numbers the card states are the saved config's."""
    model = _pruned()
    model.save_pretrained(tmp_path)
    model.push_to_hub("me/model")
    pushed, saved = hub.repos["me/model"]["main"], _files(tmp_path)
    assert set(pushed) == set(saved) >= {"config.json", "occult_placement.json", "model.safetensors", "README.md"}
    assert all(pushed[name] == saved[name] for name in saved if name != "README.md")
    description = json.loads(pushed["config.json"])["occult_pruning"]
    card = pushed["README.md"].decode()
    limits = f"N_d = {description['max_devices_per_token']} of {description['num_devices']} devices"
    assert limits in card and "library_name: transformers" in card


def test_repeated_pushes_keep_the_hubs_card_and_one_section(hub):
    """A card already on the Hub is kept below the section, and pushing again replaces the section, not adds one."""
    hub.repos["me/model"] = {"main": {"README.md": b"---\nlicense: mit\n---\n# My model\n\nmy notes\n"}}
    model = _pruned()
    for _ in range(3):
        model.push_to_hub("me/model")
    card = hub.repos["me/model"]["main"]["README.md"].decode()
    assert card.count("<!-- occult_hf:pruning -->") == 1 and card.count("<!-- /occult_hf:pruning -->") == 1
    assert card.startswith("---\nlicense: mit\n---\n<!-- occult_hf:pruning -->")
    assert card.endswith("# My model\n\nmy notes\n")


def test_push_keywords_reach_the_hub(tmp_path, hub):
    """`push_to_hub`'s and `save_pretrained(push_to_hub=True)`'s keywords reach the calls transformers makes with
    them: private and token to `create_repo`, revision, commit message and description, create_pr to the commit;
    a variant names the weights uploaded."""
    model = _pruned()
    model.push_to_hub("me/model", revision="dev", commit_message="m", commit_description="d", private=True)
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="me/other", variant="fp16", private=True,
                          create_pr=True, token="t", commit_message="n")  # fmt: skip
    listed = [call for name, call in hub.calls if name == "list_repo_files"]  # the replaced weights' removal
    calls = [(name, call) for name, call in hub.calls if name != "list_repo_files"]
    (_, repo), (_, branch), (_, commit), (_, other_repo), (_, other_commit) = calls
    assert [(call["revision"], call["token"]) for call in listed] == [("dev", None), (None, "t")]
    assert repo["private"] is True and branch["branch"] == "dev"
    assert (commit["revision"], commit["commit_message"], commit["commit_description"]) == ("dev", "m", "d")
    assert "README.md" in hub.repos["me/model"]["dev"]
    assert (other_repo["repo_id"], other_repo["private"], other_repo["token"]) == ("me/other", True, "t")
    assert (other_commit["create_pr"], other_commit["commit_message"], other_commit["token"]) == (True, "n", "t")
    assert "model.fp16.safetensors" in hub.repos["me/other"]["main"]


def test_a_failed_upload_leaves_the_local_save_whole(tmp_path, hub):
    """The upload fails after the save: the error is raised, and the directory holds the new checkpoint, whole."""
    from transformers import AutoModelForCausalLM

    hub.commit_error = RuntimeError("502 Bad Gateway")
    with pytest.raises(RuntimeError, match="502 Bad Gateway"):
        _pruned().save_pretrained(tmp_path / "model", push_to_hub=True)
    assert not [name for name in (tmp_path / "model").iterdir() if name.name.startswith(".occult_save")]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert loaded.config.occult_config["max_devices_per_token"] == 1


def test_a_sharded_push_over_a_single_file_loads_the_new_weights(tmp_path, hub):
    """A push of a sharded save to a repository an earlier push gave one `model.safetensors`: the old file stayed on
    the Hub beside the new index, and transformers, which prefers it, loaded the earlier model from the repository.
    The weight files the new save replaces are removed after the upload; another variant's stay."""
    from transformers import AutoModelForCausalLM

    first, second = _pruned(), _pruned()
    with torch.no_grad():
        for param in second.parameters():
            param.add_(0.01)
        expected = second(tiny_batch(seed=3)).logits
    first.push_to_hub("me/model")
    first.save_pretrained(tmp_path / "fp16", push_to_hub=True, repo_id="me/model", variant="fp16")
    second.push_to_hub("me/model", max_shard_size="200KB")
    files = hub.repos["me/model"]["main"]
    assert "model.safetensors" not in files and "model.fp16.safetensors" in files
    assert "model.safetensors.index.json" in files
    shards = json.loads(files["model.safetensors.index.json"])["weight_map"].values()
    assert len(set(shards)) >= 2 and {name for name in files if "-of-" in name} == set(shards)
    (tmp_path / "hub").mkdir()
    for name, data in files.items():
        (tmp_path / "hub" / name).write_bytes(data)
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hub")(tiny_batch(seed=3)).logits
    assert torch.allclose(loaded, expected, atol=1e-6)
