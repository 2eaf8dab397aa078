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

import functools
import os
import random
import tempfile
from types import SimpleNamespace

import pytest
import torch
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

import occult_hf  # noqa: F401  (registers the adapters)
from occult_hf.config import OccultConfig
from occult_hf.dispatch.plan import destinations
from occult_hf.hf.apply import apply_occult
from occult_hf.moe import OccultMoE
from occult_hf.patches import adapter_for
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile
from occult_hf.pruning import CollaborationPruner, pruners_of, token_device_sets, token_device_sets_replicated

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


def literal_walk(ids, weights, homes, limit, within=None):
    """The walk, one token at a time: experts by (descending weight, lowest home); an expert is served when one of
    its homes (those in `within`, when given) is held; else, while fewer than `limit` are held, it adds its home on
    a unit one of the token's single-home experts uses (the best-weighted one), else its lowest. `homes[e]`: expert
    e's units (devices or nodes), increasing; without replicas one each."""
    homes_j = [[h for h in homes[e] if within is None or h in within] for e in ids]
    used = {}
    for options, weight in zip(homes_j, weights):
        if len(options) == 1:
            used[options[0]] = max(used.get(options[0], float("-inf")), weight)
    kept = []
    for j in sorted((j for j in range(len(ids)) if homes_j[j]), key=lambda j: (-weights[j], homes_j[j][0])):
        if any(h in kept for h in homes_j[j]) or len(kept) >= limit:
            continue
        scored = [h for h in homes_j[j] if h in used]
        kept.append(max(scored, key=lambda h: (used[h], -h)) if scored else homes_j[j][0])
    return sorted(kept)


