"""The model-family adapters describe the real transformers blocks faithfully.

One table-driven tester over tiny random models of every family (plus variants that switch on a
family's other routing rule). The strongest check: rebuilding each MoE block's output from nothing
but the adapter (route, expert weights, activation, shared output, aux-loss attachment) with a plain
per-expert loop equals the real block's forward and gradients.

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E routed experts, k experts per token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from occult_hf.patches import adapter_for, registered_adapters
from tiny_models import FAMILIES, MOE_LAYERS, TINY_FAMILIES, tiny_batch, tiny_model

CASES = {family: (family, {}) for family in FAMILIES}
CASES.update(
    {
        "deepseek_v2-group_limited": ("deepseek_v2", {"topk_method": "group_limited_greedy"}),
        "deepseek-norm-token_aux": ("deepseek", {"norm_topk_prob": True, "seq_aux": False}),
        "olmoe-norm": ("olmoe", {"norm_topk_prob": True}),
        "qwen2_moe-E6": ("qwen2_moe", {"num_experts": 6, "top_k": 3}),
        "deepseek_v3-E6": ("deepseek_v3", {"num_experts": 6}),
    }
)


class Case:
    """A tiny model of one family and the `[B, S, H]` input each of its MoE blocks saw."""

    def __init__(self, family: str, overrides: dict):
        self.family = family
        self.model = tiny_model(family, seed=3, **overrides)
        self.adapter = adapter_for(self.model)
        self.blocks = list(self.adapter.iter_moe_blocks(self.model))
        self.inputs_BSH = {}
        hooks = [
            block.register_forward_pre_hook(lambda _m, args, index=index: self.inputs_BSH.__setitem__(index, args[0].detach()))
            for index, _, block in self.blocks
        ]
        with torch.no_grad():
            self.model(input_ids=tiny_batch(self.model.config.vocab_size, batch=2, seq=16))
        for hook in hooks:
            hook.remove()

    def each_block(self):
        for index, _, block in self.blocks:
            yield block, self.inputs_BSH[index]


_CACHE: dict[str, Case] = {}


@pytest.fixture(params=list(CASES), scope="module")
def case(request) -> Case:
    if request.param not in _CACHE:
        _CACHE[request.param] = Case(*CASES[request.param])
    return _CACHE[request.param]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().norm() / expected.detach().norm().clamp_min(1e-30))


# ----- structure -----------------------------------------------------------------------------
def test_every_family_is_registered_under_its_model_type(case):
    assert case.adapter.name == case.family
    assert case.model.config.model_type in case.adapter.model_types
    assert set(registered_adapters()) == set(FAMILIES)


def test_iter_moe_blocks_skips_dense_layers(case):
    indices = [index for index, _, _ in case.blocks]
    assert tuple(indices) == MOE_LAYERS[case.family]
    for index, path, block in case.blocks:
        assert path == f"model.layers.{index}.mlp"
        assert case.model.get_submodule(path) is block
    every_layer_moe = MOE_LAYERS[case.family] == tuple(range(len(case.model.model.layers)))
    assert len(case.model.model.layers) > len(indices) or every_layer_moe


def test_expert_count_and_top_k_come_from_the_config(case):
    config = case.model.config
    num_experts, top_k = case.adapter.num_experts(config), case.adapter.top_k(config)
    for block, x_BSH in case.each_block():
        gate_up_E2IH, down_EHI = case.adapter.expert_weights(block)
        assert gate_up_E2IH.shape[0] == down_EHI.shape[0] == num_experts
        assert case.adapter.router(block).weight.shape[0] == num_experts
        assert case.adapter.route(block, x_BSH).topk_ids_Tk.shape[-1] == top_k


def test_unsupported_model_names_the_supported_types():
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError) as error:
        adapter_for(config)
    for model_type in (t for adapter in registered_adapters().values() for t in adapter.model_types):
        assert repr(model_type) in str(error.value)
    assert "'llama'" in str(error.value)


# ----- routing -------------------------------------------------------------------------------
def _router_call(case, block, x_BSH):
    """What the block's router module itself returns: (logits, weights, ids)."""
    router = case.adapter.router(block)
    return router(x_BSH.reshape(-1, x_BSH.shape[-1]))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_route_runs_the_blocks_own_router(case, training):
    case.model.train(training)
    try:
        for block, x_BSH in case.each_block():
            calls = []
            hook = case.adapter.router(block).register_forward_hook(lambda *_: calls.append(1))
            routed = case.adapter.route(block, x_BSH)
            hook.remove()
            assert calls == [1], "route must call the router module instance (hooks, router_logits capture)"
            logits_TE, weights_Tk, ids_Tk = _router_call(case, block, x_BSH)
            assert torch.equal(routed.topk_ids_Tk, ids_Tk)
            assert torch.equal(routed.topk_weights_Tk, weights_Tk)
            assert torch.equal(routed.logits_TE, logits_TE)
            has_aux = case.family == "deepseek" and training
            assert (routed.aux_loss is not None) == has_aux
    finally:
        case.model.eval()


