"""occult's custom operators (`torch.library`, namespace `occult`) and `torch.compile` over the kernel entry points, CPU.

- `torch.library.opcheck` on the CPU implementation of every operator that has one (schema and mutations, fake
  tensors, autograd registration, AOT dispatch with static and dynamic shapes);
- `torch.compile(backend="aot_eager", fullgraph=True)` of `LocalExperts` / `local_experts` forward and backward, the
  top-k layout, the row index, the row sum and the replica rule equal eager (logits and every gradient, fp32): a
  graph break inside occult's code fails `fullgraph=True`;
- a dynamic token dimension (`torch._dynamo.mark_dynamic`) compiles once for several token counts.

The Triton implementations of the same operators run in the interpreted child process of
tests/test_triton_kernels.py (opcheck and compile there, `test_triton_ops_*`) and on a GPU in
tests/test_gpu_compile_ops.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn
from torch.library import opcheck

from occult_hf.experts import LocalExperts, local_experts
from occult_hf.kernels import ExpertSegments, row_sum
from occult_hf.kernels.layout import row_index
from occult_hf.kernels.replica_pairs import FUSED_PAIRS
from occult_hf.kernels.replica_routes import FusedRoutes
from occult_hf.replicas.routing import PIN_SLACK, expert_routes, home_table_from, load_aware_homes, preferences_and_counts

NUM_EXPERTS, HIDDEN, WIDTH, TOP_K = 6, 16, 8, 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _routing(tokens: int, seed: int, experts: int = NUM_EXPERTS, top_k: int = TOP_K):
    """`(topk_ids [T, k], topk_weights [T, k])`: k distinct experts per token, as a router's top-k gives."""
    generator = torch.Generator().manual_seed(seed)
    ids_Tk = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    return ids_Tk, torch.rand(tokens, top_k, generator=generator)


def _experts(act_fn=None, grad_scale: float = 0.5) -> LocalExperts:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=generator) / math.sqrt(HIDDEN)
    down = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=generator) / math.sqrt(WIDTH)
    return LocalExperts(
        nn.Parameter(gate_up), nn.Parameter(down), torch.arange(NUM_EXPERTS), act_fn or nn.SiLU(), grad_scale=grad_scale
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _moe_step(experts: LocalExperts):
    """The expert half of a one-device MoE block: the top-k layout, then the experts."""

    def step(x_TH, ids_Tk, weights_Tk):
        segments, weight_N = ExpertSegments.from_topk(ids_Tk, weights_Tk, NUM_EXPERTS)
        return experts(x_TH, segments, weight_N)

    return step


def _forward_backward(fn, experts: LocalExperts, x_TH, ids_Tk, weights_Tk, grad_TH, dynamic: bool = False):
    x_TH, weights_Tk = x_TH.clone().requires_grad_(), weights_Tk.clone().requires_grad_()
    if dynamic:  # the token dimension of every input
        for tensor in (x_TH, ids_Tk, weights_Tk):
            torch._dynamo.mark_dynamic(tensor, 0)
    out_TH = fn(x_TH, ids_Tk, weights_Tk)
    grads = torch.autograd.grad(out_TH, (x_TH, weights_Tk, experts.gate_up_proj, experts.down_proj), grad_TH)
    return out_TH.detach(), grads


def test_local_experts_compiled_equal_eager_with_a_dynamic_token_count():
    """`LocalExperts` behind `ExpertSegments.from_topk` (the layout's sort and the reference expert computation as
    operators, the 1/D gradient scale as an autograd Function) compiled with fullgraph: output and the gradients of
    the rows, the routing weights and both expert weights equal eager; three token counts, one compilation."""
    experts = _experts()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_moe_step(experts), backend=counter, fullgraph=True)
    for tokens in (7, 12, 29):
        ids_Tk, weights_Tk = _routing(tokens, seed=tokens)
        x_TH = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        grad_TH = torch.randn(tokens, HIDDEN)
        got, got_grads = _forward_backward(compiled, experts, x_TH, ids_Tk, weights_Tk, grad_TH, dynamic=tokens == 7)
        want, want_grads = _forward_backward(_moe_step(experts), experts, x_TH, ids_Tk, weights_Tk, grad_TH)
        assert rel_err(got, want) <= 1e-5, tokens
        for name, g, w in zip(("x", "routing weights", "gate_up_proj", "down_proj"), got_grads, want_grads):
            assert rel_err(g, w) <= 1e-5, (tokens, name)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for three token counts"
    graph = counter.graphs[0].code
    assert "occult.sort_by_group" in graph and "occult.expert_mlp_reference" in graph