def test_node_and_device_walks_match_the_literal_two_stage_walk():
    generator = torch.Generator().manual_seed(0)
    device_of_E = torch.tensor([d for d in range(NUM_DEVICES) for _ in range(2)])[torch.randperm(NUM_EXPERTS, generator=generator)]
    node_of_E = device_of_E // PER_NODE
    ids_Tk = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(200)])
    weights_Tk = torch.randint(1, 4, (200, TOP_K), generator=generator).float()  # ties on purpose
    device_homes, node_homes = [[d] for d in device_of_E.tolist()], [[n] for n in node_of_E.tolist()]
    for n_n, n_d in [(1, 2), (2, 1), (2, 3), (3, 2)]:
        nodes_TQ = token_device_sets(ids_Tk, weights_Tk, node_of_E, NUM_DEVICES // PER_NODE, n_n)
        within_TD = nodes_TQ.repeat_interleave(PER_NODE, dim=1)
        devices_TD = token_device_sets(ids_Tk, weights_Tk, device_of_E, NUM_DEVICES, n_d, within_TD)
        for t in range(200):
            ids, weights = ids_Tk[t].tolist(), weights_Tk[t].tolist()
            nodes = literal_walk(ids, weights, node_homes, n_n)
            assert nodes_TQ[t].nonzero().flatten().tolist() == nodes
            within = {d for d in range(NUM_DEVICES) if d // PER_NODE in nodes}
            assert devices_TD[t].nonzero().flatten().tolist() == literal_walk(ids, weights, device_homes, n_d, within)


# ----- both limits: the device walk on the node-limited routing --------------------------------------------
#: the review's case: E=8 (capacities 3, 1, 2, 2), k=3, 2 nodes of 2 devices, N_d=2, N_n=1; the replicas put
#: experts 1 and 6 on the other node too
SHORT = dict(num_experts=8, top_k=3)
SHORT_DEVICE_OF_E, SHORT_REPLICAS, SHORT_LIMITS = [0, 0, 0, 1, 2, 2, 3, 3], {1: [2], 6: [1]}, dict(n_d=2, n_n=1)


def short_placement(replicas: bool) -> Placement:
    layers = {layer: list(SHORT_DEVICE_OF_E) for layer in MOE_LAYERS["olmoe"]}
    extra = {layer: SHORT_REPLICAS for layer in layers} if replicas else {}
    return Placement(8, 4, layers, replicas=extra, devices_per_node=PER_NODE)


def literal_policy(mode, ids, weights, probs, allowed, similarity, top_k, normalize):
    """One token's pruned `{expert: weight}` by the policy's definition, among the `allowed` experts."""
    if all(e in allowed for e in ids):
        return dict(zip(ids, weights))
    if mode == "router":  # OLMoE's rule: softmax over all E, the top-k of the allowed probabilities
        chosen = sorted(allowed, key=lambda e: (-probs[e], e))[:top_k]
        total = sum(probs[e] for e in chosen) if normalize else 1.0
        return {e: probs[e] / total for e in chosen}
    kept = list(ids)  # similarity: heaviest slot first, the most similar unused allowed expert (lower id on ties)
    for j in sorted(range(len(ids)), key=lambda j: (-weights[j], j)):
        if ids[j] not in allowed:
            candidates = [e for e in sorted(allowed) if e not in ids and e not in kept]
            kept[j] = max(candidates, key=lambda e: (similarity[ids[j]][e], -e))
    return dict(zip(kept, weights))


def literal_prune(mode, ids, weights, probs, homes, similarity, top_k, normalize):
    """Steps 1-3 of docs/pruning.md for one token under both limits: `(devices, {expert: weight}, short)`; `short`:
    the devices a walk over the token's own experts on its nodes would keep hold fewer than k experts."""
    node_homes = [sorted({h // PER_NODE for h in options}) for options in homes]
    nodes = literal_walk(ids, weights, node_homes, SHORT_LIMITS["n_n"])
    within = {d for d in range(4) if d // PER_NODE in nodes}
    experts_on = lambda devices: {e for e, options in enumerate(homes) if any(h in devices for h in options)}
    node_limited = literal_policy(mode, ids, weights, probs, experts_on(within), similarity, top_k, normalize)
    devices = literal_walk(list(node_limited), list(node_limited.values()), homes, SHORT_LIMITS["n_d"], within)
    own_walk = literal_walk(ids, weights, homes, SHORT_LIMITS["n_d"], within)
    pruned = literal_policy(mode, ids, weights, probs, experts_on(devices), similarity, top_k, normalize)
    return devices, pruned, len(experts_on(own_walk)) < top_k


@pytest.mark.parametrize("replicas", [False, True])
@pytest.mark.parametrize("mode", ["router", "similarity"])
def test_both_limits_match_a_literal_pruner_and_leave_no_token_short(mode, replicas):
    """The pruner under N_d and N_n, token by token, against `literal_prune` on the review's case, which includes
    tokens whose own experts on their node would leave them fewer than k (the forward used to fail there in router
    mode, and similarity mode to pick expert 0); then the model trains through it."""
    model = tiny_model("olmoe", **SHORT).train()
    adapter = adapter_for(model)
    similarity_EE = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    placement = short_placement(replicas)
    layer, _, block = next(adapter.iter_moe_blocks(model))
    layout = placement.layout(layer)
    pruner = CollaborationPruner(
        mode, adapter, layout, 3, SHORT_LIMITS["n_d"], similarity_EE if mode == "similarity" else None,
        max_nodes_per_token=SHORT_LIMITS["n_n"], devices_per_node=PER_NODE,
    )  # fmt: skip
    routing = adapter.route(block, torch.randn(256, 32, generator=torch.Generator().manual_seed(6)))
    pruned = pruner.route(block, routing)
    homes = placement.homes(layer)
    probs_TE = routing.logits_TE.softmax(-1).tolist()
    short = 0
    for t in range(256):
        ids, weights = routing.topk_ids_Tk[t].tolist(), routing.topk_weights_Tk[t].tolist()
        devices, expected, was_short = literal_prune(mode, ids, weights, probs_TE[t], homes, similarity_EE.tolist(), 3, model.config.norm_topk_prob)
        got = dict(zip(pruned.topk_ids_Tk[t].tolist(), pruned.topk_weights_Tk[t].tolist()))
        assert got.keys() == expected.keys(), (t, got, expected)
        assert all(abs(got[e] - expected[e]) <= 1e-6 for e in got), (t, got, expected)
        if replicas:
            assert pruned.devices_TD[t].nonzero().flatten().tolist() == devices, t
        short += was_short
    assert short > 0  # the case the review found is among these tokens

    config = OccultConfig(placement=placement, prune=mode, max_devices_per_token=SHORT_LIMITS["n_d"],
                          max_nodes_per_token=SHORT_LIMITS["n_n"], profile=short_profile() if mode == "similarity" else None)  # fmt: skip
    occult_model = apply_occult(tiny_model("olmoe", **SHORT).train(), config)
    input_ids = tiny_batch(batch=4, seq=16, seed=3)
    occult_model(input_ids=input_ids, labels=input_ids).loss.backward()
    for module in (m for m in occult_model.modules() if isinstance(m, OccultMoE)):
        dest_Tk = module.dispatcher.last_destinations_Tk  # the devices that served the pairs, replicas included
        served_TD = torch.zeros(dest_Tk.shape[0], 4, dtype=torch.bool).scatter_(1, dest_Tk, True)
        assert int(served_TD.sum(1).max()) <= 2 and int(served_TD.view(-1, 2, PER_NODE).any(-1).sum(1).max()) == 1
        assert module.pruner.pop_stats()["pruned_token_fraction"] > 0


@functools.lru_cache(maxsize=1)
def short_profile() -> str:
    """A routing profile of the E=8, k=3 tiny OLMoE (similarity pruning reads one), in a temporary folder."""
    path = os.path.join(tempfile.mkdtemp(prefix="occult_node_pruning_"), "olmoe_e8k3.safetensors")
    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    RoutingProfile.collect(tiny_model("olmoe", **SHORT), documents, progress=False).save(path)
    return path


def test_accepted_settings_never_leave_a_token_short():
    """Random placements (2 or 3 experts a device, one moved: uneven; replicas on another device in every other
    trial), node layouts, k, N_n (at most half the nodes) and N_d (2..k): every setting the pruner accepts gives each
    token k distinct experts on at most N_n nodes and N_d devices, in both modes (about a third of the accepted
    settings left some token short before the device walk ran on the node-limited routing)."""
    rng = random.Random(0)
    models = {}
    accepted = 0
    for trial in range(60):
        num_devices, top_k, per_device = rng.choice([4, 6, 8]), rng.choice([3, 4]), rng.choice([2, 3])
        per_node = rng.choice([g for g in (1, 2, 3, 4) if num_devices % g == 0 and g < num_devices])
        num_experts = per_device * num_devices
        if (num_experts, top_k) not in models:
            model = tiny_model("olmoe", num_experts=num_experts, top_k=top_k)
            models[num_experts, top_k] = (adapter_for(model), *next(adapter_for(model).iter_moe_blocks(model)))
        adapter, layer, _, block = models[num_experts, top_k]
        device_of_E = [e % num_devices for e in range(num_experts)]
        rng.shuffle(device_of_E)
        device_of_E[rng.randrange(num_experts)] = rng.randrange(num_devices)
        replicas = {e: [(device_of_E[e] + rng.randrange(1, num_devices)) % num_devices] for e in rng.sample(range(num_experts), 3)}
        placement = Placement(num_experts, num_devices, {layer: device_of_E}, replicas={layer: replicas} if trial % 2 else {})
        layout = placement.layout(layer)
        n_n, n_d = rng.randint(1, max(1, num_devices // per_node // 2)), rng.randint(2, top_k)
        for mode in ("router", "similarity"):
            try:
                pruner = CollaborationPruner(
                    mode, adapter, layout, top_k, n_d, torch.randn(num_experts, num_experts) if mode == "similarity" else None,
                    max_nodes_per_token=n_n, devices_per_node=per_node,
                )  # fmt: skip
            except ValueError as error:  # the checks of docs/pruning.md's table
                assert "fewer than top_k" in str(error), error
                continue
            accepted += 1
            where = (trial, mode, device_of_E, per_node, n_n, n_d)
            routing = adapter.route(block, torch.randn(64, 32, generator=torch.Generator().manual_seed(trial)))
            pruned = pruner.route(block, routing)
            ids_Tk = pruned.topk_ids_Tk.sort(1).values
            assert bool((ids_Tk[:, 1:] != ids_Tk[:, :-1]).all()), where
            dest_Tk, _ = destinations(pruned.topk_ids_Tk, layout, devices_TD=pruned.devices_TD)  # replicas: the serving home
            if pruned.devices_TD is not None:
                assert bool(pruned.devices_TD.gather(1, dest_Tk).all()), where
            served_TD = torch.zeros(64, num_devices, dtype=torch.bool).scatter_(1, dest_Tk, True)
            assert int(served_TD.sum(1).max()) <= max(n_d, min(top_k, num_devices)), where
            assert int(served_TD.view(64, -1, per_node).any(-1).sum(1).max()) <= n_n, where
    assert accepted >= 60, accepted


def test_zero_tokens():
    """A batch without tokens (a rank that gets none): every walk, and the pruner in both modes, with replicas."""
    empty_ids, empty_weights = torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3)
    home_table_EM = short_placement(replicas=True).layout(MOE_LAYERS["olmoe"][0]).home_table_EM
    within_TD = torch.zeros(0, 4, dtype=torch.bool)
    assert token_device_sets(empty_ids, empty_weights, home_table_EM[:, 0], 4, 2, within_TD).shape == (0, 4)
    assert token_device_sets_replicated(empty_ids, empty_weights, home_table_EM, 4, 2, within_TD).shape == (0, 4)
    model = tiny_model("olmoe", **SHORT)
    adapter = adapter_for(model)
    layer, _, block = next(adapter.iter_moe_blocks(model))
    for mode in ("router", "similarity"):
        pruner = CollaborationPruner(
            mode, adapter, short_placement(replicas=True).layout(layer), 3, 2, torch.eye(8) if mode == "similarity" else None,
            max_nodes_per_token=1, devices_per_node=PER_NODE,
        )  # fmt: skip
        pruned = pruner.route(block, adapter.route(block, torch.zeros(0, 32)))
        assert pruned.topk_ids_Tk.shape == (0, 3) and pruned.devices_TD.shape == (0, 4), mode
        assert pruner.pop_stats()["tokens"] == 0


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
    with pytest.raises(ValueError, match="OccultConfig.devices_per_node=3 does not divide num_devices=8"):
        OccultConfig(num_devices=8, devices_per_node=3)
    flat = Placement(NUM_EXPERTS, NUM_DEVICES, {l: shuffled_placement("olmoe").device_of(l) for l in MOE_LAYERS["olmoe"]})
    with pytest.raises(ValueError, match="max_nodes_per_token=1 needs a node layout"):
        apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(placement=flat, prune="router", max_nodes_per_token=1))
    with pytest.raises(ValueError, match=r"max_nodes_per_token \(N_n\) must be an integer in \[1, num_nodes=4\], got 5"):
        apply_occult(tiny_model("olmoe", **SIZES), config_for("olmoe", "router", profiles, n_n=5))
    # an explicit layout in the config serves a placement that records none
    model = apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(placement=flat, prune="router", max_nodes_per_token=2, devices_per_node=4))
    assert {p.num_nodes for p in pruners_of(model).values()} == {2}
