"""Collaboration pruning (docs/design.md §4) on tiny random models of every supported family.

What each group of tests pins down:
- `token_device_sets`: the walk in descending weight with ties to the lower device id, against a
  literal Python walk on random routing and on hand-made ties.
- `prune_similarity`: the replacement rule (most similar unused expert inside, heaviest dropped
  expert picks first, lower id on equal similarity, weights kept) on a hand-checkable case.
- Every family x both policies x N_d in {1, 2} at D=4 (E=16, k=4, a shuffled placement so that
  DeepSeek groups and devices do not coincide): no dispatched token (`OccultMoE.last_topk_ids_Tk`)
  uses more than N_d devices, pruning actually changed tokens, the router still gets gradients.
- N_d = min(k, D) equals the stock transformers model (logits, loss, every gradient; fp32 <= 1e-5).
- The auxiliary loss sees the dispatched routing (top-k of the recorded router logits = dispatched).
- 2-rank gloo EP: pruned forward and gradients equal one process with the same 2 logical devices,
  also with replicated experts.
- Replicas (`token_device_sets_replicated`): the literal walk where an expert is served by any held
  home and a new home is one the token uses anyway; without replicas it is `token_device_sets`; the
  pruned routing's pairs, dispatched by the replica rule on the token's devices, span at most N_d.
- Bad input: N_d < 1 or > D, too few experts on N_d devices, similarity without a profile, a
  profile of another model (expert count, top-k, layers, model type).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from distributed import run_world
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

import occult_hf  # noqa: F401  (registers the adapters)
from occult_hf.config import OccultConfig
from occult_hf.hf.apply import apply_occult, occult_modules
from occult_hf.moe import OccultMoE
from occult_hf.patches import adapter_for
from occult_hf.patches.base import RouterOutput
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile
from occult_hf.pruning import (
    CollaborationPruner,
    build_pruner,
    load_pruning_profile,
    prune_similarity,
    pruners_of,
    token_device_sets,
    token_device_sets_replicated,
)

NUM_EXPERTS, TOP_K, NUM_DEVICES = 16, 4, 4
SIZES = dict(num_experts=NUM_EXPERTS, top_k=TOP_K)
MODES = ("router", "similarity")
RTOL = 1e-5


def shuffled_placement(family: str, num_devices: int = NUM_DEVICES) -> Placement:
    """Experts dealt to devices in a fixed shuffled order (each device holds E / D experts)."""
    order = list(range(NUM_EXPERTS))
    random.Random(7).shuffle(order)
    device_of_E = [0] * NUM_EXPERTS
    for position, expert in enumerate(order):
        device_of_E[expert] = position * num_devices // NUM_EXPERTS
    return Placement(NUM_EXPERTS, num_devices, {layer: list(device_of_E) for layer in MOE_LAYERS[family]})


@pytest.fixture(scope="session")
def profile_paths(tmp_path_factory):
    """A routing profile per family (with router-logit Gram matrices), collected from the tiny model."""
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
            profile = RoutingProfile.collect(tiny_model(family, **SIZES), documents, progress=False)
            path = tmp_path_factory.mktemp("profiles") / f"{family}.safetensors"
            profile.save(path)
            cache[family] = str(path)
        return cache[family]

    return get


def pruned_config(family: str, mode: str, n_d: int, profile_paths, num_devices: int = NUM_DEVICES) -> OccultConfig:
    return OccultConfig(
        placement=shuffled_placement(family, num_devices),
        prune=mode,
        max_devices_per_token=n_d,
        profile=profile_paths(family) if mode == "similarity" else None,
    )


def devices_per_token(module: OccultMoE) -> torch.Tensor:
    """`[T]` distinct devices of each token's dispatched experts."""
    device_Tk = module.layout.device_of_E[module.last_topk_ids_Tk]
    hits_TD = torch.zeros(device_Tk.shape[0], module.ep.num_devices, dtype=torch.bool)
    return hits_TD.scatter_(1, device_Tk, True).sum(1)


