"""What a long job under expert parallelism repeats does not pile up (2 gloo ranks): converting model after model (an
evaluation of successive checkpoints) made a gloo process group each, never freed (5 file descriptors and 3 threads a
conversion: a job ran out of descriptors after about 200), and every collective operation (each `generate`, save,
profile batch) left its arrival notes in the job's store for good."""

from __future__ import annotations

import pytest

from distributed import run_world
from tiny_models import tiny_batch, tiny_model

ROUNDS = 6


def _repeating_world(rank, world_size):
    import torch
    import torch.distributed as dist

    from occult_hf import OccultConfig, apply_occult, unapply_occult

    groups = lambda: len(dist.distributed_c10d._world.pg_map)  # noqa: E731
    keys = dist.distributed_c10d._get_default_store().num_keys
    counts = []
    for seed in range(ROUNDS):
        model = apply_occult(tiny_model("olmoe", seed=seed), OccultConfig())
        with torch.no_grad():
            for _ in range(3):
                model.generate(tiny_batch(batch=1, seq=4, seed=rank), max_new_tokens=2, do_sample=False)
        unapply_occult(model) if seed % 2 else None  # half of them dropped still converted
        dist.barrier()
        counts.append((groups(), keys()))
    return counts


@pytest.mark.world_size(2)
def test_repeated_conversions_and_generates_leave_no_groups_or_store_keys_behind():
    for counts in run_world(_repeating_world, 2, timeout_s=300):
        assert counts[-1] == counts[1], counts  # the first round makes what every later one reuses
