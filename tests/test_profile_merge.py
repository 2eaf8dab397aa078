"""`RoutingProfile.merge` describes exactly the tokens of its inputs, and `OccultCallback`'s window over EP ranks too.

- Profiles collected on disjoint token streams, merged, equal the profile of the union collected in one pass:
  token counts, expert counts, co-activation and logit Gram matrices; with samples that keep every row, the
  pooled sample is the union's rows in stream order.
- The pooled sample weights each stream by its tokens, not its rows: a stream of 10 tokens next to one of 10,000
  gives its token share of rows (rounded), and over many seeds every row of a stream is drawn equally often.
- Under 2 gloo EP ranks the drift window's profile (each rank's collector gathered and merged) counts exactly the
  tokens and expert choices the ranks' routers made (counted independently by forward hooks on the routers),
  including windows where one rank (rank 0 or rank 1) routed no training token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import run_world
from tiny_models import tiny_batch, tiny_model

from occult_hf.profile import ProfileCollector, RoutingProfile
from occult_hf.profile.stats import LayerAccumulator, LayerRouting

SIZES = dict(num_experts=16, top_k=4)


def _collected(model, batches, sample_size: int) -> RoutingProfile:
    """The profile of `batches` (input ids, attention mask) forwarded through `model` under one collector."""
    with ProfileCollector(model, sample_size=sample_size) as collector, torch.no_grad():
        for ids_BS, mask_BS in batches:
            model(input_ids=ids_BS, attention_mask=mask_BS)
    return RoutingProfile.from_collector(collector, source="test")


def _streams():
    """Three disjoint token streams of unequal size, the middle one partly padded."""
    padded = torch.ones(3, 12, dtype=torch.long)
    padded[1, 7:] = 0
    return [
        [(tiny_batch(batch=1, seq=5, seed=1), torch.ones(1, 5, dtype=torch.long))],
        [(tiny_batch(batch=3, seq=12, seed=2), padded), (tiny_batch(batch=2, seq=9, seed=3), torch.ones(2, 9).long())],
        [(tiny_batch(batch=4, seq=16, seed=4), torch.ones(4, 16, dtype=torch.long))],
    ]


def test_merge_of_disjoint_streams_equals_the_union_in_one_pass():
    model = tiny_model("olmoe", **SIZES).eval()
    streams = _streams()
    parts = [_collected(model, stream, sample_size=10_000) for stream in streams]
    union = _collected(model, [batch for stream in streams for batch in stream], sample_size=10_000)
    merged = RoutingProfile.merge(parts)
    shape = lambda p: (p.num_experts, p.top_k, sorted(p.layers))  # noqa: E731
    assert shape(merged) == shape(union)
    assert merged.model_type == union.model_type == "olmoe"
    assert union.layer(0).token_count == 5 + 36 - 5 + 18 + 64
    for layer, expected in union.layers.items():
        got = merged.layer(layer)
        assert got.token_count == expected.token_count
        np.testing.assert_array_equal(got.expert_counts, expected.expert_counts)
        np.testing.assert_array_equal(got.coactivation, expected.coactivation)
        np.testing.assert_allclose(got.logit_gram, expected.logit_gram, rtol=1e-12, atol=1e-12)
        # every stream kept all its rows: the pooled sample is the union's every row, in stream order
        np.testing.assert_array_equal(got.topk_sample, expected.topk_sample)
        assert len(got.topk_sample) == expected.token_count


def test_merge_leaves_its_inputs_unchanged_is_seeded_and_loads_back(tmp_path):
    model = tiny_model("olmoe", **SIZES).eval()
    parts = [_collected(model, stream, sample_size=16) for stream in _streams()]
    before = [(p.layer(0).expert_counts.copy(), p.layer(0).coactivation.copy(), p.layer(0).topk_sample.copy())
              for p in parts]
    merged = RoutingProfile.merge(parts, seed=3)
    for part, (counts, coact, sample) in zip(parts, before):
        np.testing.assert_array_equal(part.layer(0).expert_counts, counts)
        np.testing.assert_array_equal(part.layer(0).coactivation, coact)
        np.testing.assert_array_equal(part.layer(0).topk_sample, sample)
    again = RoutingProfile.merge(parts, seed=3)
    merged.save(tmp_path / "merged.safetensors")
    loaded = RoutingProfile.load(tmp_path / "merged.safetensors")
    for layer in merged.layers:
        np.testing.assert_array_equal(again.layer(layer).topk_sample, merged.layer(layer).topk_sample)
        np.testing.assert_array_equal(loaded.layer(layer).topk_sample, merged.layer(layer).topk_sample)
        assert loaded.layer(layer).token_count == sum(p.layer(layer).token_count for p in parts)


def _constant_stream(tokens: int, experts: list[int], capacity: int, seed: int = 0) -> LayerRouting:
    """A layer of `tokens` tokens that all route to `experts` (8 experts), keeping `capacity` sample rows: a pooled
    row's first expert says which stream it came from."""
    accumulator = LayerAccumulator(8, len(experts), sample_size=capacity, seed=seed)
    accumulator.update(torch.tensor([experts] * tokens))
    return accumulator.to_layer_routing()