# ----- the device set of a token -------------------------------------------------------------------


def literal_walk(ids, weights, device_of_E, n_d):
    """The definition, one token at a time: experts by (descending weight, device id), first N_d devices."""
    order = sorted(range(len(ids)), key=lambda j: (-weights[j], device_of_E[ids[j]]))
    kept = []
    for j in order:
        device = device_of_E[ids[j]]
        if device not in kept and len(kept) < n_d:
            kept.append(device)
    return sorted(kept)


def test_token_device_sets_match_the_literal_walk():
    generator = torch.Generator().manual_seed(0)
    device_of_E = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 2, 3])
    ids_Tk = torch.stack([torch.randperm(12, generator=generator)[:5] for _ in range(200)])
    # weights on a coarse grid so that ties between experts (and between devices) are frequent
    weights_Tk = torch.randint(1, 4, (200, 5), generator=generator).float() / 4
    for n_d in (1, 2, 3, 4):
        allowed_TD = token_device_sets(ids_Tk, weights_Tk, device_of_E, 4, n_d)
        for t in range(200):
            expected = literal_walk(ids_Tk[t].tolist(), weights_Tk[t].tolist(), device_of_E.tolist(), n_d)
            assert allowed_TD[t].nonzero().flatten().tolist() == expected, (t, n_d)


