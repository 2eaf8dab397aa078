"""A rank that fails before `apply_occult` under `torchrun`: the launcher stops the others within seconds (what
docs/failure.md says of launchers), on 2 gloo ranks. Where occult_hf owns the wait (a rank that never arrives at
`apply_occult` or a save, or posts a failure there), the bound is tested in test_hostile_cases.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from distributed import free_port
from tiny_models import tiny_checkpoint

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