def _profile(routing: LayerRouting) -> RoutingProfile:
    return RoutingProfile(8, routing.topk_sample.shape[1], {0: routing}, "olmoe")


def test_pooled_sample_weights_each_stream_by_its_tokens_not_its_rows():
    """A stream of 10 tokens (10 rows kept) next to one of 10,000 (100 rows kept): a uniform sample of the union of
    100 rows holds 100 * 10 / 10,010 = 0.1 rows of the small stream on average; weighting by rows would give it 9,
    per profile 50. Over 1,000 seeds the small stream gives one row about 100 times (binomial sd 9.5)."""
    profiles = [_profile(_constant_stream(10, [0, 1], capacity=100)), _profile(_constant_stream(10_000, [2, 3], 100))]
    from_small = []
    for seed in range(1000):
        sample = RoutingProfile.merge(profiles, seed=seed).layer(0).topk_sample
        assert len(sample) == 100  # the large stream's 100 rows bound a sample at its share
        from_small.append(int((sample[:, 0] == 0).sum()))
    assert set(from_small) <= {0, 1} and abs(sum(from_small) - 99.9) <= 6 * 9.5, sum(from_small)
    # 1,000 tokens and 3,000 tokens, 200 rows each: the sample holds 1/4 and 3/4 (size bound by the large stream),
    # shares 66.5 and 199.5 rounded one way or the other, in either order of the inputs
    for order in (1, -1):
        pair = [_profile(_constant_stream(1000, [0, 1], 200)), _profile(_constant_stream(3000, [2, 3], 200))][::order]
        sample = RoutingProfile.merge(pair).layer(0).topk_sample
        shares = ((sample[:, 0] == 0).sum(), (sample[:, 0] == 2).sum())
        assert len(sample) == 266 and shares in ((66, 200), (67, 199)), shares