def test_token_device_sets_hand_cases():
    device_of_E = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    ids_Tk = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7], [6, 0, 2, 4], [0, 1, 2, 3]])
    weights_Tk = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4], [0.25] * 4, [0.1, 0.2, 0.3, 0.4]])
    allowed_TD = token_device_sets(ids_Tk, weights_Tk, device_of_E, 4, 1)
    # descending weight; device tie (0.4 on devices 2 and 3) to the lower id; all equal: lowest device
    assert allowed_TD.int().tolist() == [[1, 0, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]]
    allowed_TD = token_device_sets(ids_Tk, weights_Tk, device_of_E, 4, 3)
    # the last token spans two devices only: both kept, nothing invented
    assert allowed_TD.int().tolist() == [[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]


def test_similarity_replacement_rule():
    # devices 0: {0, 1}, 1: {2, 3}, 2: {4, 5}, 3: {6, 7}; the token keeps devices 0 and 1
    ids_Tk = torch.tensor([[0, 4, 6, 2]])
    weights_Tk = torch.tensor([[0.4, 0.1, 0.3, 0.2]])
    allowed_TE = torch.tensor([[True] * 4 + [False] * 4])
    similarity_EE = torch.zeros(8, 8)
    similarity_EE[6, 1], similarity_EE[6, 3] = 0.8, 0.7  # expert 6 (weight 0.3) picks first: takes 1
    similarity_EE[4, 1], similarity_EE[4, 3] = 0.9, 0.1  # expert 4 would prefer 1 but gets 3
    logits_TE = torch.arange(8.0)[None]
    routing = RouterOutput(logits_TE, weights_Tk, ids_Tk)
    weights, ids, aux_logits = prune_similarity(None, None, routing, allowed_TE, similarity_EE)
    assert ids.tolist() == [[0, 3, 1, 2]]
    assert weights is weights_Tk  # the replacement keeps the replaced expert's score
    # effective logits: replacements carry the replaced experts' logits, outside experts are -inf
    assert aux_logits.tolist() == [[0.0, 6.0, 2.0, 4.0] + [float("-inf")] * 4]
    # equal similarity: the lower expert id wins
    similarity_EE[4, 3], similarity_EE[6, 3] = 0.9, 0.8
    _, ids, _ = prune_similarity(None, None, routing, allowed_TE, similarity_EE)
    assert ids.tolist() == [[0, 3, 1, 2]]
    similarity_EE[6] = 0.0
    _, ids, _ = prune_similarity(None, None, routing, allowed_TE, similarity_EE)
    assert ids.tolist() == [[0, 3, 1, 2]]  # 6 takes 1 (lower of two zeros), 4 the remaining 3


def literal_walk_replicated(ids, weights, homes, n_d):
    """The definition with replicas, one token at a time: experts by (descending weight, primary device);
    an expert is served when one of its homes is held; else (while fewer than N_d are held) add its home on
    a device of one of the token's single-home experts (the one whose best expert weighs most), else its lowest."""
    used = {}  # device -> best weight of the token's single-home experts on it
    for e, w in zip(ids, weights):
        if len(homes[e]) == 1:
            used[homes[e][0]] = max(used.get(homes[e][0], float("-inf")), w)
    kept = []
    for j in sorted(range(len(ids)), key=lambda j: (-weights[j], homes[ids[j]][0])):
        options = homes[ids[j]]
        if any(d in kept for d in options) or len(kept) >= n_d:
            continue
        scored = [d for d in options if d in used]
        kept.append(max(scored, key=lambda d: (used[d], -d)) if scored else options[0])
    return sorted(kept)


def test_token_device_sets_with_replicas_match_the_literal_walk():
    from occult_hf.replicas.routing import home_table_from

    generator = torch.Generator().manual_seed(1)
    device_of_E = [0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 2, 3]
    replicas = {0: [2], 3: [0, 3], 6: [1]}  # expert 3 on devices 0, 1, 3
    table_EM = torch.from_numpy(home_table_from(device_of_E, replicas))
    homes = [[d for d in row if d >= 0] for row in table_EM.tolist()]
    ids_Tk = torch.stack([torch.randperm(12, generator=generator)[:5] for _ in range(300)])
    weights_Tk = torch.randint(1, 4, (300, 5), generator=generator).float() / 4
    for n_d in (1, 2, 3, 4):
        chosen_TD = token_device_sets_replicated(ids_Tk, weights_Tk, table_EM, 4, n_d)
        for t in range(300):
            expected = literal_walk_replicated(ids_Tk[t].tolist(), weights_Tk[t].tolist(), homes, n_d)
            assert chosen_TD[t].nonzero().flatten().tolist() == expected, (t, n_d)
        # without replicas the walk is the plain one
        plain_EM = torch.tensor(device_of_E)[:, None]
        assert torch.equal(
            token_device_sets_replicated(ids_Tk, weights_Tk, plain_EM, 4, n_d),
            token_device_sets(ids_Tk, weights_Tk, torch.tensor(device_of_E), 4, n_d),
        )


def replicated_placement(family: str, num_devices: int = NUM_DEVICES) -> Placement:
    """`shuffled_placement` plus an extra home for experts 0..D-1 on the next device."""
    base = shuffled_placement(family, num_devices)
    replicas = {
        layer: {e: [(base.device_of(layer)[e] + 1) % num_devices] for e in range(num_devices)} for layer in MOE_LAYERS[family]
    }
    return Placement(NUM_EXPERTS, num_devices, {l: base.device_of(l) for l in MOE_LAYERS[family]}, replicas=replicas)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_pruning_with_replicas_keeps_every_pair_on_n_d_devices(family, profile_paths):
    from occult_hf.dispatch.plan import destinations

    for mode in MODES:
        for n_d in (1, 2):
            config = pruned_config(family, mode, n_d, profile_paths)
            config = OccultConfig(**{**config.to_dict(), "placement": replicated_placement(family)})
            model = apply_occult(tiny_model(family, **SIZES).train(), config)
            block = next(m for m in model.modules() if isinstance(m, OccultMoE))
            routing = adapter_for(model).route(block.original_block, torch.randn(64, 32, generator=torch.Generator().manual_seed(n_d)))
            pruned = block.pruner.route(block.original_block, routing)
            assert pruned.devices_TD is not None and int(pruned.devices_TD.sum(1).max()) <= n_d
            dest_Tk, _ = destinations(pruned.topk_ids_Tk, block.layout.to("cpu"), devices_TD=pruned.devices_TD)
            assert bool(pruned.devices_TD.gather(1, dest_Tk).all()), (mode, n_d)  # every pair on the token's devices
            assert int(torch.zeros(64, NUM_DEVICES, dtype=torch.bool).scatter_(1, dest_Tk, True).sum(1).max()) <= n_d
            # a replica counts: some token's pair is served by a copy that is not its expert's primary home
            assert bool((dest_Tk != block.layout.device_of_E[pruned.topk_ids_Tk]).any()) or n_d == 1
            model(input_ids=tiny_batch(batch=2, seq=16, seed=1), labels=tiny_batch(batch=2, seq=16, seed=1)).loss.backward()
            # the callback's routing statistics follow the dispatch: no token over N_d devices there either
            from occult_hf.stats import RoutingMeter

            meter = RoutingMeter()
            meter.update(block)
            tokens, ct_sum = meter.pop(NUM_DEVICES, torch.device("cpu"))[:2].tolist()
            assert block.last_devices_TD is not None and ct_sum <= n_d * tokens


# ----- every family, both policies -----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_routing_respects_the_device_limit(family, profile_paths):
    input_ids = tiny_batch(batch=2, seq=16, seed=1)
    for mode in MODES:
        for n_d in (1, 2):
            model = apply_occult(tiny_model(family, **SIZES).train(), pruned_config(family, mode, n_d, profile_paths))
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            blocks = [m for m in model.modules() if isinstance(m, OccultMoE)]
            assert [b.layer_idx for b in blocks] == list(MOE_LAYERS[family])
            for block in blocks:
                assert int(devices_per_token(block).max()) <= n_d, (mode, n_d, block.layer_idx)
                stats = block.pruner.pop_stats()
                assert stats["tokens"] == input_ids.numel()
                assert stats["pruned_token_fraction"] > 0, "the test routing must need pruning"
                assert 0 < stats["removed_weight_fraction"] < 1
                router_grad = adapter_for(model).router(block.original_block).weight.grad
                assert router_grad is not None and router_grad.abs().sum() > 0


def _forward_backward(model, input_ids):
    """Logits, loss, the gradients of every non-expert parameter by name and of the routed experts
    per layer as fused `(gate_up [E, 2I, H], down [E, H, I])` in original expert order."""
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None and ".experts." not in name
    }
    adapter = adapter_for(model)
    expert_grads = {}
    for module in model.modules():
        if isinstance(module, OccultMoE):  # one process: all experts, original order
            expert_grads[module.layer_idx] = (module.experts.gate_up_proj.grad, module.experts.down_proj.grad)
    if expert_grads:
        return out.logits.detach(), out.loss.detach(), grads, expert_grads
    for layer, _, block in adapter.iter_moe_blocks(model):
        experts = adapter.experts_module(block)  # every family: transformers 5 fused experts
        expert_grads[layer] = (experts.gate_up_proj.grad, experts.down_proj.grad)
    return out.logits.detach(), out.loss.detach(), grads, expert_grads


