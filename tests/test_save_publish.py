"""A save that stops between any two of its publish steps leaves a directory that loads the old weights or the
new ones, never a mix (`hf.checkpointing._publish`).

The crash is injected at every step of the publish in turn: the k-th rename or removal in the target directory
raises a `BaseException` (what a killed process leaves is the same: files moved so far stay, nothing after
happens). After each, the directory is loaded with plain transformers and through occult_hf, and every tensor
must come from one of the two saves: all of them from the same one.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tiny_models import tiny_batch, tiny_model

from occult_hf.hf.apply import install
from occult_hf.hf.checkpointing import PUBLISHING_FILENAME, check_publish_finished

SHARD = "150KB"  # the tiny OLMoE (453 kB in fp32) in 4 shards


class _Crash(BaseException):
    """The process stops here (not an Exception: nothing may catch it and carry on)."""


def _saved(seed: int, directory, max_shard_size) -> dict[str, torch.Tensor]:
    from occult_hf import OccultConfig, apply_occult

    model = apply_occult(tiny_model("olmoe", seed=seed), OccultConfig(num_devices=2))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return model


def _loaded_weights(directory, occult: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from occult_hf import unapply_occult

    model = AutoModelForCausalLM.from_pretrained(directory, **({} if occult else {"occult_config": None}))
    if occult:
        unapply_occult(model)  # the vanilla modules back, with the experts it loaded
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _crash_at(monkeypatch, target, step: int) -> list[int]:
    """From now on, the `step`-th rename or removal of a file directly in `target` raises `_Crash`; returns the
    counter (one entry per step taken)."""
    taken: list[int] = []
    real_replace, real_remove = os.replace, os.remove

    def counted(real):
        def operation(path, *rest):
            destination = rest[0] if rest else path
            if os.path.dirname(os.path.abspath(destination)) == os.path.abspath(target):
                taken.append(1)
                if len(taken) == step:
                    raise _Crash(f"crash at step {step}: {os.path.basename(destination)}")
            return real(path, *rest)

        return operation

    monkeypatch.setattr(os, "replace", counted(real_replace))
    monkeypatch.setattr(os, "remove", counted(real_remove))
    return taken


@pytest.mark.parametrize(
    "old_shards, new_shards",
    [(SHARD, SHARD), (None, SHARD), (SHARD, None), (SHARD, "100KB")],
    ids=["sharded over sharded", "sharded over one file", "one file over sharded", "6 shards over 4"],
)
def test_a_save_interrupted_between_its_renames_loads_old_or_new_never_mixed(tmp_path, monkeypatch, old_shards, new_shards):
    install()
    pristine, target = tmp_path / "pristine", tmp_path / "checkpoint"
    _saved(1, pristine, old_shards)
    old = _loaded_weights(pristine, occult=False)
    new_model = _saved(2, tmp_path / "reference", new_shards)
    new = _loaded_weights(tmp_path / "reference", occult=False)
    distinct = sorted(name for name in old if not torch.equal(old[name], new[name]))  # norms start at 1 in both
    assert len(distinct) > len(old) // 2

    with monkeypatch.context() as patch:  # how many steps a whole publish takes
        shutil.copytree(pristine, target)
        steps = _crash_at(patch, target, step=0)
        new_model.save_pretrained(target, **({} if new_shards is None else {"max_shard_size": new_shards}))
    assert len(steps) >= 3
    shutil.rmtree(target)

    for step in range(1, len(steps) + 1):
        shutil.copytree(pristine, target)
        with monkeypatch.context() as patch:
            _crash_at(patch, target, step)
            with pytest.raises(_Crash):
                new_model.save_pretrained(target, **({} if new_shards is None else {"max_shard_size": new_shards}))
        check_publish_finished(str(target))  # refused only where the save changes config.json (not here)
        for occult in (False, True):
            loaded = _loaded_weights(target, occult)
            from_old = {name for name in distinct if torch.equal(loaded[name], old[name])}
            from_new = {name for name in distinct if torch.equal(loaded[name], new[name])}
            assert from_old == set(distinct) or from_new == set(distinct), (
                f"crash at step {step} of {len(steps)} ({'occult_hf' if occult else 'vanilla'} load): "
                f"{len(from_old)} tensors of the old save, {len(from_new)} of the new one, "
                f"{len(distinct) - len(from_old) - len(from_new)} of neither; files {sorted(os.listdir(target))}"
            )
        shutil.rmtree(target)


def test_a_save_stopped_while_publishing_is_refused_until_one_completes(tmp_path, monkeypatch):
    """A pruned save over an unpruned one, stopped before its `config.json` replaced the old one: the directory held
    the new weights beside the old config, and occult_hf ran them unpruned (0.113 off the model saved, 1.55 off the
    earlier one) without a word. The load is refused, naming the unfinished save, until a save completes."""
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult

    install()
    target = tmp_path / "checkpoint"
    apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=2)).save_pretrained(target)
    pruning = OccultConfig(num_devices=2, prune="router", max_devices_per_token=1)
    pruned = apply_occult(tiny_model("olmoe", seed=2), pruning)
    real_replace = os.replace

    def stop_at_the_config(source, destination):
        if os.path.basename(destination) == "config.json" and os.path.dirname(destination) == str(target):
            raise _Crash("stopped before config.json")
        return real_replace(source, destination)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", stop_at_the_config)
        with pytest.raises(_Crash):
            pruned.save_pretrained(target)
    refused = f"stopped while it replaced the files of the earlier save \\({PUBLISHING_FILENAME} is there"
    for keywords in ({}, {"occult_config": None}):
        with pytest.raises(RuntimeError, match=refused):
            AutoModelForCausalLM.from_pretrained(target, **keywords)
    copy = tmp_path / "copy"
    shutil.copytree(target, copy)
    pruned.save_pretrained(target)
    ids = tiny_batch(seed=5)
    with torch.no_grad():
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(target)(ids).logits, pruned(ids).logits, atol=1e-6)
    assert not (target / PUBLISHING_FILENAME).exists()
    plain = tiny_model("olmoe", seed=3)  # a save of any kind, in place, makes the copy whole again
    plain.save_pretrained(copy)
    with torch.no_grad():
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(copy)(ids).logits, plain(ids).logits, atol=1e-6)