@pytest.mark.parametrize("act_fn", [F.silu, nn.GELU(approximate="tanh")], ids=["silu", "gelu_tanh"])
def test_local_experts_function_compiled_on_an_unsorted_layout(act_fn):
    """`local_experts` over `from_pairs`' layout (rows served by no pair, an empty expert), compiled: equal to eager,
    forward and all four gradients, for both activations the operators name."""
    generator = torch.Generator().manual_seed(3)
    rows = 10
    pairs = [(r, e) for r in range(rows) for e in (0, 2, 3, 5) if (r * e) % 3 == 1]
    pair_row = torch.tensor([r for r, _ in pairs])
    pair_expert = torch.tensor([e for _, e in pairs])
    x_RH = torch.randn(rows, HIDDEN, generator=generator)
    weight_P = torch.rand(len(pairs), generator=generator)
    experts = _experts(grad_scale=1.0)

    def fn(x_RH, weight_P):
        segments, order_N = ExpertSegments.from_pairs(pair_row, pair_expert, rows, NUM_EXPERTS)
        return local_experts(x_RH, segments, weight_P[order_N], experts.gate_up_proj, experts.down_proj, act_fn, "torch")

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (compiled, fn):
        x, w = x_RH.clone().requires_grad_(), weight_P.clone().requires_grad_()
        out = f(x, w)
        results.append((out, torch.autograd.grad(out, (x, w, experts.gate_up_proj, experts.down_proj), torch.ones_like(out))))
    (got, got_grads), (want, want_grads) = results
    assert rel_err(got, want) <= 1e-5 and all(rel_err(g, w) <= 1e-5 for g, w in zip(got_grads, want_grads))


def test_an_activation_no_operator_names_is_one_named_graph_break():
    """An expert activation outside `ACTIVATIONS` keeps the eager reference (its host read cannot be traced): one
    graph break that says why, and the compiled result still equals eager."""
    experts = _experts(act_fn=torch.relu, grad_scale=1.0)
    ids_Tk, weights_Tk = _routing(5, seed=1)
    x_TH = torch.randn(5, HIDDEN)
    explanation = torch._dynamo.explain(_moe_step(experts))(x_TH, ids_Tk, weights_Tk)
    assert len(explanation.break_reasons) == 1
    assert "ACTIVATIONS" in str(explanation.break_reasons[0].reason)
    compiled = torch.compile(_moe_step(experts), backend="aot_eager")
    assert rel_err(compiled(x_TH, ids_Tk, weights_Tk), _moe_step(experts)(x_TH, ids_Tk, weights_Tk)) <= 1e-6


