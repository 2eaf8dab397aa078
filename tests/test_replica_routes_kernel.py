"""`replica_routes_kernel`: the load-aware rule's per-expert half in one Triton kernel, against the torch version.

On CPU the kernel runs under the Triton interpreter (`TRITON_INTERPRET=1` when the kernel is first made: it uses only
Triton builtins). The torch version (`replica_routing.replica_shares` / `expert_routes`) is the reference: the split
within 1e-9 relative, the integer tables equal, and the routing `load_aware_homes` derives from the tables
identical, on random and adversarial counts, random routing and the Qwen1.5 trace. The `gpu` test holds the compiled
kernel to the same on an H200, also inside a CUDA graph capture (graphed decoding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from occult_hf.replica_routes_kernel import fused_expert_routes, fused_routes_and_shares
from occult_hf.replica_routing import (
    PIN_SLACK,
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


def _same_routing_over_ranks(ids_Tk, table_EM, num_devices, num_ranks, visited_TD=None):
    """`load_aware_homes` of every rank with the kernel's tables equals the torch rule's, pair by pair."""
    ranks = torch.tensor_split(ids_Tk, num_ranks)
    visits = [None] * num_ranks if visited_TD is None else torch.tensor_split(visited_TD, num_ranks)
    pref = [replica_preferences(r, table_EM, num_devices, v)[1] for r, v in zip(ranks, visits)]
    gathered = torch.stack([preference_counts(r, p, table_EM.shape[0], table_EM.shape[1]) for r, p in zip(ranks, pref)])
    for rank, (ids, visited) in enumerate(zip(ranks, visits)):
        args = (ids, table_EM, num_devices, lambda _: gathered, rank, visited)
        assert torch.equal(load_aware_homes(*args, routes=fused_expert_routes), load_aware_homes(*args)), rank


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
    """The real trace (21k tokens, E=60, k=4) at D=8, its 8 hottest experts given a second home, over 4 ranks."""
    ids = torch.from_numpy(np.load(QWEN_TRACE)["topk_ids"].astype(np.int64))
    hottest = torch.argsort(torch.bincount(ids.reshape(-1), minlength=60), descending=True)[:8]
    table = _replicated_table(60, 8, {int(e): 1 for e in hottest}, seed=4)
    _same_routing_over_ranks(ids, table, 8, 4)


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
    from occult_hf.cuda_graph import capture
    from occult_hf.replica_routes_kernel import FusedRoutes

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
