"""Node-limited pruning (issue 35): `OccultConfig.max_nodes_per_token`, DeepSeek-V3's node-limited routing
brought to every family, alone or beside `max_devices_per_token`, with the callback's schedule.

- The node walk is the device walk over nodes (`token_device_sets` on `device // G`), and with both limits the
  device walk runs among the devices of the chosen nodes: against a literal two-stage walk.
- Every family, both policies, D=8 on 4 nodes of 2 (E=16, k=4): no dispatched token uses more than N_n nodes
  (and N_d devices where set), pruning removed routing weight, the router still gets gradients; N_n >= min(k,
  nodes) is the stock transformers model (logits, loss, every gradient).
- Replicas: a pair goes to a home on the token's nodes.
- The callback tightens N_n on its schedule; bad settings are clear errors.
Under EP on gloo ranks as several nodes: tests/test_hierarchical_dispatch.py.

Shape legend (docs/conventions.md): T tokens, k experts per token, D devices; local to this file: Q nodes.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

import occult_hf  # noqa: F401  (registers the adapters)
from occult_hf.config import OccultConfig
from occult_hf.hf.apply import apply_occult
from occult_hf.moe import OccultMoE
from occult_hf.patches import adapter_for
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile
from occult_hf.pruning import pruners_of, token_device_sets

NUM_EXPERTS, TOP_K, NUM_DEVICES, PER_NODE = 16, 4, 8, 2
SIZES = dict(num_experts=NUM_EXPERTS, top_k=TOP_K)
RTOL = 1e-5


def shuffled_placement(family: str, replicas: bool = False) -> Placement:
    order = list(range(NUM_EXPERTS))
    random.Random(11).shuffle(order)
    device_of_E = [0] * NUM_EXPERTS
    for position, expert in enumerate(order):
        device_of_E[expert] = position * NUM_DEVICES // NUM_EXPERTS
    layers = {layer: list(device_of_E) for layer in MOE_LAYERS[family]}
    extra = {layer: {e: [(device_of_E[e] + 3) % NUM_DEVICES] for e in range(4)} for layer in layers} if replicas else {}
    return Placement(NUM_EXPERTS, NUM_DEVICES, layers, replicas=extra, devices_per_node=PER_NODE)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
            path = tmp_path_factory.mktemp("profiles") / f"{family}.safetensors"
            RoutingProfile.collect(tiny_model(family, **SIZES), documents, progress=False).save(path)
            cache[family] = str(path)
        return cache[family]

    return get


def config_for(family, mode, profiles, n_n=None, n_d=None, replicas=False) -> OccultConfig:
    return OccultConfig(
        placement=shuffled_placement(family, replicas), prune=mode, max_nodes_per_token=n_n, max_devices_per_token=n_d,
        profile=profiles(family) if mode == "similarity" else None,
    )  # fmt: skip


def literal_walk(ids, weights, unit_of_E, limit, allowed=None):
    """Experts by (descending weight, unit id), the first `limit` distinct units (among `allowed`)."""
    order = sorted(range(len(ids)), key=lambda j: (-weights[j], unit_of_E[ids[j]]))
    kept = []
    for j in order:
        unit = unit_of_E[ids[j]]
        if allowed is not None and unit not in allowed:
            continue
        if unit not in kept and len(kept) < limit:
            kept.append(unit)
    return sorted(kept)


def test_node_and_device_walks_match_the_literal_two_stage_walk():
    generator = torch.Generator().manual_seed(0)
    device_of_E = torch.tensor([d for d in range(NUM_DEVICES) for _ in range(2)])[torch.randperm(NUM_EXPERTS, generator=generator)]
    node_of_E = device_of_E // PER_NODE
    ids_Tk = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(200)])
    weights_Tk = torch.randint(1, 4, (200, TOP_K), generator=generator).float()  # ties on purpose
    for n_n, n_d in [(1, 2), (2, 1), (2, 3), (3, 2)]:
        nodes_TQ = token_device_sets(ids_Tk, weights_Tk, node_of_E, NUM_DEVICES // PER_NODE, n_n)
        within_TD = nodes_TQ.repeat_interleave(PER_NODE, dim=1)
        devices_TD = token_device_sets(ids_Tk, weights_Tk, device_of_E, NUM_DEVICES, n_d, within_TD)
        for t in range(200):
            ids, weights = ids_Tk[t].tolist(), weights_Tk[t].tolist()
            nodes = literal_walk(ids, weights, node_of_E.tolist(), n_n)
            assert nodes_TQ[t].nonzero().flatten().tolist() == nodes
            allowed = {d for d in range(NUM_DEVICES) if d // PER_NODE in nodes}
            assert devices_TD[t].nonzero().flatten().tolist() == literal_walk(ids, weights, device_of_E.tolist(), n_d, allowed)


def nodes_per_token(block: OccultMoE) -> torch.Tensor:
    device_Tk = block.layout.device_of_E[block.last_topk_ids_Tk] // PER_NODE
    return torch.zeros(device_Tk.shape[0], NUM_DEVICES // PER_NODE, dtype=torch.bool).scatter_(1, device_Tk, True).sum(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_routing_respects_the_node_limit(family, profiles):
    input_ids = tiny_batch(batch=2, seq=16, seed=1)
    for mode in ("router", "similarity"):
        for n_n, n_d in [(1, None), (2, 3)]:
            model = apply_occult(tiny_model(family, **SIZES).train(), config_for(family, mode, profiles, n_n, n_d))
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            for block in (m for m in model.modules() if isinstance(m, OccultMoE)):
                assert int(nodes_per_token(block).max()) <= n_n, (mode, n_n, block.layer_idx)
                if n_d is not None:
                    device_Tk = block.layout.device_of_E[block.last_topk_ids_Tk]
                    used_TD = torch.zeros(device_Tk.shape[0], NUM_DEVICES, dtype=torch.bool).scatter_(1, device_Tk, True)
                    assert int(used_TD.sum(1).max()) <= n_d
                stats = block.pruner.pop_stats()
                assert stats["pruned_token_fraction"] > 0 and 0 < stats["removed_weight_fraction"] < 1
                router_grad = adapter_for(model).router(block.original_block).weight.grad
                assert router_grad is not None and router_grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_node_limit_covering_top_k_is_the_unpruned_model(family, profiles):
    input_ids = tiny_batch(batch=2, seq=16, seed=2)
    reference = tiny_model(family, **SIZES).train()
    out_ref = reference(input_ids=input_ids, labels=input_ids)
    out_ref.loss.backward()
    model = apply_occult(tiny_model(family, **SIZES).train(), config_for(family, "router", profiles, n_n=4))
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    assert not any(p.active for p in pruners_of(model).values())
    for actual, expected in ((out.logits.detach(), out_ref.logits.detach()), (out.loss.detach(), out_ref.loss.detach())):
        assert float((actual - expected).abs().max() / expected.abs().max()) <= RTOL
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if name in ref_grads and param.grad is not None and ref_grads[name].grad is not None and ".experts." not in name:
            assert float((param.grad - ref_grads[name].grad).abs().max() / ref_grads[name].grad.abs().max().clamp_min(1e-30)) <= RTOL, name


def test_with_replicas_every_pair_stays_on_the_tokens_nodes(profiles):
    from occult_hf.dispatch.plan import destinations

    model = apply_occult(tiny_model("olmoe", **SIZES).train(), config_for("olmoe", "router", profiles, n_n=1, replicas=True))
    block = next(m for m in model.modules() if isinstance(m, OccultMoE))
    routing = adapter_for(model).route(block.original_block, torch.randn(64, 32, generator=torch.Generator().manual_seed(3)))
    pruned = block.pruner.route(block.original_block, routing)
    dest_Tk, _ = destinations(pruned.topk_ids_Tk, block.layout.to("cpu"), devices_TD=pruned.devices_TD)
    assert bool(pruned.devices_TD.gather(1, dest_Tk).all())
    node_Tk = dest_Tk // PER_NODE
    assert int(torch.zeros(64, NUM_DEVICES // PER_NODE, dtype=torch.bool).scatter_(1, node_Tk, True).sum(1).max()) == 1


def test_the_callback_tightens_the_node_limit_on_its_schedule(profiles):
    from occult_hf.hf.callback import OccultCallback

    model = apply_occult(tiny_model("olmoe", **SIZES).train(), config_for("olmoe", "router", profiles, n_n=1))
    callback = OccultCallback(schedule_steps=4)
    callback.on_train_begin(None, SimpleNamespace(global_step=0), None, model=model)
    seen = []
    for step in range(6):
        callback.on_step_begin(None, SimpleNamespace(global_step=step), None)
        seen.append({p.max_nodes_per_token for p in pruners_of(model).values()})
    assert seen == [{4}, {4}, {3}, {2}, {1}, {1}] and callback.schedule is None
    callback.on_train_end(None, None, None)


def test_bad_node_settings_are_clear_errors(profiles):
    with pytest.raises(ValueError, match="max_nodes_per_token=1 is set but prune is None"):
        OccultConfig(max_nodes_per_token=1)
    with pytest.raises(ValueError, match=r"devices_per_node \(3\) must divide num_devices \(8\)"):
        OccultConfig(num_devices=8, devices_per_node=3)
    flat = Placement(NUM_EXPERTS, NUM_DEVICES, {l: shuffled_placement("olmoe").device_of(l) for l in MOE_LAYERS["olmoe"]})
    with pytest.raises(ValueError, match="max_nodes_per_token=1 needs a node layout"):
        apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(placement=flat, prune="router", max_nodes_per_token=1))
    with pytest.raises(ValueError, match=r"max_nodes_per_token \(N_n\) must be an integer in \[1, num_nodes=4\], got 5"):
        apply_occult(tiny_model("olmoe", **SIZES), config_for("olmoe", "router", profiles, n_n=5))
    # an explicit layout in the config serves a placement that records none
    model = apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(placement=flat, prune="router", max_nodes_per_token=2, devices_per_node=4))
    assert {p.num_nodes for p in pruners_of(model).values()} == {2}
