"""A distributed checkpoint missing a rank shard is refused when loaded, naming the missing file (2 gloo ranks, OLMoE).

`save_pretrained(dir, distributed_checkpoint=True)` writes one rank shard per rank
(`shard-0000R-model-00001-of-00001.safetensors`; `-of-N` counts one rank's files, not the ranks), and transformers
loads the directory through torch DCP, which takes each tensor's size from the chunks it finds. Without rank 1's
shard the load went through silently: the rows that shard held were the uninitialised memory the model was
materialised into (NaN logits, no warning), in a native-EP load and in a one-process load alike. Without the last
rank's shard DCP failed on "Size mismatch ... for lm_head.weight", naming no file. Both loads are checked with the
checkpoint's config holding its occult_config and without it; the complete checkpoint still loads exactly.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from distributed import run_world
from native_ep_models import TOLERANCE, load_ep, rank_batch, rel_err
from tiny_models import tiny_checkpoint

from occult_hf.hf.native_ep import transformers_ep_available

pytestmark = pytest.mark.skipif(
    not transformers_ep_available(), reason="transformers < 5.23 has no EPImplementationInterface"
)

RANK_SHARDS = [f"shard-0000{rank}-model-00001-of-00001.safetensors" for rank in (1, 2)]


def _save_world(rank, world_size, path, directory):
    """A native-EP model's distributed checkpoint (one rank shard per rank); this rank's logits before the save."""
    from occult_hf import OccultConfig, apply_occult_ep

    model = load_ep(path, ep_size=2, fsdp_size=2)
    apply_occult_ep(model, OccultConfig())
    with torch.no_grad():
        logits = model(rank_batch(rank)).logits
    model.save_pretrained(directory, distributed_checkpoint=True)  # collective
    return logits.tolist()


def _load_world(rank, world_size, directories):
    """Each directory loaded under native EP: `("loaded", logits)` or `("error", "Type: message")`."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    outcomes = {}
    for directory in directories:
        try:
            model = load_ep(directory, ep_size=2, fsdp_size=2)
            with torch.no_grad():
                outcomes[directory] = ("loaded", model(rank_batch(rank)).logits.tolist())
        except (Exception, CheckpointException) as error:
            outcomes[directory] = ("error", f"{type(error).__name__}: {error}")
    return outcomes


def _partial_copies(complete, root) -> dict[str, str]:
    """`{directory: the rank shard removed}`: the complete checkpoint without one rank shard, with the occult_config
    its config holds and without it."""
    copies = {}
    for missing in RANK_SHARDS:
        for stored in (True, False):
            directory = root / f"without_{missing[:11]}_{'occult' if stored else 'plain'}"
            shutil.copytree(complete, directory)
            (directory / missing).unlink()
            if not stored:
                config = json.loads((directory / "config.json").read_text())
                del config["occult_config"]
                (directory / "config.json").write_text(json.dumps(config))
            copies[str(directory)] = missing
    return copies


@pytest.mark.world_size(2)
def test_a_distributed_checkpoint_without_a_rank_shard_is_refused_naming_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint("olmoe", tmp_path / "ck", seed=4))
    complete = str(tmp_path / "complete")
    expected = run_world(_save_world, 2, path, complete, timeout_s=300)
    copies = _partial_copies(complete, tmp_path)
    loads = run_world(_load_world, 2, [complete, *copies], timeout_s=300)
    for rank, outcomes in enumerate(loads):
        kind, logits = outcomes[complete]
        assert kind == "loaded" and rel_err(logits, torch.tensor(expected[rank])) <= TOLERANCE, (rank, kind, logits)
        for directory, missing in copies.items():
            kind, said = outcomes[directory]
            assert kind == "error" and said.startswith("FileNotFoundError") and missing in said, (rank, directory, said)
    single = AutoModelForCausalLM.from_pretrained(complete, dtype=torch.float32)  # one process
    with torch.no_grad():
        for rank in range(2):
            assert rel_err(single(rank_batch(rank)).logits, torch.tensor(expected[rank])) <= TOLERANCE, rank
    for directory, missing in copies.items():
        with pytest.raises(FileNotFoundError, match=re.escape(missing)):
            AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