def assert_close(actual, expected, what):
    scale = expected.abs().max().clamp_min(1e-30)
    error = (actual - expected).abs().max() / scale
    assert error <= RTOL, f"{what}: relative error {error:.3g} > {RTOL}"


@pytest.mark.parametrize("family", FAMILIES)
def test_device_limit_covering_top_k_is_the_unpruned_model(family, profile_paths):
    input_ids = tiny_batch(batch=2, seq=16, seed=2)
    logits_ref, loss_ref, grads_ref, experts_ref = _forward_backward(tiny_model(family, **SIZES).train(), input_ids)
    assert sorted(experts_ref) == list(MOE_LAYERS[family])
    for mode in MODES:
        config = pruned_config(family, mode, min(TOP_K, NUM_DEVICES), profile_paths)
        model = apply_occult(tiny_model(family, **SIZES).train(), config)
        logits, loss, grads, experts = _forward_backward(model, input_ids)
        assert_close(logits, logits_ref, f"{mode} logits")
        assert_close(loss, loss_ref, f"{mode} loss")
        for name, grad_ref in grads_ref.items():
            assert_close(grads[name], grad_ref, f"{mode} grad {name}")
        assert sorted(experts) == sorted(experts_ref)
        for layer, (gate_up_ref, down_ref) in experts_ref.items():
            assert_close(experts[layer][0], gate_up_ref, f"{mode} layer {layer} gate_up_proj grad")
            assert_close(experts[layer][1], down_ref, f"{mode} layer {layer} down_proj grad")


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_auxiliary_loss_sees_the_dispatched_routing(family, profile_paths):
    input_ids = tiny_batch(batch=2, seq=16, seed=3)
    unpruned_aux = tiny_model(family, **SIZES)(input_ids=input_ids).aux_loss
    for mode in MODES:
        model = apply_occult(tiny_model(family, **SIZES), pruned_config(family, mode, 1, profile_paths))
        out = model(input_ids=input_ids, output_router_logits=True)
        blocks = [m for m in model.modules() if isinstance(m, OccultMoE)]
        assert len(out.router_logits) == len(blocks)
        for recorded_TE, block in zip(out.router_logits, blocks):
            recorded_ids = torch.topk(recorded_TE.softmax(-1), TOP_K, dim=-1).indices.sort(-1).values
            assert torch.equal(recorded_ids, block.last_topk_ids_Tk.sort(-1).values), mode
        assert not torch.allclose(out.aux_loss, unpruned_aux)


