"""A native-EP `save_pretrained(distributed_checkpoint=True)` into a directory an earlier save wrote loads the model
that saved last (2 gloo ranks, OLMoE, a placement that reorders the experts, similarity pruning with its profile file).

transformers loads a directory that holds rank shards (`shard-00001-model-00001-of-00001.safetensors`) through torch
DCP's reader, which takes every `.safetensors` file of the directory as part of one checkpoint: the earlier plain
save's `model.safetensors` (or its shards), or the rank shards of a distributed save made at more ranks, were read
together with the new rank shards, and the logits came back 0.7-1.5 (relative) off, without an error, in a
native-EP load and in a one-process load alike. A plain save over a distributed checkpoint is checked too (its
`publish_staged` removes the rank shards).
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_world
from native_ep_models import TOLERANCE, load_ep, similarity_profile, rank_batch, rel_err, shuffled_placement
from tiny_models import tiny_checkpoint

from occult_hf.hf.native_ep import transformers_ep_available

pytestmark = pytest.mark.skipif(
    not transformers_ep_available(), reason="transformers < 5.23 has no EPImplementationInterface"
)


def _saved_then_loaded(model, directory, ids, **save) -> tuple[float, list]:
    """Change every weight, save into `directory`, load it back under the same EP setup: the loaded model's logits
    against the saved model's (relative error), and the saved model's logits."""
    from occult_hf.hf.native_ep import reshard

    for param in reshard(model).parameters():
        param.add_(0.02)
    expected = model(ids).logits
    model.save_pretrained(directory, **save)  # collective
    return rel_err(load_ep(directory, ep_size=2, fsdp_size=2)(ids).logits, expected), expected.tolist()


def _distributed_save_at_4(rank, world_size, path, directory):
    """A distributed checkpoint of 4 ranks: 4 rank shards."""
    from occult_hf import OccultConfig, apply_occult_ep

    model = load_ep(path, ep_size=4, fsdp_size=4)
    apply_occult_ep(model, OccultConfig(placement="contiguous"))
    model.save_pretrained(directory, distributed_checkpoint=True)  # collective


def _saves_world(rank, world_size, path, profile, root):
    """Directory "over_plain": a plain save, then a distributed one. Directory "over_dcp" (a 4-rank distributed save
    there already): a distributed save at 2 ranks, then a plain one."""
    from occult_hf import OccultConfig, apply_occult_ep

    model = load_ep(path, ep_size=2, fsdp_size=2)
    pruned = {"prune": "similarity", "max_devices_per_token": 1, "profile": profile}
    apply_occult_ep(model, OccultConfig(placement=shuffled_placement("olmoe"), **pruned))
    ids, errors = rank_batch(rank), {}
    over_plain, over_dcp = f"{root}/over_plain", f"{root}/over_dcp"
    with torch.no_grad():
        _saved_then_loaded(model, over_plain, ids)
        errors["dcp over plain"], dcp_logits = _saved_then_loaded(model, over_plain, ids, distributed_checkpoint=True)
        errors["dcp over more rank shards"], _ = _saved_then_loaded(model, over_dcp, ids, distributed_checkpoint=True)
        errors["plain over dcp"], _ = _saved_then_loaded(model, over_dcp, ids)
    return {"errors": errors, "dcp logits": dcp_logits, "files": sorted(os.listdir(over_plain))}


@pytest.mark.world_size(4)
def test_a_distributed_checkpoint_over_an_earlier_save_loads_the_last_saved_model(tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint("olmoe", tmp_path / "ck", seed=4))
    profile = similarity_profile(path, str(tmp_path / "profile.safetensors"))
    run_world(_distributed_save_at_4, 4, path, str(tmp_path / "over_dcp"), timeout_s=400)
    reports = run_world(_saves_world, 2, path, profile, str(tmp_path), timeout_s=400)
    for rank, report in enumerate(reports):
        for case, error in report["errors"].items():
            assert error <= TOLERANCE, (rank, case, report["errors"])
    files = reports[0]["files"]
    assert "occult_profile.safetensors" in files and not [n for n in files if n.startswith("model")], files
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "over_plain", dtype=torch.float32)  # one process
    with torch.no_grad():
        for rank, report in enumerate(reports):
            assert rel_err(single(rank_batch(rank)).logits, torch.tensor(report["dcp logits"])) <= TOLERANCE, rank
