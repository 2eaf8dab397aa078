"""`kernels.replica_routes` / `kernels.replica_pairs`: the load-aware rule's per-expert half in one Triton kernel and
its per-pair half in a few, against the torch version.

On CPU the kernel runs under the Triton interpreter (`TRITON_INTERPRET=1` when the kernel is first made: it uses only
Triton builtins). The torch version (`replicas.routing.replica_shares` / `expert_routes`) is the reference: the split
within 1e-9 relative, the integer tables equal, and the routing `load_aware_homes` derives from the tables
identical, on random and adversarial counts, random routing and the Qwen1.5 trace. The per-pair kernels give the torch
half's integers exactly (preferences, counts, every pair's device). The `gpu` tests hold the compiled kernels to the
same on an H200, also inside a CUDA graph capture (graphed decoding). The custom operators `torch.compile` traces
(`occult::expert_routes`, `occult::replica_preferences`, `occult::replica_assign`) are checked here with the kernels
behind them; tests/test_compile_ops.py checks them with the torch half behind them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from occult_hf.kernels.replica_pairs import fused_assign, fused_preferences_and_counts
from occult_hf.kernels.replica_routes import fused_expert_routes, fused_routes_and_shares
from occult_hf.replicas.routing import (
    PIN_SLACK,
    PairHalf,
    expert_routes,
    home_table_from,
    load_aware_homes,
    preference_counts,
    replica_preferences,
    replica_shares,
)

QWEN_TRACE = Path(__file__).resolve().parents[1].parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _replicated_table(num_experts: int, num_devices: int, extra_homes: dict[int, int], seed: int) -> torch.Tensor:
    """A contiguous primary map plus `extra_homes[e]` further homes of expert e on random other devices."""
    rng = np.random.default_rng(seed)
    primary_E = np.arange(num_experts) * num_devices // num_experts
    replicas = {e: rng.choice(np.setdiff1d(np.arange(num_devices), [primary_E[e]]), n, replace=False).tolist() for e, n in extra_homes.items()}
    return torch.from_numpy(home_table_from(primary_E, replicas))


def _countable(table_EM: torch.Tensor) -> torch.Tensor:
    """`[E, M + 1]` int64: 1 where `preference_counts` can count (a home that is there, or column M), else 0."""
    return torch.cat([table_EM >= 0, torch.ones(table_EM.shape[0], 1, dtype=torch.bool)], 1).long()


def _random_counts(generator, num_ranks: int, table_EM: torch.Tensor, high: int) -> torch.Tensor:
    """`[G, E, M + 1]` random counts in `[0, high)`, 0 on the table's padding."""
    return torch.randint(0, high, (num_ranks, table_EM.shape[0], table_EM.shape[1] + 1), generator=generator) * _countable(table_EM)


def _assert_same_tables(gathered_GEM1, table_EM, num_devices, rank, pin_slack, pinned):
    """The kernel's split within 1e-9 relative of `replica_shares`, its tables equal (integers) or within 1e-9
    relative (fractions) of `expert_routes`'."""
    tables, shares_EM = fused_routes_and_shares(gathered_GEM1, table_EM, num_devices, rank, pin_slack, pinned)
    torch.testing.assert_close(shares_EM, replica_shares(gathered_GEM1.sum(0), table_EM, num_devices, pin_slack), rtol=1e-9, atol=1e-9)
    for name, got, want in zip(("stay", "offset", "rest_before", "rest_total", "cumulative"), tables, expert_routes(gathered_GEM1, table_EM, num_devices, rank, pin_slack, pinned)):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.dtype == torch.int64:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)


