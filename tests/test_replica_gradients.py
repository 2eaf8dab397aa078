"""The copies of a replicated expert keep the same gradient bits, and so the same weights, through training.

Every expert has a copy on every rank; DDP, AdamW, 3 steps. Before, each holder added the other copies' part of
the gradient to its own, a sum every rank rounded differently: with 3 homes (fp32) or 2 micro-batches (bf16) the
copies' gradients differed by rounding (4.7e-10 / 3.1e-5) and their weights drifted apart (1.1e-7 / 1.2e-3 after 3
steps), so a pair's output depended on which copy served it. Now every holder adds the same all-reduced sum to the
same earlier gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

from distributed import run_world
from tiny_models import MOE_LAYERS, tiny_batch, tiny_model

NUM_EXPERTS, STEPS = 8, 3


def _copies_spread(rank, world_size, dtype_name, micro_batches):
    """Per step and layer: the largest difference between ranks of the local experts' gradients and weights (every
    rank holds every expert, in the same slot order)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from occult_hf import OccultConfig, Placement, apply_occult
    from occult_hf.hf.apply import occult_modules

    layers = MOE_LAYERS["olmoe"]
    primary = (np.arange(NUM_EXPERTS) * world_size // NUM_EXPERTS).tolist()
    everywhere = {layer: {e: [d for d in range(world_size) if d != primary[e]] for e in range(NUM_EXPERTS)} for layer in layers}
    placement = Placement(NUM_EXPERTS, world_size, {layer: list(primary) for layer in layers}, {}, replicas=everywhere)
    model = tiny_model("olmoe", seed=3, num_experts=NUM_EXPERTS).to(getattr(torch, dtype_name)).train()
    apply_occult(model, OccultConfig(placement=placement))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spreads = []
    for step in range(STEPS):
        for micro in range(micro_batches):
            ids = tiny_batch(seed=500 + rank + 10 * step + 100 * micro)
            ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        for path, module in occult_modules(model).items():
            experts = module.local_experts
            for name, tensor in (("grad", experts.gate_up_proj.grad), ("weight", experts.gate_up_proj.detach())):
                gathered = [torch.empty_like(tensor) for _ in range(world_size)]
                dist.all_gather(gathered, tensor.contiguous())
                spreads.append((step, path, name, max(float((gathered[0] - other).abs().max()) for other in gathered)))
        optimizer.zero_grad()
    return spreads


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size, dtype_name, micro_batches", [(3, "float32", 1), (2, "bfloat16", 2)])
def test_copies_of_replicated_experts_stay_identical(world_size, dtype_name, micro_batches):
    for rank, spreads in enumerate(run_world(_copies_spread, world_size, dtype_name, micro_batches, timeout_s=300)):
        assert len(spreads) == STEPS * len(MOE_LAYERS["olmoe"]) * 2
        assert [entry for entry in spreads if entry[3] != 0.0] == [], (rank, spreads)


def _expert_grads(rank, world_size, how):
    """The local experts' gradients of one backward, every expert held on every rank, taken in way `how`."""
    import torch

    from occult_hf import OccultConfig, Placement, apply_occult
    from occult_hf.hf.apply import occult_modules

    layers = MOE_LAYERS["olmoe"]
    primary = (np.arange(NUM_EXPERTS) * world_size // NUM_EXPERTS).tolist()
    everywhere = {layer: {e: [d for d in range(world_size) if d != primary[e]] for e in range(NUM_EXPERTS)} for layer in layers}
    placement = Placement(NUM_EXPERTS, world_size, {layer: list(primary) for layer in layers}, {}, replicas=everywhere)
    model = apply_occult(tiny_model("olmoe", seed=3, num_experts=NUM_EXPERTS).train(), OccultConfig(placement=placement))
    modules = list(occult_modules(model).values())
    weights = [w for module in modules for w in (module.local_experts.gate_up_proj, module.local_experts.down_proj)]
    ids = tiny_batch(seed=500 + rank)
    if how == "frozen carrier, compiled":
        for module in modules:
            module.ep_grad_norm_carrier.requires_grad_(False)
        model = torch.compile(model, backend="aot_eager")
    if how == "after autograd.grad":  # fills no .grad, and leaves nothing behind for the next backward
        torch.autograd.grad(model(input_ids=ids, labels=ids).loss, weights)
        assert all(weight.grad is None for weight in weights)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(inputs=weights) if how == "backward(inputs=)" else loss.backward()
    return [weight.grad.numpy().copy() for weight in weights]


@pytest.mark.parametrize("how", ["backward(inputs=)", "frozen carrier, compiled", "after autograd.grad"])
def test_copies_get_the_whole_gradient_without_the_grad_norm_carrier(how):
    """The copies' gradients are summed over the ranks also in a backward that gives the grad-norm carrier no
    gradient (its hook is what started the sum): before, the replicated slots kept a zero gradient, silently. An
    `autograd.grad` first leaves no `.grad` and nothing for the next backward to add."""
    plain = run_world(_expert_grads, 2, "plain", timeout_s=300)
    taken = run_world(_expert_grads, 2, how, timeout_s=300)
    for rank in range(2):
        assert all(np.abs(grad).max() > 0 for grad in plain[rank])
        for expected, got in zip(plain[rank], taken[rank]):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