def _marked_stream(tokens: int, capacity: int, offset: int) -> LayerRouting:
    """A stream of `tokens` tokens (64 experts, k=2) whose rows identify their token: token `t` (numbered from `offset`)
    routes to (t % 32, 32 + t // 32), so a pooled row says which stream and which of its kept rows it came from."""
    accumulator = LayerAccumulator(64, 2, sample_size=capacity, seed=offset)
    ids = torch.arange(offset, offset + tokens)
    accumulator.update(torch.stack([ids % 32, 32 + ids // 32], dim=1))
    return accumulator.to_layer_routing()


def test_pooled_sample_draws_each_streams_kept_rows_uniformly():
    """Over 2,000 seeds every kept row of each stream is drawn with the same frequency (its stream's share over its
    rows), within a margin of 6 binomial standard deviations; no row is favoured by its position."""
    small, large = _marked_stream(20, 20, 0), _marked_stream(300, 40, 20)
    profiles = [RoutingProfile(64, 2, {0: r}) for r in (small, large)]
    keys = {tuple(row): i for i, row in enumerate(np.concatenate([small.topk_sample, large.topk_sample]).tolist())}
    assert len(keys) == 60
    seeds = 2000
    hits = np.zeros(60)
    for seed in range(seeds):
        sample = RoutingProfile.merge(profiles, seed=seed).layer(0).topk_sample
        for row in sample.tolist():
            hits[keys[tuple(row)]] += 1
    size = min(60, 20 * 320 // 20, 40 * 320 // 300)  # 42: the large stream's 40 rows bound it at its 300/320 share
    assert hits.sum() == seeds * size
    for rows, tokens, span in ((20, 20, slice(0, 20)), (40, 300, slice(20, 60))):
        share = size * tokens / 320
        p = share / rows
        expected, margin = seeds * p, 6 * np.sqrt(seeds * p * (1 - p))
        assert np.all(np.abs(hits[span] - expected) <= margin), (hits[span], expected)


def test_rounded_shares_give_every_stream_its_chance_whatever_its_place_in_the_list():
    """30 streams of 10 tokens (each share 0.1 of a row) beside one of 10,000 tokens keeping 100 rows: the sample holds
    103 rows, 100 of the large stream and 3 of small ones. In a uniform sample of the union each small stream's token
    is drawn with probability 0.01, so over 300 seeds each small stream shows up about 30 times (binomial sd 5.2);
    rounding the same streams up at every seed (the first ones in the list) leaves the others out of every sample."""
    small = [_routing_profile(10, [4 + i, 0], capacity=10) for i in range(30)]  # each marked by its first expert
    large = _routing_profile(10_000, [2, 3], capacity=100)
    shown = np.zeros(30)
    for seed in range(300):
        sample = RoutingProfile.merge([*small, large], seed=seed).layer(0).topk_sample
        assert len(sample) == 103 and int((sample[:, 0] == 2).sum()) == 100
        shown += [int((sample[:, 0] == 4 + i).sum()) for i in range(30)]
    assert shown.sum() == 300 * 3
    assert shown.min() >= 30 - 4.5 * 5.2 and shown.max() <= 30 + 4.5 * 5.2, shown


def _routing_profile(tokens: int, experts: list[int], capacity: int) -> RoutingProfile:
    """A one-layer profile (40 experts) of `tokens` tokens that all route to `experts`, keeping `capacity` rows."""
    accumulator = LayerAccumulator(40, len(experts), sample_size=capacity)
    accumulator.update(torch.tensor([experts] * tokens))
    return RoutingProfile(40, len(experts), {0: accumulator.to_layer_routing()}, "olmoe")


# ----- the callback's window over 2 gloo EP ranks -------------------------------------------------------------------


def _router_counts(model):
    """Forward hooks on the model's own routers: tokens and per-expert choices of training forwards, per layer."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

    counts, masks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, OlmoeTopKRouter):
            layer = int(name.split(".")[2])
            counts[layer] = [0, np.zeros(SIZES["num_experts"], dtype=np.int64)]

            def hook(router, inputs, output, layer=layer):
                if not model.training:
                    return
                keep = masks[-1].reshape(-1).bool()
                ids = output[2][keep]
                counts[layer][0] += int(ids.shape[0])
                counts[layer][1] += np.bincount(ids.reshape(-1).numpy(), minlength=SIZES["num_experts"])

            module.register_forward_hook(hook)
    return counts, masks


def _window_world(rank, world_size):
    import torch.distributed as dist

    from occult_hf.config import OccultConfig
    from occult_hf.hf.apply import apply_occult
    from occult_hf.hf.callback import OccultCallback
    from transformers import TrainerState

    model = apply_occult(tiny_model("olmoe", **SIZES).train(), OccultConfig(num_devices=world_size))
    counts, masks = _router_counts(model)
    callback = OccultCallback(check_every=1, sample_size=64)
    state = TrainerState()
    callback.on_train_begin(None, state, None, model=model)
    # window 1: both ranks train, rank 1 on a partly padded batch; window 2: rank 1 routes only an evaluation's
    # tokens; window 3: rank 0 does
    plan = {1: (True, True), 2: (True, False), 3: (False, True)}
    found = []
    for step, training in plan.items():
        for name in counts:
            counts[name] = [0, np.zeros(SIZES["num_experts"], dtype=np.int64)]
        ids = tiny_batch(batch=2, seq=8, seed=10 * step + rank)
        mask = torch.ones_like(ids)
        if rank == 1 and step == 1:
            mask[0, 5:] = 0
        model.train(training[rank])
        masks.append(mask)
        with torch.set_grad_enabled(training[rank]):
            out = model(input_ids=ids, attention_mask=mask)
        model.train(True)
        state.global_step = step
        callback.on_step_end(None, state, None, model=model)
        profile = callback.recent_profile
        window = {}
        for layer, (tokens, experts) in counts.items():
            table = torch.tensor([tokens, *experts.tolist()], dtype=torch.int64)
            dist.all_reduce(table)
            got = profile.layer(layer)
            window[layer] = (table.tolist(), [got.token_count, *got.expert_counts.tolist()], len(got.topk_sample))
        found.append((step, profile.meta.get("tokens"), window))
        del out
    callback.on_train_end(None, state, None, model=model)
    return found


@pytest.mark.world_size(2)
def test_window_profile_over_ranks_counts_exactly_what_the_routers_routed():
    results = run_world(_window_world, 2)
    assert results[0] == results[1]
    expected_tokens = {1: 16 + 13, 2: 16, 3: 16}
    for step, tokens, window in results[0]:
        assert tokens == expected_tokens[step], (step, tokens)
        for layer, (hooks, profile, rows) in window.items():
            assert hooks[0] == expected_tokens[step], (step, layer, hooks)
            assert profile == hooks, (step, layer, profile, hooks)
            assert rows == expected_tokens[step], (step, layer, rows)  # under sample_size: every row kept