def test_tables_on_random_and_adversarial_counts(interpreted):
    generator = torch.Generator().manual_seed(0)
    random_table = _replicated_table(60, 8, {e: 1 + e // 6 % 2 for e in range(0, 60, 6)}, seed=0)  # M = 3: a padded home
    random_counts = _random_counts(generator, 4, random_table, 400)
    for rank, pinned in ((0, False), (3, True)):
        _assert_same_tables(random_counts, random_table, 8, rank, PIN_SLACK, pinned)
    two_homes = _replicated_table(16, 4, {e: 1 for e in range(0, 16, 2)}, seed=1)
    zeros = torch.zeros(2, 16, 3, dtype=torch.int64)
    giant = zeros.clone()
    giant[:, 0, 2] = 10**12  # one expert holds every pair, none on a visited home
    ties = 7 * _countable(two_homes).expand(2, -1, -1)  # every home and expert alike: every level ties
    for counts, slack in ((zeros, PIN_SLACK), (giant, PIN_SLACK), (ties, 0.0), (ties, 1.0)):
        _assert_same_tables(counts, two_homes, 4, 1, slack, False)
    # the largest shapes: E=256 experts with up to 8 homes over 64 devices (the kernel takes the devices in blocks)
    many_homes = _replicated_table(256, 64, {e: 1 + e % 7 for e in range(0, 256, 5)}, seed=2)
    many_counts = _random_counts(generator, 2, many_homes, 1000)
    _assert_same_tables(many_counts, many_homes, 64, 1, PIN_SLACK, False)


#: the per-pair kernels whatever the device (`FUSED_PAIRS` takes the torch half on CPU)
KERNEL_PAIRS = PairHalf(fused_preferences_and_counts, fused_assign)


def _same_routing_over_ranks(ids_Tk, table_EM, num_devices, num_ranks, visited_TD=None, pairs=None):
    """`load_aware_homes` of every rank with the kernel's tables (and `pairs`: the per-pair half) equals the torch
    rule's, pair by pair; with `pairs`, its preferences and counts equal the torch half's too."""
    ranks = torch.tensor_split(ids_Tk, num_ranks)
    visits = [None] * num_ranks if visited_TD is None else torch.tensor_split(visited_TD, num_ranks)
    pref = [replica_preferences(r, table_EM, num_devices, v)[1] for r, v in zip(ranks, visits)]
    gathered = torch.stack([preference_counts(r, p, table_EM.shape[0], table_EM.shape[1]) for r, p in zip(ranks, pref)])
    for rank, (ids, visited) in enumerate(zip(ranks, visits)):
        args = (ids, table_EM, num_devices, lambda _: gathered, rank, visited)
        if pairs is not None:
            got_pref, got_counts = pairs.preferences_and_counts(ids, table_EM, num_devices, visited)
            assert torch.equal(got_pref, pref[rank]) and torch.equal(got_counts, gathered[rank]), rank
        assert torch.equal(load_aware_homes(*args, routes=fused_expert_routes, pairs=pairs), load_aware_homes(*args)), rank


def test_routing_equals_the_torch_rule_on_random_routing(interpreted):
    generator = torch.Generator().manual_seed(3)
    popularity_E = 1.0 / (torch.randperm(64, generator=generator).double() + 2.0)
    ids = torch.multinomial(popularity_E.expand(3000, -1), 8, generator=generator)
    table = _replicated_table(64, 8, {int(e): 1 + int(e) % 2 for e in torch.argsort(popularity_E, descending=True)[:8]}, seed=3)
    _same_routing_over_ranks(ids, table, 8, 3)
    visited = torch.rand(3000, 8, generator=generator) < 0.3  # collaboration pruning's devices: pinned pairs
    _same_routing_over_ranks(ids, table, 8, 2, visited)


@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason=f"the Qwen1.5 trace is not at {QWEN_TRACE} (../shared is not shipped)")
def test_routing_equals_the_torch_rule_on_the_qwen_trace(interpreted):
    """The real trace (21k tokens, E=60, k=4) at D=8, its 8 hottest experts given a second home, over 4 ranks; both
    halves in Triton on its first 4000 tokens (the interpreter's scan takes ~1 s per 2000 here)."""
    ids = torch.from_numpy(np.load(QWEN_TRACE)["topk_ids"].astype(np.int64))
    hottest = torch.argsort(torch.bincount(ids.reshape(-1), minlength=60), descending=True)[:8]
    table = _replicated_table(60, 8, {int(e): 1 for e in hottest}, seed=4)
    _same_routing_over_ranks(ids, table, 8, 4)
    _same_routing_over_ranks(ids[:4000], table, 8, 4, pairs=KERNEL_PAIRS)


def test_pair_kernels_equal_the_torch_half_on_random_routing(interpreted):
    """The per-pair kernels: preferences, counts and every pair's device equal to the torch half's, at T from 1 to
    past several scan blocks, over 1-3 ranks, pinned (collaboration pruning's devices) and not, M = 2 and 4, and
    int32 ids."""
    generator = torch.Generator().manual_seed(5)
    popularity_E = 1.0 / (torch.randperm(32, generator=generator).double() + 2.0)
    table = _replicated_table(32, 8, {e: 1 + e % 3 for e in range(0, 32, 3)}, seed=5)  # M = 4: padded homes
    for tokens, num_ranks in ((1, 1), (37, 1), (300, 3)):
        ids = torch.multinomial(popularity_E.expand(tokens, -1), 6, generator=generator)
        _same_routing_over_ranks(ids, table, 8, num_ranks, pairs=KERNEL_PAIRS)
        _same_routing_over_ranks(ids.int(), table[:, :2].contiguous(), 8, num_ranks, pairs=KERNEL_PAIRS)
        _same_routing_over_ranks(ids, table, 8, num_ranks, torch.rand(tokens, 8, generator=generator) < 0.3, KERNEL_PAIRS)


def test_pair_kernels_on_adversarial_routing(interpreted):
    """Every pair of the replicated expert in one group (its first home visited by every token), groups left empty
    (replicated experts no token picks), and every pair visiting no home: the torch half's devices exactly."""
    table = _replicated_table(8, 4, {0: 2, 7: 1, 5: 1}, seed=6)  # expert 0 on three devices; 5 and 7 picked by nobody
    single_on = {int(d): e for e, d in enumerate(table[:, 0].tolist()) if e not in (0, 5, 7)}
    missing = (set(range(4)) - set(table[0].tolist())).pop()  # the one device without a home of expert 0
    one_group = torch.tensor([[0, single_on[int(table[0, 0])]]]).expand(500, -1).contiguous()
    nowhere = torch.tensor([[0, single_on[missing]]]).expand(300, -1).contiguous()
    for ids in (one_group, nowhere):
        for num_ranks in (1, 2):
            _same_routing_over_ranks(ids, table, 4, num_ranks, pairs=KERNEL_PAIRS)
    # truly one group, and truly no visited home
    assert int(fused_preferences_and_counts(one_group, table, 4)[1][0, 0]) == 500
    assert int(fused_preferences_and_counts(nowhere, table, 4)[1][0, 3]) == 300


def test_operators_with_the_kernels_behind_them(interpreted):
    """opcheck of the three operators of the rule over the interpreted kernels, and the whole rule as the
    dispatchers run it (`FusedRoutes`, `FUSED_PAIRS`) compiled with fullgraph: the torch rule's devices, pinned or
    not."""
    from torch.library import opcheck

    from occult_hf.kernels.replica_pairs import FUSED_PAIRS
    from occult_hf.kernels.replica_routes import FusedRoutes

    generator = torch.Generator().manual_seed(8)
    table = _replicated_table(16, 4, {e: 1 + e % 2 for e in range(0, 16, 3)}, seed=8)
    ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(50)])
    visited = torch.rand(50, 4, generator=generator) < 0.3
    pref, counts = fused_preferences_and_counts(ids, table, 4)
    gathered = torch.stack([counts, counts.flip(0)])
    tables = fused_expert_routes(gathered, table, 4, 1, PIN_SLACK, False)
    ops = torch.ops.occult
    opcheck(ops.expert_routes, (gathered, table, 4, 1, PIN_SLACK, False))
    opcheck(ops.replica_preferences, (ids, table, 4, visited))
    opcheck(ops.replica_assign, (ids, pref, table, *tables))
    routes = FusedRoutes()
    for devices in (None, visited):
        rule = lambda ids: load_aware_homes(ids, table, 4, None, 0, devices, PIN_SLACK, routes, FUSED_PAIRS)  # noqa: E731
        compiled = torch.compile(rule, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(ids), load_aware_homes(ids, table, 4, None, 0, devices))


