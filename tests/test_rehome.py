"""`apply_replicas`: re-planned replicas put into a running model (the runtime half of `occult replan`).

One process (logical devices, two families) and a 2-rank gloo world (one family): the model's outputs do not change
when its copies move, each rank then holds exactly its new homes, every new copy equals the expert's
weights bit for bit (copied from its primary holder), the rows sent follow the new homes, and a
training step still gives every holder of a copy the same gradient; bad placements are clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run_world
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

FAMILIES_CHECKED = FAMILIES[:2]


def _placements(family: str, num_experts: int = 8, num_devices: int = 2):
    """(deployed, re-planned): the same shuffled primaries; copies of experts 0, 1, then of experts 5, 6."""
    from occult_hf import Placement

    base = np.arange(num_experts) * num_devices // num_experts
    maps = {layer: np.random.default_rng(layer).permutation(base).tolist() for layer in MOE_LAYERS[family]}

    def with_copies(experts, pin_slack):
        replicas = {layer: {e: [(maps[layer][e] + 1) % num_devices] for e in experts} for layer in maps}
        return Placement(num_experts, num_devices, maps, {"method": "replicated"}, replicas=replicas, pin_slack=pin_slack)

    # the re-planned placement states its own pin slack for the load-aware rule: the rebuilt dispatchers take it
    return with_copies([0, 1], {}), with_copies([5, 6], {layer: 0.0 for layer in maps})


def _rows_under_rule(module, placement, num_devices):
    from occult_hf.replicas.routing import resolve_homes

    ids = module.last_topk_ids_Tk.cpu()
    dest = resolve_homes(ids, torch.from_numpy(placement.home_table(module.layer_idx)), num_devices)
    return int(torch.zeros(ids.shape[0], num_devices, dtype=torch.bool).scatter_(1, dest, True).sum())


def _check(family: str, rank: int, distributed: bool) -> None:
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules, reset_counters
    from occult_hf.hf.rehome import apply_replicas

    deployed, replanned = _placements(family)
    where = f"[{family} rank {rank}]"
    model = tiny_model(family, seed=3, num_experts=8).eval()
    vanilla = tiny_model(family, seed=3, num_experts=8)
    apply_occult(model, OccultConfig(placement=deployed, num_devices=None if distributed else 2))
    ids = tiny_batch(seed=40 + rank)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    if distributed:  # a backward before the re-homing: the old copies' device-side index tables get made
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
    apply_replicas(model, replanned)
    reset_counters(model)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert float((after - before).abs().max() / before.abs().max()) <= 1e-5, f"{where} outputs changed"
    assert model.config.occult_config["placement"]["replicas"] == replanned.to_dict()["replicas"]
    for path, module in occult_modules(model).items():
        assert int(module.stats.rows_sent.sum()) == _rows_under_rule(module, replanned, 2), f"{where} rows of {path}"
        assert module.dispatcher.layout.pin_slack == replanned.pin_slack_of(module.layer_idx) == 0.0, f"{where} pin slack of {path}"
        if not distributed:
            continue
        experts = module.local_experts
        local = experts.expert_ids.tolist()
        assert local == replanned.experts_on(module.layer_idx, rank), f"{where} homes of {path}"
        full_gate_up, _ = module.adapter.expert_weights(vanilla.get_submodule(path))
        assert torch.equal(experts.gate_up_proj.detach(), full_gate_up[local].detach()), f"{where} weights of {path}"
    if distributed:  # a training step: the re-homed copies still get the summed gradient (same on every holder)
        import torch.distributed as dist

        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        for path, module in occult_modules(model).items():
            local = module.local_experts.expert_ids.tolist()
            grad = module.local_experts.gate_up_proj.grad
            for expert in (5, 6):
                mine = grad[local.index(expert)] if expert in local else torch.zeros_like(grad[0])
                both = mine.clone()
                dist.all_reduce(both)
                assert torch.allclose(both, 2 * mine, rtol=1e-6, atol=1e-9), f"{where} copy gradients of {path}"


def _world(rank, world_size):
    _check(FAMILIES_CHECKED[0], rank, distributed=True)
    return True


@pytest.mark.world_size(2)
def test_apply_replicas_on_2_ranks_keeps_outputs_and_copies_weights():
    assert all(run_world(_world, 2))


@pytest.mark.parametrize("family", FAMILIES_CHECKED)
def test_apply_replicas_in_one_process_and_errors(family):
    from occult_hf import OccultConfig, Placement
    from occult_hf.hf.apply import apply_occult
    from occult_hf.hf.rehome import apply_replicas

    _check(family, 0, distributed=False)
    deployed, _ = _placements(family)
    model = apply_occult(tiny_model(family, seed=3, num_experts=8), OccultConfig(placement=deployed))
    layers = MOE_LAYERS[family]
    moved = Placement(8, 2, {layer: [1 - d for d in deployed.device_of(layer)] for layer in layers})
    with pytest.raises(ValueError, match="primary homes of layers"):
        apply_replicas(model, moved)
    with pytest.raises(ValueError, match="num_experts=8, num_devices=4"):
        apply_replicas(model, Placement.contiguous(8, 4, layers))
