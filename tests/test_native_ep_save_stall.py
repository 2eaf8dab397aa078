"""A native-EP `save_pretrained` (`DistributedConfig(ep_implementation="occult")`) whose peer stalls or dies.

On 2 gloo ranks, every wait on a peer bounded by a 5 s `OCCULT_SAVE_TIMEOUT_S` and `OCCULT_JOIN_TIMEOUT_S` and the
process group's own timeout left long (600 s), so that only occult_hf's bounds can end a wait in time:

- (a) rank 1 never calls `save_pretrained` while rank 0 does: `EPPeerError` on rank 0 naming the ranks that did not
  reach it, within the join bound;
- (b) rank 1 stalls after the ranks met, inside transformers' gather of the sharded weights: `EPPeerError` on rank 0
  naming the save, within the save bound;
- (c) rank 1 dies inside that gather: `EPPeerError` on rank 0 naming the save and the peer's death, within seconds.

After each, the checkpoint an earlier save wrote into the folder is byte-for-byte unchanged, with no staging folder
left. A timed-out collective leaves its groups unusable, so (b) ends its world and (c) has a world of its own.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta

import pytest
import torch

from distributed import WorldError, run_world
from tiny_models import tiny_checkpoint

from occult_hf.hf.native_ep import transformers_ep_available

pytestmark = pytest.mark.skipif(
    not transformers_ep_available(), reason="transformers < 5.23 has no EPImplementationInterface"
)

BOUND_S = 5
TIMEOUT_ENV = {
    "OCCULT_SAVE_TIMEOUT_S": str(BOUND_S),
    "OCCULT_JOIN_TIMEOUT_S": str(BOUND_S),
    "OCCULT_TEST_COLLECTIVE_TIMEOUT_S": "600",
}
#: what a bounded failure may take beyond its bound (the gather's first collectives, the error's way out)
SLACK_S = 10
#: seconds a world may run: the unchanged code waited for the process group's timeout, far past this
WORLD_TIMEOUT_S = 90
NUM_EXPERTS = 8


def _saved_model(path: str, out_dir: str):
    """The checkpoint at `path` loaded under transformers' EP with a placement that moves experts, saved once into
    `out_dir` (collective); returns the model and rank 0's digests of `out_dir`."""
    import numpy as np
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from occult_hf import OccultConfig, Placement, apply_occult_ep

    config = DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="occult")
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32)
    devices = np.arange(NUM_EXPERTS) * 2 // NUM_EXPERTS
    maps = {layer: np.random.default_rng(31 + layer).permutation(devices).tolist() for layer in (0, 1)}
    apply_occult_ep(model, OccultConfig(placement=Placement(NUM_EXPERTS, 2, maps, {"method": "shuffled"})))
    model.save_pretrained(out_dir)
    return model, _digests(out_dir)


def _digests(directory: str) -> dict[str, str]:
    """Entry name -> content digest ("directory" for a folder: a staging folder left behind)."""
    found = {}
    for name in sorted(os.listdir(directory)):
        entry = os.path.join(directory, name)
        found[name] = "directory" if os.path.isdir(entry) else hashlib.sha256(open(entry, "rb").read()).hexdigest()
    return found


def _rank0_save_fails(model, out_dir: str, first: dict, pattern: str) -> str:
    """Rank 0's save fails with `EPPeerError` matching `pattern` within the bound, leaving `out_dir` as `first` left
    it; returns the seconds it took and the error."""
    from occult_hf.distributed.agreement import EPPeerError

    start = time.monotonic()
    with pytest.raises(EPPeerError, match=pattern) as raised:
        model.save_pretrained(out_dir)
    took = time.monotonic() - start
    assert took < BOUND_S + SLACK_S, took
    assert _digests(out_dir) == first
    return f"{took:.1f} s: {raised.value}"


def _stall_in_the_gather(done_key: str) -> None:
    """On this rank, transformers' gather of the sharded weights waits until rank 0 posts `done_key` (at most a
    minute) and raises: a peer that stalls after the ranks met."""
    import torch.distributed as dist
    import transformers.distributed.mixin

    def stall(model):
        dist.distributed_c10d._get_default_store().wait([done_key], timedelta(seconds=60))
        raise RuntimeError("rank 1 stalled in the gather")

    transformers.distributed.mixin.gather_full_state_dict = stall


def _absent_and_stalled_peer(rank, world_size, path, out_dir):
    """(a) then (b); returns rank 0's seconds and error for each."""
    import torch.distributed as dist

    model, first = _saved_model(path, out_dir)
    store = dist.distributed_c10d._get_default_store()
    seen = {}
    if rank == 0:
        seen["absent"] = _rank0_save_fails(model, out_dir, first, r"save_pretrained on rank 0: EP ranks \[1\] did not reach it")
        store.set("absent_done", "1")
    else:
        store.wait(["absent_done"], timedelta(seconds=60))
    if rank == 0:
        pattern = rf"save_pretrained \(transformers' gather of the sharded weights\) failed on rank 0: an EP peer did not join within {BOUND_S} s"
        seen["stalled"] = _rank0_save_fails(model, out_dir, first, pattern)
        store.set("stalled_done", "1")
    else:
        _stall_in_the_gather("stalled_done")
        with pytest.raises(RuntimeError, match="rank 1 stalled in the gather"):
            model.save_pretrained(out_dir)
    return seen


@pytest.mark.world_size(2)
def test_a_native_ep_save_with_an_absent_or_stalled_peer_fails_within_the_bound(tmp_path):
    path = str(tiny_checkpoint("olmoe", tmp_path / "ck", seed=1, num_experts=NUM_EXPERTS))
    rank0, _ = run_world(_absent_and_stalled_peer, 2, path, str(tmp_path / "saved"), env=TIMEOUT_ENV, timeout_s=WORLD_TIMEOUT_S)
    assert set(rank0) == {"absent", "stalled"}, rank0


def _dead_peer(rank, world_size, path, out_dir, report_file):
    """(c): rank 1 exits (code 17) inside transformers' gather; rank 0 writes how long its save took to fail, and why."""
    import transformers.distributed.mixin

    model, first = _saved_model(path, out_dir)
    if rank == 1:
        transformers.distributed.mixin.gather_full_state_dict = lambda model: os._exit(17)
        model.save_pretrained(out_dir)
    with open(report_file, "w") as f:
        f.write(_rank0_save_fails(model, out_dir, first, r"save_pretrained .*failed on rank 0: an EP peer died"))


@pytest.mark.world_size(2)
def test_a_native_ep_save_whose_peer_dies_fails_at_once(tmp_path):
    path = str(tiny_checkpoint("olmoe", tmp_path / "ck", seed=1, num_experts=NUM_EXPERTS))
    report = tmp_path / "rank0.txt"
    with pytest.raises(WorldError) as error:
        run_world(_dead_peer, 2, path, str(tmp_path / "saved"), str(report), env=TIMEOUT_ENV, timeout_s=WORLD_TIMEOUT_S)
    message = str(error.value)
    assert "--- rank 1 ---\nprocess exited with code 17" in message and "--- rank 0 ---" not in message, message[-4000:]
    assert float(report.read_text().split(" s: ", 1)[0]) < SLACK_S, report.read_text()
