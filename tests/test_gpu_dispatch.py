"""GPU checks of the dispatchers (skipped without CUDA): what the CPU suite cannot see.

- One process (logical devices): an `OccultMoE` forward and backward makes no host synchronisation
  (`torch.cuda.set_sync_debug_mode("error")` turns one into an error), for both dispatch modes and
  both expert backends.
- Two ranks under NCCL: the "all_to_all" dispatcher's one host read per layer (the split sizes) polls
  an event and reads pinned memory, so a block's forward and backward make no synchronising CUDA
  call either (`set_sync_debug_mode("error")`), in both dispatch modes; nor does "padded", which
  `dispatcher="auto"` takes where its padding is cheap and which reads nothing of the device.

Run: `python -m pytest -q -m gpu tests/test_gpu_dispatch.py` (the 2-rank test needs 2 GPUs).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from tiny_models import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
def test_one_process_block_makes_no_host_sync(mode, backend):
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    model = tiny_model("olmoe", seed=0).cuda().to(torch.bfloat16)
    apply_occult(model, OccultConfig(num_devices=4, dispatch=mode, expert_backend=backend))
    block = next(iter(occult_modules(model).values()))
    assert block.dispatcher.name == "local"
    hidden = torch.randn(4, 32, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block(hidden).float().square().sum().backward()  # warm-up: kernel compilation and autotuning may synchronise
    out = _step_without_sync(block, hidden)
    assert torch.isfinite(out).all() and int(block.stats.forwards) == 2


def _step_without_sync(block, hidden):
    """One forward and backward of `block` with every synchronising CUDA call an error; returns the output."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = block(hidden)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out


def _no_sync_world(rank, world_size):
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    checked = []
    # "auto" with top-4 of 8 experts (padding 1.4%): "padded" on the default expert backend (the torch backend's
    # grouped GEMM path cannot take a static layout's empty pairs)
    settings = [("dedup", "all_to_all", "torch", 2), ("per_expert", "all_to_all", "torch", 2), ("dedup", "auto", "auto", 4)]
    for mode, dispatcher, backend, top_k in settings:
        model = tiny_model("olmoe", seed=0, top_k=top_k).to(f"cuda:{rank}", torch.bfloat16)
        apply_occult(model, OccultConfig(dispatch=mode, dispatcher=dispatcher, expert_backend=backend))
        block = next(iter(occult_modules(model).values()))
        generator = torch.Generator(device=f"cuda:{rank}").manual_seed(rank)
        shape = (2, 16 + 5 * rank, model.config.hidden_size)  # the ranks hold different token counts
        hidden = torch.randn(shape, generator=generator, device=f"cuda:{rank}").to(torch.bfloat16).requires_grad_()
        block(hidden).float().square().sum().backward()  # warm-up: communicators, the pinned count buffer
        out = _step_without_sync(block, hidden)
        checked.append((mode, block.dispatcher.name, bool(torch.isfinite(out).all()), int(block.stats.forwards)))
    return checked


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a 2-rank NCCL world")
def test_two_ranks_all_to_all_block_makes_no_synchronising_cuda_call():
    for checked in run_world(_no_sync_world, 2, backend="nccl", timeout_s=120):
        assert checked == [("dedup", "all_to_all", True, 2), ("per_expert", "all_to_all", True, 2), ("dedup", "padded", True, 2)]