def test_observe_sees_what_route_returns(case):
    for block, x_BSH in case.each_block():
        seen = []
        router = case.adapter.router(block)
        hook = router.register_forward_hook(lambda m, i, o: seen.append(case.adapter.observe(m, i, o)))
        routed = case.adapter.route(block, x_BSH)
        hook.remove()
        (logits_TE, ids_Tk), = seen
        assert torch.equal(logits_TE, routed.logits_TE)
        assert torch.equal(ids_Tk, routed.topk_ids_Tk)


def test_select_with_everything_allowed_is_route(case):
    for block, x_BSH in case.each_block():
        routed = case.adapter.route(block, x_BSH)
        allowed_TE = torch.ones_like(routed.logits_TE, dtype=torch.bool)
        weights_Tk, ids_Tk = case.adapter.select(block, routed.logits_TE, allowed_TE)
        assert torch.equal(ids_Tk, routed.topk_ids_Tk)
        assert torch.equal(weights_Tk, routed.topk_weights_Tk)
        assert torch.equal(case.adapter.renormalize(block, routed.logits_TE, routed.topk_ids_Tk), routed.topk_weights_Tk)


def _random_mask(ids_Tk: torch.Tensor, num_experts: int, seed: int) -> torch.Tensor:
    """Each token loses one of its routed experts and a random half of the rest, keeping >= k."""
    generator = torch.Generator().manual_seed(seed)
    tokens, top_k = ids_Tk.shape
    allowed_TE = torch.rand(tokens, num_experts, generator=generator) < 0.6
    allowed_TE[torch.arange(tokens), ids_Tk[:, 0]] = False
    for t in range(tokens):
        while int(allowed_TE[t].sum()) < top_k:
            candidates = (~allowed_TE[t]).nonzero().flatten()
            candidates = candidates[candidates != ids_Tk[t, 0]]
            allowed_TE[t, candidates[torch.randint(len(candidates), (1,), generator=generator)]] = True
    return allowed_TE


def _reference_select(case, block, logits_TE, allowed_TE):
    """The family's rule restricted to allowed experts, token by token in float64: `{id: weight}` each."""
    router = case.adapter.router(block)
    logits_TE = logits_TE.detach().double()
    tokens, num_experts = logits_TE.shape
    top_k = router.top_k
    rule = TINY_FAMILIES[case.family].routing
    groups = rule.groups
    if groups == "topk_method":
        groups = "max" if router.topk_method == "group_limited_greedy" else None
    choices = []
    for t in range(tokens):
        allowed = [e for e in range(num_experts) if allowed_TE[t, e]]
        score = logits_TE[t].sigmoid() if rule.score == "sigmoid" else logits_TE[t].softmax(-1)
        choice = score + router.e_score_correction_bias.double() if rule.biased_choice else score
        if groups is not None:
            per_group = num_experts // router.num_group
            group_of = lambda e: e // per_group  # noqa: E731
            group_score = {}
            for g in range(router.num_group):
                members = sorted((float(choice[e]) for e in allowed if group_of(e) == g), reverse=True)
                if members:
                    group_score[g] = members[0] if groups == "max" else sum(members[:2])
            ranked = sorted(group_score, key=lambda g: (-group_score[g], g))
            kept, reach = [], 0
            for g in ranked:
                if len(kept) >= router.topk_group and reach >= top_k:
                    break
                kept.append(g)
                reach += sum(1 for e in allowed if group_of(e) == g)
            allowed = [e for e in allowed if group_of(e) in kept]
        chosen = sorted(allowed, key=lambda e: -float(choice[e]))[:top_k]  # noqa: B023
        weights = {e: float(score[e]) for e in chosen}
        normalise = rule.normalize if isinstance(rule.normalize, bool) else getattr(router, rule.normalize)
        if not rule.normalize_single:
            normalise = normalise and top_k > 1
        if normalise:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        scale = router.routed_scaling_factor if rule.scale else 1.0
        choices.append({e: w * scale for e, w in weights.items()})
    return choices


