"""The static-capacity dispatchers on 2 GPUs under NCCL (skipped without 2 GPUs): "symm_mem" (NVSHMEM
`all_to_all_vdev`, skipped without NVSHMEM), "padded" and the packed stand-in, fp32, against one
process within 1e-5 (output, input, routing-weight and expert-weight gradients; the cases of
`test_static_dispatch.py`).

Run: `python -m pytest -q -m gpu tests/test_gpu_static_dispatch.py`.
"""

import pytest
import torch

from distributed import run_world
from test_static_dispatch import CASES, _world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.world_size(2),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a 2-rank NCCL world"),
]


def test_static_dispatchers_under_nccl_match_one_process():
    cases = list(CASES) + [(c[0].replace("packed", "padded"), *c[1:]) for c in CASES if c[0] == "packed"]
    from occult_hf.dispatch.static import nvshmem_usable

    if nvshmem_usable():
        cases += [("symm_mem", *c[1:]) for c in CASES]
    errors = run_world(_world, 2, cases, "cuda", backend="nccl")
    assert errors == [[], []]