def test_layout_and_row_index_compiled_equal_eager():
    """`from_topk` / `from_pairs` and `row_index` through `occult::sort_by_group`: the same integers as eager, the
    routing weights' gradient included, for two token counts and one compilation."""

    def layout(ids_Tk, weights_Tk):
        segments, weight_N = ExpertSegments.from_topk(ids_Tk, weights_Tk, NUM_EXPERTS)
        row_pairs_N, row_offsets = row_index(segments.pair_row, segments.num_rows)
        return segments.pair_row, segments.expert_offsets, row_pairs_N, row_offsets, weight_N

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layout, backend=counter, fullgraph=True)
    for tokens in (9, 40):
        ids_Tk, weights_Tk = _routing(tokens, seed=tokens)
        got_w, want_w = weights_Tk.clone().requires_grad_(), weights_Tk.clone().requires_grad_()
        if tokens == 9:
            torch._dynamo.mark_dynamic(ids_Tk, 0)
            torch._dynamo.mark_dynamic(got_w, 0)
        got, want = compiled(ids_Tk, got_w), layout(ids_Tk, want_w)
        assert all(torch.equal(g, w) for g, w in zip(got[:4], want[:4]))
        upstream_N = torch.randn(tokens * TOP_K)
        (got[4] * upstream_N).sum().backward()
        (want[4] * upstream_N).sum().backward()
        assert torch.equal(got[4], want[4]) and torch.equal(got_w.grad, want_w.grad)
    assert counter.frame_count == 1


def test_row_sum_compiled_writes_into_a_chunk_of_the_output():
    """`row_sum.sum_rows` compiled (`occult::sum_rows`, which mutates its `out` argument): into a fresh output and
    into a slice of a larger one, the sums of `sum_rows_torch`, rows outside the slice untouched."""
    generator = torch.Generator().manual_seed(0)
    rows_OH = torch.randn(9, 12, generator=generator)
    row_TJ = torch.randint(0, 9, (6, 3), generator=generator)
    compiled = torch.compile(row_sum.sum_rows, backend="aot_eager", fullgraph=True)
    expected_TH = row_sum.sum_rows_torch(rows_OH, row_TJ)
    assert torch.equal(compiled(rows_OH, row_TJ), expected_TH)

    def into_chunk(rows_OH, row_TJ, out_TH):
        row_sum.sum_rows(rows_OH, row_TJ, out_TH[2:8])
        return out_TH

    out_TH = torch.full((10, 12), 7.0)
    compiled_chunk = torch.compile(into_chunk, backend="aot_eager", fullgraph=True)
    compiled_chunk(rows_OH, row_TJ, out_TH)
    assert torch.equal(out_TH[2:8], expected_TH) and bool((out_TH[:2] == 7).all()) and bool((out_TH[8:] == 7).all())


def _two_ranks(counts_EM1: torch.Tensor) -> torch.Tensor:
    """A stand-in for the group's all-gather: this rank's counts after another rank's (rank 1 of 2: a line offset)."""
    return torch.stack([counts_EM1.flip(0), counts_EM1])


def _replica_table() -> torch.Tensor:
    """8 experts on 4 devices, experts 0 and 5 with a second home, expert 2 with three."""
    return torch.from_numpy(home_table_from([0, 0, 1, 1, 2, 2, 3, 3], {0: [2], 5: [1], 2: [0, 3]}))


@pytest.mark.parametrize("pinned", [False, True], ids=["free", "pinned"])
def test_load_aware_rule_compiled_equals_eager(pinned):
    """The load-aware replica rule as the dispatchers run it (`FusedRoutes`, `FUSED_PAIRS`: the operators
    `occult::expert_routes`, `occult::replica_preferences`, `occult::replica_assign`) compiled: every pair's device
    equal to eager, with and without collaboration pruning's devices, for two token counts and one compilation."""
    table_EM = _replica_table()
    routes = FusedRoutes()

    def rule(ids_Tk, devices_TD):
        return load_aware_homes(ids_Tk, table_EM, 4, _two_ranks, 1, devices_TD, PIN_SLACK, routes, FUSED_PAIRS)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(rule, backend=counter, fullgraph=True)
    for tokens in (30, 77):
        ids_Tk, _ = _routing(tokens, seed=tokens, experts=8, top_k=3)
        devices_TD = torch.rand(tokens, 4, generator=torch.Generator().manual_seed(tokens)) < 0.4 if pinned else None
        if tokens == 30:
            torch._dynamo.mark_dynamic(ids_Tk, 0)
            if pinned:
                torch._dynamo.mark_dynamic(devices_TD, 0)
        assert torch.equal(compiled(ids_Tk, devices_TD), rule(ids_Tk, devices_TD))
    assert counter.frame_count == 1


