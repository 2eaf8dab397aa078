"""Ranks that loaded different weights are stopped at `apply_occult` (issue 33 item 2), on 2 gloo ranks.

Same config and placement on both ranks, the checkpoints differ:

- two different checkpoints (other seeds): the replicated (non-expert) weights differ; every rank raises naming
  them (without the check both ranks ran a model that exists nowhere, and `save_pretrained` wrote experts 0-3 of
  one checkpoint and 4-7 of the other);
- checkpoints that differ only in the routed experts (an experts-only fine-tune), which each rank reads only its
  share of: the checkpoint's identity (a sample of each weight file's bytes) differs; every rank raises naming it;
- one checkpoint at two paths (each rank its own copy): they agree, and the model runs.
"""

from __future__ import annotations

import shutil

import pytest

from distributed import run_world
from tiny_models import tiny_batch, tiny_checkpoint

ENV = {"OCCULT_SAVE_TIMEOUT_S": "20"}


def _load(path):
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, Placement

    placement = Placement(8, 2, {0: [1, 0, 0, 1, 1, 0, 1, 0], 1: [0, 1, 1, 0, 0, 1, 0, 1]})
    return AutoModelForCausalLM.from_pretrained(path, occult_config=OccultConfig(placement=placement))


def _mismatch(path) -> str:
    from occult_hf.distributed.agreement import EPConfigMismatchError

    with pytest.raises(EPConfigMismatchError) as error:
        _load(path)
    return str(error.value)


def _weights_world(rank, world_size, root):
    from occult_hf.hf.apply import install

    install()
    seen = {
        "other_seed": _mismatch(f"{root}/seed{rank}"),
        "other_experts": _mismatch(f"{root}/{('seed0', 'seed0_other_experts')[rank]}"),
    }
    model = _load(f"{root}/{('seed0', 'seed0_copy')[rank]}")
    seen["same_content"] = float(model(tiny_batch(seed=rank)).logits.abs().sum())
    return seen


@pytest.mark.world_size(2)
def test_ranks_that_loaded_different_weights_raise_naming_them(tmp_path):
    from safetensors.torch import load_file, save_file

    for seed in (0, 1):
        tiny_checkpoint("olmoe", tmp_path / f"seed{seed}", seed=seed)
    shutil.copytree(tmp_path / "seed0", tmp_path / "seed0_copy")
    shutil.copytree(tmp_path / "seed0", tmp_path / "seed0_other_experts")
    weights_file = tmp_path / "seed0_other_experts" / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:  # an experts-only fine-tune: every routed expert changed, nothing else
        if ".mlp.experts." in name:
            weights[name] += 1e-3
    save_file(weights, weights_file, metadata={"format": "pt"})

    reports = run_world(_weights_world, 2, str(tmp_path), env=ENV, timeout_s=200)
    for rank, seen in enumerate(reports):
        assert "disagree at apply_occult on" in seen["other_seed"], (rank, seen["other_seed"])
        assert "the replicated weights (they differ in ['lm_head.weight', 'model.embed_tokens.weight', " in seen["other_seed"], (rank, seen["other_seed"])
        assert "(12 in all)]: the ranks loaded different weights)" in seen["other_seed"]  # the norms start at 1 alike
        assert "checkpoint (rank 0 'sha256:" in seen["other_seed"]
        assert "checkpoint (rank 0 'sha256:" in seen["other_experts"] and "replicated weights" not in seen["other_experts"], (rank, seen["other_experts"])
        assert seen["same_content"] > 0