# ----- expert parallelism -------------------------------------------------------------------------


def _ep_matches_one_process(rank, world_size, profile_paths_by_family):
    """Per family and policy: EP (this rank's batch) against one process with D logical devices."""
    one_process_groups = [dist.new_group([r]) for r in range(world_size)]
    failures = []
    for family, profile_path in profile_paths_by_family.items():
        for mode, make_placement in [(m, shuffled_placement) for m in MODES] + [("router", replicated_placement)]:
            config = OccultConfig(
                placement=make_placement(family, world_size),
                prune=mode,
                max_devices_per_token=1,
                profile=profile_path if mode == "similarity" else None,
            )
            batches = [tiny_batch(batch=2, seq=8, seed=10 + r) for r in range(world_size)]
            reference = apply_occult(tiny_model(family, **SIZES).train(), config, group=one_process_groups[rank])
            reference_logits = []
            for batch in batches:  # the mean of the ranks' losses, as EP training optimises
                out = reference(input_ids=batch, labels=batch)
                (out.loss / world_size).backward()
                reference_logits.append(out.logits.detach())
            model = apply_occult(tiny_model(family, **SIZES).train(), config)
            out = model(input_ids=batches[rank], labels=batches[rank])
            out.loss.backward()
            checks = {"logits": (out.logits.detach(), reference_logits[rank])}
            reference_params = dict(reference.named_parameters())
            for name, param in model.named_parameters():
                if param.grad is None or name not in reference_params:
                    continue  # the runtime's own carrier parameters
                module = model.get_submodule(name.rpartition(".")[0])
                reference_grad = reference_params[name].grad
                if hasattr(module, "expert_ids"):  # local experts: their own rows of the full gradient
                    reference_grad = reference_grad[module.expert_ids]
                    grad = param.grad
                else:  # replicated parameters: DDP would average over the ranks
                    grad = param.grad.clone()
                    dist.all_reduce(grad)
                    grad /= world_size
                checks[name] = (grad, reference_grad)
            for what, (actual, expected) in checks.items():
                error = float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
                if error > RTOL:
                    failures.append(f"{family} {mode} {make_placement.__name__} {what}: {error:.3g}")
    return failures + _zero_tokens_on_the_last_rank(rank, world_size, one_process_groups[rank])


