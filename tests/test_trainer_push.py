"""`Trainer.push_to_hub` and the Trainer's pushes during training (`hub_strategy`) of occult models, checked against a
Hub kept in memory (`memory_hub`).

The Trainer uploads its output folder whole with huggingface_hub's `upload_folder` (skipping `_*` and
`checkpoint-*`), unlike `model.push_to_hub`, which uploads a fresh save; an upload reads the folder as it is when it
is queued.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from memory_hub import MemoryHub
from tiny_models import tiny_batch, tiny_model


@pytest.fixture
def hub(monkeypatch) -> MemoryHub:
    import transformers.trainer as transformers_trainer
    import transformers.utils.hub as transformers_hub

    memory = MemoryHub()
    monkeypatch.setattr(transformers_hub, "hf_api", lambda: memory)
    monkeypatch.setattr(transformers_trainer, "hf_api", lambda: memory)
    return memory


def _pruned(config=None, seed: int = 4):
    from occult_hf import OccultConfig, apply_occult

    config = config or OccultConfig(num_devices=4, prune="router", max_devices_per_token=1)
    return apply_occult(tiny_model("olmoe", seed=seed, output_router_logits=False), config)


def _sharded(model, max_shard_size: str = "200KB"):
    """The model, saved in shards by the Trainer (which passes no `max_shard_size`): a model too large for one file."""
    model.save_pretrained = functools.partial(model.save_pretrained, max_shard_size=max_shard_size)
    return model


def _trainer(model, output_dir, callbacks=(), **arguments):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, learning_rate=0.01, report_to=[], use_cpu=True,
        disable_tqdm=True, hub_model_id="me/model", seed=0, **arguments,
    )  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=8, seq=16, seed=5)]
    return Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def _training(model, output_dir, strategy: str, callbacks=()):
    return _trainer(model, output_dir, callbacks, max_steps=4, save_strategy="steps", save_steps=2, push_to_hub=True,
                    hub_strategy=strategy)  # fmt: skip


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(tiny_batch(seed=3)).logits


def _loaded(hub: MemoryHub, directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return _logits(AutoModelForCausalLM.from_pretrained(hub.download("me/model", directory)))


def test_a_killed_saves_staging_folder_is_not_uploaded(tmp_path, hub):
    """A save killed before its cleanup leaves `.occult_save-*` in the output folder; `Trainer.push_to_hub` uploaded
    it, weights and all, beside the model. The card is the Trainer's, with the pruning section."""
    from huggingface_hub import ModelCard

    (tmp_path / ".occult_save-x1y2z3").mkdir()
    (tmp_path / ".occult_save-x1y2z3" / "model.safetensors").write_bytes(b"half a save")
    _trainer(_pruned(), tmp_path).push_to_hub()
    pushed = hub.repos["me/model"]["main"]
    assert not [name for name in pushed if name.startswith(".occult_save")]
    assert {"config.json", "model.safetensors", "occult_placement.json", "README.md"} <= set(pushed)
    card = ModelCard(pushed["README.md"].decode())
    assert "generated_from_trainer" in card.data.tags and "N_d = 1 of 4 devices" in card.text


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "future"])
def test_a_sharded_trainer_push_over_a_single_file_loads_the_new_weights(tmp_path, hub, blocking):
    """An earlier push left one `model.safetensors` in the repository; the Trainer's push of a sharded save uploaded
    the index and shards beside it, and transformers, which prefers the single file, loaded the earlier model."""
    _pruned(seed=4).push_to_hub("me/model")
    trained = _sharded(_pruned(seed=5))
    result = _trainer(trained, tmp_path / "out").push_to_hub(blocking=blocking)
    assert result.result() is not None if not blocking else result is not None
    pushed = hub.repos["me/model"]["main"]
    assert "model.safetensors" not in pushed and "model.safetensors.index.json" in pushed
    assert torch.allclose(_loaded(hub, tmp_path / "hub"), _logits(trained), atol=1e-6)


