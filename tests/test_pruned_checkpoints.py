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

from distributed import run_world
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
    assert text.startswith("---\nlicense: apache-2.0\n---\n<!-- occult_hf:pruning -->\n**Saved with collaboration pruning")
    assert "N_d = 1 of 4 devices" in text and "runs the **unpruned** routing" in text and text.endswith("notes of my own\n")

    vanilla = AutoModelForCausalLM.from_pretrained(tmp_path, occult_config=None)  # what plain transformers runs
    assert not torch.allclose(vanilla(ids).logits, expected, atol=1e-4)  # the pruning matters on this model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # occult_hf imported: the stored pruning applies
    assert occult_config_of(loaded).prune == "router" and torch.allclose(loaded(ids).logits, expected, atol=1e-6)
    # an edit of the description alone was ignored without a word (and the next save wrote it back): refused
    (tmp_path / "edited").mkdir()
    for name in ("config.json", "occult_placement.json", "model.safetensors"):
        (tmp_path / "edited" / name).write_bytes((tmp_path / name).read_bytes())
    edited = json.loads((tmp_path / "config.json").read_text())
    edited["occult_pruning"]["max_devices_per_token"] = 2
    (tmp_path / "edited" / "config.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="occult_pruning.max_devices_per_token is 2 but occult_config.max_devices_per_token is 1"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "edited")

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


class _FakeHub:
    """`transformers.utils.hub.hf_api()` without a network: records each commit's files with their contents."""

    def __init__(self) -> None:
        self.commits: list[tuple[str, dict[str, bytes]]] = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for operation in operations:
            with open(operation.path_or_fileobj, "rb") as f:
                files[operation.path_in_repo] = f.read()
        self.commits.append((repo_id, files))

    def list_repo_files(self, repo_id, **kwargs):
        return sorted({name for repo, files in self.commits if repo == repo_id for name in files})


@pytest.fixture
def fake_hub(monkeypatch):
    """The Hub calls of transformers' pushes, answered here; the card transformers writes for a push is a template."""
    return _fake_hub_installed(monkeypatch.setattr)


def _fake_hub_installed(monkeypatch_target) -> _FakeHub:
    import transformers.utils.hub as hub
    from huggingface_hub import ModelCard

    fake = _FakeHub()
    monkeypatch_target(hub, "hf_api", lambda: fake)
    monkeypatch_target(hub, "create_and_tag_model_card", lambda repo_id, tags=None, token=None: ModelCard("# Model Card for Model ID\n"))
    return fake


def _pushed_description(files: dict[str, bytes]) -> tuple[dict | None, str]:
    return json.loads(files["config.json"]).get("occult_pruning"), files["README.md"].decode()


def test_pushes_to_the_hub_carry_the_pruning_description(tmp_path, fake_hub):
    """`save_pretrained(dir, push_to_hub=True)` pushes `dir` under its name with the description (it had pushed the
    staging folder under `.occult_save-<random>`, before the description was written); `push_to_hub` keeps the
    section above the card transformers writes over `README.md` (it had been lost)."""
    from occult_hf import OccultConfig, apply_occult

    pruned = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    pruned.save_pretrained(tmp_path / "my-model", push_to_hub=True, commit_message="first")
    pruned.push_to_hub("me/my-model")
    (first, files), (second, pushed) = fake_hub.commits
    assert first == "my-model" and {"config.json", "README.md", "occult_placement.json", "model.safetensors"} <= set(files)
    assert not any(name.startswith(".occult_save") for name in files)
    for name, uploaded in (("save_pretrained", files), ("push_to_hub", pushed)):
        description, card = _pushed_description(uploaded)
        assert description["max_devices_per_token"] == 1, name
        assert card.startswith("---\n{}\n---\n<!-- occult_hf:pruning -->"), name  # below the card's front matter
        assert card.endswith("<!-- /occult_hf:pruning -->\n\n# Model Card for Model ID\n"), name
    assert second == "me/my-model" and (tmp_path / "my-model" / "README.md").read_text() == pushed["README.md"].decode()


def test_the_trainers_model_card_keeps_the_pruning_section(tmp_path):
    """`Trainer.push_to_hub` saves, writes the Trainer's card over `README.md` (`create_model_card`), and uploads the
    folder: the section goes back above the Trainer's card."""
    from transformers import Trainer, TrainingArguments

    from occult_hf import OccultConfig, apply_occult

    pruned = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    trainer = Trainer(model=pruned, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    trainer.save_model()
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "<!-- occult_hf:pruning -->" in card and "N_d = 1 of 4 devices" in card and "tiny" in card


def _push_on_ranks(rank: int, world_size: int, directory: str) -> list:
    from occult_hf import OccultConfig, apply_occult

    fake = _fake_hub_installed(setattr)
    pruned = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(prune="router", max_devices_per_token=1))
    pruned.push_to_hub("me/ep-model")  # collective, as the save inside it
    pruned.save_pretrained(directory, push_to_hub=True)
    return [(repo_id, sorted(files), _pushed_description(files)[0]) for repo_id, files in fake.commits]


@pytest.mark.world_size(2)
def test_under_ep_the_writing_rank_alone_pushes(tmp_path):
    """Under EP both pushes are collective; EP rank 0, which wrote the files, uploads them (whole, described), and
    rank 1, whose folder holds nothing but transformers' card, uploads nothing."""
    rank0, rank1 = run_world(_push_on_ranks, 2, str(tmp_path / "ep-model"))
    assert rank1 == [] and [repo_id for repo_id, _, _ in rank0] == ["me/ep-model", "ep-model"]
    for _, files, description in rank0:
        assert {"config.json", "README.md", "model.safetensors", "occult_placement.json"} <= set(files)
        assert description["num_devices"] == 2 and description["max_devices_per_token"] == 1
