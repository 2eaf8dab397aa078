"""Many saves of changing models into one directory (`hf.checkpointing.publish_staged`): after each, the directory loads
the model just saved, through occult_hf, as plain transformers (`occult_config=None`, and in a fresh interpreter that
never imports occult_hf) and as the "fp16" variant saved last; it holds no weight file of the saved variant that the
save did not write, and the other variant's files stay. A publish that stopped half way leaves files that the next
save removes.

A silent wrong answer here is a load that mixes shards of two saves, an index naming a removed shard, or an old single
file still loading before a new index: the logits are compared with those of the model saved.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from tiny_models import tiny_batch, tiny_model

from occult_hf import OccultConfig, apply_occult
from occult_hf.hf.apply import install
from occult_hf.hf.checkpointing import weight_files

IDS = tiny_batch(seed=3)

#: (max_shard_size, variant) of each save in turn: the tiny OLMoE (453 kB in fp32) in 1, 2, 3, 4 or 6 files
SAVES = [
    (None, None), ("150KB", None), (None, "fp16"), ("150KB", None), ("200KB", None), ("150KB", "fp16"),
    ("150KB", "fp16"), ("300KB", None), (None, None), ("100KB", None), (None, "fp16"), ("100KB", None),
]

EXACT = OccultConfig(num_devices=2)
PRUNED = OccultConfig(num_devices=2, prune="router", max_devices_per_token=1)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal at 1e-5 relative to the largest logit: a load that mixes two saves differs at 1e-2."""
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * expected.abs().max().item(), f"{what}: logits differ by {error:.3g}"


def _changed(vanilla, step: int) -> None:
    """Move every weight of `vanilla` a little, so that no two saves hold the same tensor."""
    generator = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for parameter in vanilla.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)


def _variant_files(directory, variant: str | None) -> list[str]:
    """The weight files of `variant` in `directory` (transformers' names and publish_staged's fresh shard names)."""
    tag = f".{variant}" if variant else ""
    return [n for n in weight_files(str(directory)) if (tag in n if variant else ".fp16" not in n)]


def _check_files(directory, shard: str | None, variant: str | None) -> None:
    """The save's variant holds its index and the shards it names, or its single file, and nothing else."""
    files = _variant_files(directory, variant)
    tag = f".{variant}" if variant else ""
    if shard is None:
        assert files == [f"model{tag}.safetensors"], f"stale weight files of variant {variant}: {files}"
        return
    index = f"model.safetensors.index{tag}.json"
    named = set(json.loads((directory / index).read_text())["weight_map"].values())
    assert sorted(files) == sorted({index, *named}) and len(named) >= 2, f"{index} names {sorted(named)}; files {files}"


def _plain_logits_elsewhere(directory, tmp_path) -> torch.Tensor:
    """The directory's logits from a fresh interpreter with plain transformers, occult_hf never imported."""
    torch.save(IDS, tmp_path / "ids.pt")
    code = (
        "import sys, torch, transformers\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(directory)!r})\n"
        "assert not [m for m in sys.modules if m.startswith('occult_hf')], 'occult_hf was imported'\n"
        f"torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits.detach(), {str(tmp_path / 'out.pt')!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize("config", [EXACT, PRUNED], ids=["exact", "pruned"])
def test_many_saves_into_one_directory_each_load_the_model_saved(tmp_path, config):
    install()
    directory, vanilla = tmp_path / "checkpoint", tiny_model("olmoe", seed=0)
    expected = {}  # variant: (occult_hf logits, plain logits) of its last save
    for step, (shard, variant) in enumerate(SAVES):
        _changed(vanilla, step)
        model = apply_occult(copy.deepcopy(vanilla), config)
        sizes = {} if shard is None else {"max_shard_size": shard}
        model.save_pretrained(directory, variant=variant, **sizes)
        expected[variant] = (_logits(model), _logits(vanilla))
        _check_files(directory, shard, variant)
        for loaded_variant, (occult, plain) in expected.items():
            where = f"save {step} ({shard}, {variant}), loading variant {loaded_variant}"
            chosen = {} if loaded_variant is None else {"variant": loaded_variant}
            loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, **chosen)
            _assert_close(_logits(loaded), occult, where)
            unreplaced = transformers.AutoModelForCausalLM.from_pretrained(directory, occult_config=None, **chosen)
            _assert_close(_logits(unreplaced), plain, f"{where}, occult_config=None")
        if config is EXACT and step in (1, len(SAVES) - 1):
            _assert_close(_plain_logits_elsewhere(directory, tmp_path), expected[None][1], f"save {step}, no occult_hf")


class _Stop(BaseException):
    """The process stops here."""


def test_the_files_of_a_publish_that_stopped_go_with_the_next_save(tmp_path, monkeypatch):
    """New shards moved in before the process stopped (old weights still load) are the next save's stale files."""
    install()
    directory = tmp_path / "checkpoint"
    apply_occult(tiny_model("olmoe", seed=1), EXACT).save_pretrained(directory)
    real_replace = os.replace

    def stop_at_the_commit(source, destination):
        if os.path.basename(destination) == "model.safetensors.index.json":
            raise _Stop(destination)
        return real_replace(source, destination)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", stop_at_the_commit)
        with pytest.raises(_Stop):
            apply_occult(tiny_model("olmoe", seed=2), EXACT).save_pretrained(directory, max_shard_size="150KB")
    assert len(_variant_files(directory, None)) > 1  # the orphaned shards beside model.safetensors
    model = apply_occult(tiny_model("olmoe", seed=3), EXACT)
    model.save_pretrained(directory, max_shard_size="200KB")
    _check_files(directory, "200KB", None)
    _assert_close(_logits(transformers.AutoModelForCausalLM.from_pretrained(directory)), _logits(model), "after")