def test_select_follows_the_models_rule_among_allowed_experts(case):
    for layer, (block, x_BSH) in enumerate(case.each_block()):
        routed = case.adapter.route(block, x_BSH)
        allowed_TE = _random_mask(routed.topk_ids_Tk, routed.logits_TE.shape[-1], seed=layer)
        weights_Tk, ids_Tk = case.adapter.select(block, routed.logits_TE, allowed_TE)
        assert bool(allowed_TE.gather(1, ids_Tk).all()), "select picked a masked expert"
        assert not torch.equal(ids_Tk.sort(-1).values, routed.topk_ids_Tk.sort(-1).values), "mask did not bite"
        for t, expected in enumerate(_reference_select(case, block, routed.logits_TE, allowed_TE)):
            got = {int(e): float(w) for e, w in zip(ids_Tk[t], weights_Tk[t].detach())}
            assert set(got) == set(expected), f"token {t}: chose {sorted(got)}, rule gives {sorted(expected)}"
            for e in got:
                assert got[e] == pytest.approx(expected[e], rel=1e-5)


def test_deepseek_v3_routing_is_group_limited_and_biased():
    case = _CACHE.get("deepseek_v3") or Case("deepseek_v3", {})
    for block, x_BSH in case.each_block():
        router = case.adapter.router(block)
        routed = case.adapter.route(block, x_BSH)
        groups_Tk = routed.topk_ids_Tk // (router.num_experts // router.num_group)
        assert all(len(set(row.tolist())) <= router.topk_group for row in groups_Tk)
        allowed_TE = torch.ones_like(routed.logits_TE, dtype=torch.bool)
        saved_bias = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        try:
            _, unbiased_ids_Tk = case.adapter.select(block, routed.logits_TE, allowed_TE)
        finally:
            router.e_score_correction_bias.copy_(saved_bias)
        assert not torch.equal(unbiased_ids_Tk.sort(-1).values, routed.topk_ids_Tk.sort(-1).values)


def test_select_rejects_masks_it_cannot_honour(case):
    block, x_BSH = next(case.each_block())
    logits_TE = case.adapter.route(block, x_BSH).logits_TE
    top_k = case.adapter.top_k(case.model.config)
    too_few_TE = torch.zeros_like(logits_TE, dtype=torch.bool)
    too_few_TE[:, : top_k - 1] = True
    with pytest.raises(ValueError, match=f"top_k={top_k}"):
        case.adapter.select(block, logits_TE, too_few_TE)
    with pytest.raises(ValueError, match="bool"):
        case.adapter.select(block, logits_TE, torch.ones_like(logits_TE))