def _expert_problem(requires_grad: bool = True):
    generator = torch.Generator().manual_seed(4)
    ids_Tk, weights_Tk = _routing(7, seed=4)
    segments, weight_N = ExpertSegments.from_topk(ids_Tk, weights_Tk, NUM_EXPERTS)
    tensors = (
        torch.randn(7, HIDDEN, generator=generator),
        weight_N,
        torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=generator) / 4,
        torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=generator) / 4,
    )
    return [t.requires_grad_(requires_grad) for t in tensors], segments


def _opcheck_cases():
    """(name, operator, arguments) of every operator's CPU implementation."""
    generator = torch.Generator().manual_seed(9)
    group_N = torch.randint(0, 6, (40,), generator=generator)  # 5 groups, and group id 5: past the last
    minor_N = torch.randint(0, 11, (40,), generator=generator)
    ids_Tk, weights_Tk = _routing(9, seed=9)
    (x_RH, weight_N, gate_up, down), segments = _expert_problem()
    layout = (segments.pair_row, segments.expert_offsets)
    table_EM = _replica_table()
    devices_TD = torch.rand(9, 4, generator=generator) < 0.5
    replica_ids_Tk, _ = _routing(9, seed=10, experts=8, top_k=3)
    pref_Tk, counts_EM1 = preferences_and_counts(replica_ids_Tk, table_EM, 4)
    gathered_GEM1 = torch.stack([counts_EM1, counts_EM1.flip(0)])
    tables = expert_routes(gathered_GEM1, table_EM, 4, 1, PIN_SLACK, False)
    ops = torch.ops.occult
    return [
        ("sort_by_group", ops.sort_by_group, (group_N, 5, minor_N, 11)),
        ("sort_by_group without minor keys", ops.sort_by_group, (group_N, 5, None, 1)),
        ("topk_layout", ops.topk_layout, (ids_Tk, weights_Tk.requires_grad_(), NUM_EXPERTS)),
        ("expert_mlp_reference", ops.expert_mlp_reference, (x_RH, weight_N, gate_up, down, *layout, "silu", False)),
        (
            "expert_mlp_reference_backward",
            ops.expert_mlp_reference_backward,
            (torch.randn(7, HIDDEN), *(t.detach() for t in (x_RH, weight_N, gate_up, down)), torch.empty(0, 2 * WIDTH),
             *layout, "gelu_tanh", [True, False, True, True]),
        ),  # fmt: skip
        ("sum_rows", ops.sum_rows, (torch.randn(9, 12, generator=generator), torch.randint(0, 9, (6, 3), generator=generator), torch.empty(6, 12))),
        ("expert_routes", ops.expert_routes, (gathered_GEM1, table_EM, 4, 1, PIN_SLACK, False)),
        ("replica_preferences", ops.replica_preferences, (replica_ids_Tk, table_EM, 4, None)),
        ("replica_preferences with devices", ops.replica_preferences, (replica_ids_Tk, table_EM, 4, devices_TD)),
        ("replica_assign", ops.replica_assign, (replica_ids_Tk, pref_Tk, table_EM, *tables)),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())), ids=[name for name, _, _ in _opcheck_cases()])
def test_opcheck_cpu_implementations(case):
    _, op, args = _opcheck_cases()[case]
    opcheck(op, args)


def test_the_first_compilation_does_not_recompile_on_the_triton_question(monkeypatch):
    """`triton_importable` answers lazily; asked first inside a traced function it must be a constant to dynamo, not a
    guard on the unanswered question (which recompiled the first graph of every process on a GPU)."""
    from occult_hf.kernels import triton_support

    monkeypatch.setattr(triton_support, "_IMPORTABLE", None)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: x + 1 if triton_support.triton_importable() else x - 1, backend=counter, fullgraph=True)
    for _ in range(3):
        compiled(torch.zeros(3))
    assert counter.frame_count == 1