def test_pushes_during_training_carry_what_the_model_needs(tmp_path, hub):
    """`hub_strategy="every_save"` with `OccultCallback`'s N_d schedule: transformers copies only the config and
    weights of each checkpoint into the output folder, so the repository lacked the similarity profile its config
    names (it did not load), `occult_placement.json` and the card's pruning section."""
    from occult_hf import OccultCallback, OccultConfig, RoutingProfile

    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    profile = tmp_path / "profile.safetensors"
    RoutingProfile.collect(tiny_model("olmoe", seed=4), documents, progress=False).save(profile)
    model = _pruned(OccultConfig(num_devices=4, prune="similarity", max_devices_per_token=1, profile=str(profile)))
    schedule = OccultCallback(start_devices_per_token=4, target_devices_per_token=1, schedule_steps=4)
    _training(model, tmp_path / "out", "every_save", [schedule]).train()
    pushed = hub.repos["me/model"]["main"]
    assert {"occult_profile.safetensors", "occult_placement.json", "README.md"} <= set(pushed)
    limit = json.loads(pushed["config.json"])["occult_pruning"]["max_devices_per_token"]
    assert f"N_d = {limit} of 4 devices" in pushed["README.md"].decode()
    assert torch.allclose(_loaded(hub, tmp_path / "hub"), _logits(model), atol=1e-6)


def test_a_push_during_training_over_an_earlier_single_file_loads_the_new_weights(tmp_path, hub):
    """The output folder and the repository held one `model.safetensors` (an earlier `push_to_hub`); transformers
    copied a sharded checkpoint's index and shards beside it and uploaded the folder, which loaded the earlier model,
    locally and from the Hub. A killed save's staging folder in the checkpoint or the output folder is not uploaded."""
    from transformers import AutoModelForCausalLM

    model = _pruned()
    _trainer(model, tmp_path / "out").push_to_hub()
    trainer = _training(_sharded(model), tmp_path / "out", "checkpoint")
    (tmp_path / "out" / ".occult_save-x1y2z3").mkdir()
    (tmp_path / "out" / ".occult_save-x1y2z3" / "config.json").write_text("{}")
    trainer.train()
    pushed = hub.repos["me/model"]["main"]
    assert "model.safetensors" not in pushed and "model.safetensors.index.json" in pushed
    assert not [name for name in pushed if ".occult_save" in name]
    assert torch.allclose(_loaded(hub, tmp_path / "hub"), _logits(model), atol=1e-6)
    local = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.allclose(_logits(local), _logits(model), atol=1e-6)


def test_the_checkpoint_pushed_for_hub_strategy_checkpoint_resumes(tmp_path, hub):
    """`hub_strategy="checkpoint"` uploads each checkpoint as `last-checkpoint`, to resume from; transformers uploads it
    inside its `_save_checkpoint`, before occult_hf marks it complete, so the pushed one said its save did not finish
    and a resume from it was refused."""
    _training(_pruned(), tmp_path / "out", "checkpoint").train()
    checkpoint = hub.download("me/model", tmp_path / "hub") / "last-checkpoint"
    assert json.loads((checkpoint / "occult_checkpoint.json").read_text())["complete"] is True
    resumed = _trainer(_pruned(), tmp_path / "resumed", max_steps=6)
    resumed.train(resume_from_checkpoint=os.fspath(checkpoint))
    assert resumed.state.global_step == 6


def test_a_failed_upload_during_training_leaves_the_repositorys_weights(tmp_path, hub):
    """The deletion of the replaced weight files ran after a `hub_strategy` upload that had failed, and deleted the
    repository's only weights (the earlier push's) while training went on: it now runs only once the upload landed."""
    from concurrent.futures import Future

    model = _pruned()
    _trainer(model, tmp_path / "out").push_to_hub()
    working = hub.upload_folder

    def failing(*args, **kwargs):  # the network is down for the pushes during training
        if not kwargs.get("run_as_future"):
            return working(*args, **kwargs)
        future = Future()
        future.set_exception(ConnectionError("network down"))
        return future

    hub.upload_folder = failing
    _training(_sharded(model), tmp_path / "out", "every_save").train()
    assert "model.safetensors" in hub.repos["me/model"]["main"]