# ----- experts -------------------------------------------------------------------------------
def _rebuild_block_output(adapter, block, x_BSH):
    """The block's output from the adapter alone: a plain loop over experts."""
    x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
    routed = adapter.route(block, x_BSH)
    gate_up_E2IH, down_EHI = adapter.expert_weights(block)
    act_fn = adapter.act_fn(block)
    out_TH = torch.zeros_like(x_TH)
    for expert in range(gate_up_E2IH.shape[0]):
        token_n, slot_n = (routed.topk_ids_Tk == expert).nonzero(as_tuple=True)
        gate_nI, up_nI = F.linear(x_TH[token_n], gate_up_E2IH[expert]).chunk(2, dim=-1)
        y_nH = F.linear(act_fn(gate_nI) * up_nI, down_EHI[expert]) * routed.topk_weights_Tk[token_n, slot_n, None]
        out_TH = out_TH.index_add(0, token_n, y_nH)
    out_TH = adapter.attach_aux_loss(block, out_TH, routed.aux_loss)
    shared_TH = adapter.shared_output(block, x_TH)
    if shared_TH is not None:
        out_TH = out_TH + shared_TH
    return out_TH.view_as(x_BSH)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_block_output_and_gradients_rebuilt_from_the_adapter(case, training):
    case.model.train(training)
    try:
        for block, x_BSH in case.each_block():
            probe_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(7))
            x_ref = x_BSH.clone().requires_grad_(True)
            x_ours = x_BSH.clone().requires_grad_(True)
            expected = block(x_ref)
            expected_grads = torch.autograd.grad((expected * probe_BSH).sum(), [x_ref, *block.parameters()], allow_unused=True)
            actual = _rebuild_block_output(case.adapter, block, x_ours)
            actual_grads = torch.autograd.grad((actual * probe_BSH).sum(), [x_ours, *block.parameters()], allow_unused=True)
            assert rel_err(actual, expected) <= 1e-5
            names = ["input", *(name for name, _ in block.named_parameters())]
            for name, got, want in zip(names, actual_grads, expected_grads):
                if want is None:
                    assert got is None or not got.any(), f"{name}: gradient where the model has none"
                    continue
                assert got is not None, f"{name}: no gradient reached it through the adapter"
                assert rel_err(got, want) <= 1e-5, f"{name}: gradient differs"
    finally:
        case.model.eval()


def test_expert_state_dict_is_the_blocks_own_layout(case):
    for block, _ in case.each_block():
        prefix = next(name for name, module in block.named_children() if module is case.adapter.experts_module(block))
        own = {key: value for key, value in block.state_dict().items() if key.startswith(prefix + ".")}
        rebuilt = case.adapter.expert_state_dict(block, *case.adapter.expert_weights(block))
        assert set(rebuilt) == set(own)
        for key, value in rebuilt.items():
            assert torch.equal(value, own[key]), key


# ----- DeepSeek-MoE's balance loss ------------------------------------------------------------
@pytest.mark.parametrize("seq_aux", [True, False], ids=["sequence", "token"])
def test_deepseek_balance_loss_is_the_published_formula(seq_aux):
    """alpha * sum_i f_i * P_i with f_i = E/(k*T) * (times expert i was chosen), P_i = mean score,
    per sequence and averaged over sequences when seq_aux, else over the whole batch."""
    model = tiny_model("deepseek", seed=2, seq_aux=seq_aux, aux_loss_alpha=0.03).train()
    adapter = adapter_for(model)
    _, _, block = next(adapter.iter_moe_blocks(model))
    x_BSH = torch.randn(3, 10, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    routed = adapter.route(block, x_BSH)
    num_experts, top_k = adapter.num_experts(model.config), adapter.top_k(model.config)
    probs_BSE = routed.logits_TE.detach().double().softmax(-1).view(3, 10, num_experts)
    ids_BN = routed.topk_ids_Tk.view(3, -1)
    groups = [(probs_BSE[b], ids_BN[b]) for b in range(3)] if seq_aux else [(probs_BSE.view(-1, num_experts), ids_BN.view(-1))]
    losses = []
    for probs_SE, ids_N in groups:
        counts_E = torch.bincount(ids_N, minlength=num_experts).double()
        fraction_E = counts_E * num_experts / (probs_SE.shape[0] * top_k)
        losses.append(0.03 * (fraction_E * probs_SE.mean(0)).sum())
    assert float(routed.aux_loss.detach()) == pytest.approx(float(sum(losses) / len(losses)), rel=1e-5)


def test_deepseek_route_takes_flat_tokens_as_one_sequence():
    case = _CACHE.get("deepseek") or Case("deepseek", {})
    block, x_BSH = next(case.each_block())
    flat = case.adapter.route(block, x_BSH.reshape(-1, x_BSH.shape[-1]))
    shaped = case.adapter.route(block, x_BSH)
    assert torch.equal(flat.topk_ids_Tk, shaped.topk_ids_Tk) and torch.equal(flat.logits_TE, shaped.logits_TE)