def _zero_tokens_on_the_last_rank(rank, world_size, alone) -> list[str]:
    """Pruning with replicas under both limits (each rank a node: the device walk within the token's nodes) while the
    last rank passes no tokens: every rank's block output and input gradient equal one process's."""
    config = OccultConfig(
        placement=replicated_placement("olmoe", world_size), prune="router", max_devices_per_token=1,
        max_nodes_per_token=1, devices_per_node=1,
    )  # fmt: skip
    num_tokens = 0 if rank == world_size - 1 else 6
    x_TH = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(40 + rank))
    outputs = []
    for group in (alone, None):  # one process with D logical devices, then the EP group
        block = next(m for m in apply_occult(tiny_model("olmoe", **SIZES).train(), config, group=group).modules() if isinstance(m, OccultMoE))
        x = x_TH.clone().requires_grad_()
        out_TH = block(x)
        if group is None or num_tokens:  # an empty rank takes part in the backward's exchange (one process: no graph)
            out_TH.pow(2).sum().backward()
        outputs.append((out_TH.detach(), x.grad))
    (expected, expected_grad), (actual, actual_grad) = outputs
    if actual.shape != (num_tokens, 32) or not num_tokens:
        return [] if actual.shape == (num_tokens, 32) else [f"zero tokens: output shape {tuple(actual.shape)}"]
    errors = [float((a - e).abs().max() / e.abs().max()) for a, e in ((actual, expected), (actual_grad, expected_grad))]
    return [f"zero tokens on rank {world_size - 1}: rank {rank} relative errors {errors}"] if max(errors) > RTOL else []


@pytest.mark.world_size(2)
def test_pruned_expert_parallel_equals_one_process(profile_paths):
    """Also a rank with zero tokens under pruning with replicas and both limits (`_zero_tokens_on_the_last_rank`)."""
    families = ("olmoe", "deepseek_v3")
    paths = {family: profile_paths(family) for family in families}
    for failures in run_world(_ep_matches_one_process, 2, paths):
        assert failures == []


# ----- bad input ------------------------------------------------------------------------------------


