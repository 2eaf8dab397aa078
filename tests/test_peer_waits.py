"""Ranks that never reach a collective occult_hf starts are named within its bounds (issue 33 item 6, issue 32
item 3), on 2 gloo ranks:

- a save on rank 0 only (`if rank == 0: model.save_pretrained(...)`, the usual HF habit) fails within
  `OCCULT_JOIN_TIMEOUT_S` naming rank 1, although the save's own waits are bounded by a minute here; the
  ranks can then save together;
- a rank whose `from_pretrained(..., occult_config=...)` fails its early check (before the checkpoint is read)
  tells the others, which raise at their `apply_occult` at once, naming it and its error;
- a rank that fails in the user's code before `apply_occult` and goes on elsewhere is named by the others
  after `OCCULT_SAVE_TIMEOUT_S`, not after the process group's timeout;
- under `torchrun`, a rank that exits with an error before `apply_occult` gets the others stopped by the
  launcher within seconds (what docs/failure.md says of launchers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from distributed import free_port, run_world
from tiny_models import tiny_checkpoint, tiny_model

#: the save's own waits, once every rank has joined: long, so that only the join bound can end the rank-0 save
SAVE_TIMEOUT_ENV = {"OCCULT_SAVE_TIMEOUT_S": "60", "OCCULT_JOIN_TIMEOUT_S": "2", "OCCULT_TEST_COLLECTIVE_TIMEOUT_S": "60"}


def _timed(call):
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what the rank sees is the point
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return time.monotonic() - start, None


def _peer_world(rank, world_size, root):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult
    from occult_hf.hf.apply import install

    install()
    seen = {}
    # a save that only rank 0 makes; rank 1 meanwhile waits in a barrier of its own code
    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig())
    if rank == 0:
        seen["rank0_save"] = _timed(lambda: model.save_pretrained(f"{root}/rank0_only"))
    dist.barrier()
    model.save_pretrained(f"{root}/together")  # nothing half started: both ranks then save together
    seen["together"] = os.path.isfile(f"{root}/together/model.safetensors")
    dist.barrier()

    # rank 1's from_pretrained fails its early check of occult_config; rank 0 loads and reaches apply_occult
    config = OccultConfig() if rank == 0 else {"num_device": 2}
    seen["early_check"] = _timed(lambda: AutoModelForCausalLM.from_pretrained(f"{root}/vanilla", occult_config=config))
    dist.barrier()

    # rank 1 fails in the user's own code before apply_occult and goes on to a barrier
    os.environ["OCCULT_SAVE_TIMEOUT_S"] = "3"
    if rank == 0:
        seen["user_code"] = _timed(lambda: apply_occult(tiny_model("olmoe", seed=2), OccultConfig()))
    dist.barrier()
    return seen


@pytest.mark.world_size(2)
def test_ranks_that_never_arrive_are_named_within_the_bounds(tmp_path):
    tiny_checkpoint("olmoe", tmp_path / "vanilla", seed=3)
    reports = run_world(_peer_world, 2, str(tmp_path), env=SAVE_TIMEOUT_ENV, timeout_s=200)
    seconds, error = reports[0]["rank0_save"]
    assert seconds < 10 and "save_pretrained on rank 0: EP ranks [1] did not reach it within 2 s (OCCULT_JOIN_TIMEOUT_S)" in error, (seconds, error)
    assert not (tmp_path / "rank0_only" / "model.safetensors").exists()
    assert reports[0]["together"]

    seconds, error = reports[0]["early_check"]
    assert seconds < 10 and "rank 1 of the expert-parallel group failed at from_pretrained (ValueError: OccultConfig got unknown keys ['num_device']" in error, (seconds, error)
    assert "OccultConfig got unknown keys ['num_device']" in reports[1]["early_check"][1]

    seconds, error = reports[0]["user_code"]
    assert seconds < 10 and "apply_occult on rank 0: EP ranks [1] did not reach it within 3 s (OCCULT_SAVE_TIMEOUT_S)" in error, (seconds, error)


LAUNCHED = """
import os, sys, time
import torch.distributed as dist
import occult_hf
from transformers import AutoModelForCausalLM

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise SystemExit("rank 1 fails before apply_occult")
start = time.monotonic()
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], occult_config=occult_hf.OccultConfig())
finally:
    print(f"rank 0 left from_pretrained after {time.monotonic() - start:.1f} s", flush=True)
"""


@pytest.mark.world_size(2)
def test_torchrun_stops_the_other_ranks_when_one_fails_before_apply_occult(tmp_path):
    """The launcher, not occult_hf's 300 s bound, ends rank 0's wait: torchrun stops the other workers as soon as
    one exits with an error (its agent polls every 0.1 s)."""
    script = tmp_path / "launched.py"
    script.write_text(textwrap.dedent(LAUNCHED))
    model = tiny_checkpoint("olmoe", tmp_path / "model", seed=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OCCULT_SAVE_TIMEOUT_S": "300"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(script), str(model)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert done.returncode != 0 and "rank 1 fails before apply_occult" in done.stderr, done.stderr[-3000:]
    assert elapsed < 60, (elapsed, done.stdout[-2000:], done.stderr[-2000:])  # rank 0 never waited out its 300 s