def test_pair_kernel_argument_error():
    with pytest.raises(ValueError, match=r"the home table \[4, 1\] has no replicas \(M < 2\)"):
        fused_preferences_and_counts(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(4, 1, dtype=torch.int64), 2)


@pytest.mark.parametrize(
    ("counts", "table", "rank", "message"),
    [
        ((1, 4, 3), (4, 3), 0, r"counts \[1, 4, 3\] must be \[G, E, M \+ 1\] for the \[E, M\] home table \[4, 3\]"),
        ((1, 300, 3), (300, 2), 0, r"at most E=256 experts and M=8 homes in one program, got E=300, M=2"),
        ((2, 4, 3), (4, 2), 2, r"rank must be in \[0, 2\) \(the gathered ranks\), got 2"),
    ],
)
def test_kernel_argument_errors(counts, table, rank, message):
    with pytest.raises(ValueError, match=message):
        fused_expert_routes(torch.zeros(counts, dtype=torch.int64), torch.zeros(table, dtype=torch.int64), 2, rank, PIN_SLACK, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernel_equals_the_torch_rule_on_the_gpu():
    """Compiled (no fused multiply-adds): the split within 1e-9 of the eager GPU one and the same routing, for
    rank 1 of a gathered group, pinned and not, also launched inside a CUDA graph capture as graphed decoding does."""
    from occult_hf.utils.cuda_graph import capture
    from occult_hf.kernels.replica_routes import FusedRoutes

    generator = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(64, generator=generator)[:8] for _ in range(4096)]).cuda()
    for seed in (1, 2):
        table = _replicated_table(64, 8, {e: 1 + e % 3 for e in range(0, 64, 4)}, seed=seed).cuda()
        _assert_same_tables(preference_counts(ids, replica_preferences(ids, table, 8)[1], 64, 4)[None].expand(3, -1, -1).contiguous(), table, 8, 1, PIN_SLACK, seed == 2)
        _same_routing_over_ranks(ids, table, 8, 2)
        routes = FusedRoutes()
        whole, out = capture(lambda: load_aware_homes(ids, table, 8, routes=routes), ids.device, warmup=1)
        whole.replay()
        assert torch.equal(out, load_aware_homes(ids, table, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_pair_kernels_equal_the_torch_half_on_the_gpu():
    """Compiled: the per-pair kernels give the eager GPU rule's preferences, counts and devices at T = 16384 (1024 scan
    blocks), over 2 ranks, pinned and not, and inside a CUDA graph capture of the whole rule with both halves' kernels."""
    from occult_hf.utils.cuda_graph import capture
    from occult_hf.kernels.replica_pairs import FUSED_PAIRS
    from occult_hf.kernels.replica_routes import FusedRoutes

    generator = torch.Generator().manual_seed(7)
    popularity_E = 1.0 / (torch.randperm(64, generator=generator).double() + 4.0)
    ids = torch.multinomial(popularity_E.expand(16384, -1), 8, generator=generator).cuda()
    visited = (torch.rand(16384, 8, generator=generator) < 0.3).cuda()
    table = _replicated_table(64, 8, {e: 1 + e % 3 for e in range(0, 64, 4)}, seed=7).cuda()
    _same_routing_over_ranks(ids, table, 8, 2, pairs=FUSED_PAIRS)
    _same_routing_over_ranks(ids, table, 8, 2, visited, FUSED_PAIRS)
    routes = FusedRoutes()
    whole, out = capture(lambda: load_aware_homes(ids, table, 8, routes=routes, pairs=FUSED_PAIRS), ids.device, warmup=1)
    whole.replay()
    assert torch.equal(out, load_aware_homes(ids, table, 8))