def test_bad_device_limits():
    with pytest.raises(ValueError, match="OccultConfig.max_devices_per_token must be an integer >= 1 or None, got 0"):
        OccultConfig(num_devices=4, prune="router", max_devices_per_token=0)
    with pytest.raises(ValueError, match=r"N_d=5\) cannot exceed num_devices \(4\)"):
        OccultConfig(num_devices=4, prune="router", max_devices_per_token=5)
    # a device count that comes from the placement is checked when the model is built
    model = tiny_model("olmoe", **SIZES)
    with pytest.raises(ValueError, match=r"N_d=5\) cannot exceed num_devices \(4\)"):
        apply_occult(model, OccultConfig(placement=shuffled_placement("olmoe"), prune="router", max_devices_per_token=5))
    # E=8 on 4 devices: one device holds 2 experts, fewer than k=4
    with pytest.raises(ValueError, match=r"leaves some tokens of layer 0 only 2 experts .* fewer than top_k=4"):
        apply_occult(tiny_model("olmoe", num_experts=8, top_k=4), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    layout = Placement(4, 2, {0: [0, 0, 1, 1]}).layout(0)
    pruner = CollaborationPruner("router", adapter_for(model), layout, top_k=2, max_devices_per_token=1)
    with pytest.raises(ValueError, match=r"in \[1, num_devices=2\], got 3"):
        pruner.max_devices_per_token = 3
    with pytest.raises(ValueError, match=r"OccultConfig.prune must be one of \[None, 'router', 'similarity'\], got 'nearest'"):
        CollaborationPruner("nearest", adapter_for(model), layout, top_k=1, max_devices_per_token=1)


def test_replicas_count_toward_the_experts_a_device_limit_leaves():
    """E=8, k=2 on 4 devices whose primaries leave devices 0-2 one expert each, but whose replicas give every device
    at least 3: N_d=1 runs (it had been refused, counting primaries only), and every token keeps to one device; the
    same primaries without the replicas are refused, the message naming what the emptiest device holds."""
    primaries = {layer: [0, 1, 2, 3, 3, 3, 3, 3] for layer in (0, 1)}
    replicated = Placement(8, 4, primaries, replicas={layer: {3: [0, 1, 2], 4: [0], 7: [1, 2]} for layer in (0, 1)})
    model = apply_occult(tiny_model("olmoe", num_experts=8, top_k=2), OccultConfig(placement=replicated, prune="router", max_devices_per_token=1))
    model(tiny_batch(seed=3))
    for module in occult_modules(model).values():
        assert int(module.last_devices_TD.sum(1).max()) == 1
    with pytest.raises(ValueError, match=r"only 1 experts \(the 1 smallest devices of the placement hold \[1\] primary experts\)"):
        apply_occult(tiny_model("olmoe", num_experts=8, top_k=2), OccultConfig(placement=Placement(8, 4, primaries), prune="router", max_devices_per_token=1))
    three_homes = Placement(8, 4, primaries, replicas={layer: {3: [0, 1, 2]} for layer in (0, 1)})
    with pytest.raises(ValueError, match=r"only 2 experts .* primary experts; with its replicas the emptiest holds 2\), fewer than top_k=4"):
        apply_occult(tiny_model("olmoe", num_experts=8, top_k=4), OccultConfig(placement=three_homes, prune="router", max_devices_per_token=1))


def test_similarity_needs_a_profile_of_this_model(profile_paths, tmp_path):
    with pytest.raises(ValueError, match="prune='similarity' needs a routing profile"):
        OccultConfig(num_devices=4, prune="similarity", max_devices_per_token=1)
    model = tiny_model("olmoe", **SIZES)
    adapter, (layer, _, block) = adapter_for(model), next(adapter_for(model).iter_moe_blocks(model))
    device_of_E = shuffled_placement("olmoe").device_of(layer)

    def build(profile_path, **sizes):
        config = OccultConfig(num_devices=4, prune="similarity", max_devices_per_token=1, profile=str(profile_path))
        devices = sizes.get("device_of_E", device_of_E)
        layout = Placement(len(devices), 4, {layer: devices}).layout(layer)
        return build_pruner(config, adapter, layout, top_k=sizes.get("top_k", TOP_K))

    with pytest.raises(FileNotFoundError, match="OccultConfig.profile .* is not a file"):
        build(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="is for top_k=4 but the model routes each token to top_k=2"):
        build(profile_paths("olmoe"), top_k=2)
    with pytest.raises(ValueError, match="is for num_experts=16 but the model has 8 routed experts"):
        build(profile_paths("olmoe"), device_of_E=[e // 2 for e in range(8)])
    with pytest.raises(ValueError, match=r"from model_type 'qwen3_moe' but the model is served by adapter 'olmoe'"):
        build(profile_paths("qwen3_moe"))
    profile = RoutingProfile.load(profile_paths("olmoe"))
    del profile.layers[layer]
    profile.save(tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match=rf"has no MoE layer {layer}; it covers layers \[1\]"):
        build(tmp_path / "partial.safetensors")
    # one read serves every model while the file is unchanged, each with a copy of its own (tests/test_pruning_profile_cache.py)
    from occult_hf.pruning import _load_profile_cached

    assert build(profile_paths("olmoe")).similarity_EE.shape == (NUM_EXPERTS, NUM_EXPERTS)
    _load_profile_cached.cache_clear()
    first, second = load_pruning_profile(profile_paths("olmoe")), load_pruning_profile(profile_paths("olmoe"))
    assert first is not second and _load_profile_cached.cache_info().misses == 1


def test_pruners_are_found_and_switch_off_at_full_device_limit(profile_paths):
    model = apply_occult(tiny_model("olmoe", **SIZES), pruned_config("olmoe", "router", 1, profile_paths))
    pruners = pruners_of(model)
    assert sorted(pruners) == list(MOE_LAYERS["olmoe"])
    block = next(m for m in model.modules() if isinstance(m, OccultMoE))
    routing = adapter_for(model).route(block.original_block, torch.randn(5, 32))
    assert block.pruner.active
    block.pruner.max_devices_per_token = NUM_DEVICES
    pruned = block.pruner.route(block.original_block, routing)
    assert pruned.topk_weights_Tk is routing.topk_weights_Tk and pruned.topk_ids_Tk is routing.topk_ids_Tk
