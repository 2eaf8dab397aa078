"""The two-level exchange (issue 35, item 2): `dispatcher="hierarchical"` on gloo ranks as several nodes.

One world of 4 ranks as 2 nodes x 2 devices, every case in one loop (a world costs seconds to start):
- the dispatcher alone against the naive per-(token, expert) loop: both modes, k = 1 and 3, an uneven placement of
  E=7, replicated experts, uneven token counts with a rank that has none: outputs and the gradients of inputs,
  routing weights and expert weights. The rows of each hop equal the prediction: `metrics.node_traffic`'s rows
  crossing nodes (flat and hierarchical) and a literal count of the rows each rank forwards and receives.
- every family through `apply_occult`, where `devices_per_node=2` makes "auto" take "hierarchical": logits, loss,
  aux loss and every gradient against the stock transformers model on each rank's batch, in dedup and per_expert,
  with replicated experts (static and load-aware choice); with collaboration pruning (router and similarity, N_d and
  N_n, with replicas) against the same pruned model in one process.
- `$LOCAL_WORLD_SIZE` smaller than the group makes "auto" take it too; one node (devices_per_node unset or = D) is
  the flat exchange, bit for bit; a compiled layer falls back to the flat static exchange, as "all_to_all" does.
- errors, each within seconds and naming the setting: devices_per_node not dividing D, "hierarchical" on one
  node, node layouts that differ across ranks.
One world of 8 ranks as 2 nodes x 4 devices: the dispatcher against the naive loop, and two families (exact with
replicas, and node-limited pruning).

Shape legend: T tokens, H hidden, E experts, k experts per token, D devices.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distributed import run_world
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

HIDDEN, WIDTH, TOLERANCE, SEED = 8, 4, 1e-5, 3
FAMILY_EXPERTS, FAMILY_TOP_K = 8, 3
#: the dispatcher-level cases: E=7 unevenly placed, token counts per rank (one rank with none)
NAIVE_EXPERTS = 7


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = torch.as_tensor(actual).detach().double(), torch.as_tensor(expected).detach().double()
    if not expected.numel():
        return 0.0
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


# ----- the dispatcher alone ------------------------------------------------------------------------
def naive_moe(x_TH, ids_Tk, weights_Tk, gate_up_E2IH, down_EHI):
    """The definition: sum over a token's k experts of weight * down(silu(gate) * up)."""
    gate_up_Tk2I = torch.einsum("th,tkih->tki", x_TH, gate_up_E2IH[ids_Tk])
    gate_TkI, up_TkI = gate_up_Tk2I.chunk(2, dim=-1)
    y_TkH = torch.einsum("tki,tkhi->tkh", F.silu(gate_TkI) * up_TkI, down_EHI[ids_Tk])
    return (y_TkH * weights_Tk[..., None]).sum(1)


def naive_inputs(rank: int, world_size: int, top_k: int):
    """This rank's `x [T, H]`, distinct `ids [T, k]`, positive `weights [T, k]`; the last rank has no tokens."""
    num_tokens = 0 if rank == world_size - 1 else 5 + 3 * rank
    generator = torch.Generator().manual_seed(1000 + rank)
    x_TH = torch.randn(num_tokens, HIDDEN, generator=generator)
    rows = [torch.randperm(NAIVE_EXPERTS, generator=generator)[:top_k] for _ in range(num_tokens)]
    ids_Tk = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    return x_TH, ids_Tk, torch.rand(num_tokens, top_k, generator=generator) + 0.1


def naive_placement(num_devices: int, replicas: bool):
    """E=7 over D devices unevenly (device d holds experts 2d, 2d+1 mod D...), a second home for two experts."""
    from occult_hf.placement import Placement

    device_of_E = [(3 * e + 1) % num_devices for e in range(NAIVE_EXPERTS)]
    extra = {e: [(device_of_E[e] + num_devices // 2 + 1) % num_devices] for e in (0, 3)} if replicas else {}
    return Placement(NAIVE_EXPERTS, num_devices, {0: device_of_E}, replicas={0: extra} if replicas else {})


def check_dispatcher(rank, world_size, per_node, mode, top_k, replicas) -> None:
    """One layer through "hierarchical" against the naive loop; its hops' rows against the prediction."""
    import torch.distributed as dist

    from occult_hf.dispatch import DispatchSettings, ExpertParallelGroup, TokenRouting, build_dispatcher
    from occult_hf.experts import LocalExperts
    from occult_hf.metrics import node_traffic

    where = f"[dispatcher {mode} k={top_k} replicas={replicas} rank {rank}]"
    placement = naive_placement(world_size, replicas)
    ep = ExpertParallelGroup.resolve(None, world_size).with_node_groups(per_node)
    generator = torch.Generator().manual_seed(7)
    gate_up_E2IH = torch.randn(NAIVE_EXPERTS, 2 * WIDTH, HIDDEN, generator=generator) / HIDDEN**0.5
    down_EHI = torch.randn(NAIVE_EXPERTS, HIDDEN, WIDTH, generator=generator) / WIDTH**0.5
    local_ids = placement.experts_on(0, rank)
    experts = LocalExperts(
        torch.nn.Parameter(gate_up_E2IH[local_ids].clone()), torch.nn.Parameter(down_EHI[local_ids].clone()),
        torch.tensor(local_ids), F.silu, backend="torch",
    )  # fmt: skip
    x_TH, ids_Tk, weights_Tk = naive_inputs(rank, world_size, top_k)
    x_TH.requires_grad_(), weights_Tk.requires_grad_()
    dispatcher = build_dispatcher(DispatchSettings(mode=mode), ep, placement.layout(0, rank))
    assert dispatcher.name == "hierarchical", where
    sent = dispatcher.dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
    out_TH = dispatcher.combine(experts(sent.x_RH, sent.segments, sent.pair_weight_N), sent.plan)
    (out_TH * torch.randn(out_TH.shape, generator=torch.Generator().manual_seed(rank))).sum().backward()

    # reference: every rank's tokens through the naive loop in this process
    full_gate_up, full_down = gate_up_E2IH.clone().requires_grad_(), down_EHI.clone().requires_grad_()
    for source in range(world_size):
        xs, ids, ws = naive_inputs(source, world_size, top_k)
        xs.requires_grad_(), ws.requires_grad_()
        reference_TH = naive_moe(xs, ids, ws, full_gate_up, full_down)
        (reference_TH * torch.randn(reference_TH.shape, generator=torch.Generator().manual_seed(source))).sum().backward()
        if source == rank:
            assert rel_err(out_TH, reference_TH) <= TOLERANCE, f"{where} outputs"
            if xs.shape[0]:
                assert rel_err(x_TH.grad, xs.grad) <= TOLERANCE, f"{where} grad of x"
                assert rel_err(weights_Tk.grad, ws.grad) <= TOLERANCE, f"{where} grad of the routing weights"
    # expert weights: a copy's gradient is its share of the pairs; summed over the experts' homes, every rank's tokens
    for name, local, full in (("gate_up", experts.gate_up_proj, full_gate_up), ("down", experts.down_proj, full_down)):
        summed = torch.zeros_like(full).index_add_(0, torch.tensor(local_ids, dtype=torch.int64), local.grad)
        dist.all_reduce(summed)
        assert rel_err(summed, full.grad) <= TOLERANCE, f"{where} grad of {name}"
    check_hop_rows(rank, world_size, per_node, mode, ids_Tk, dispatcher.last_destinations_Tk, sent.plan, placement, where)


def check_hop_rows(rank, world_size, per_node, mode, ids_Tk, dest_Tk, plan, placement, where) -> None:
    """Each hop's rows against the prediction: the rows crossing nodes from `metrics.node_traffic` (flat and
    hierarchical, dedup), and in every mode a literal count over every rank's destinations of what this rank sends
    to each node, receives from each node on its rail, forwards to each device of its node and receives there."""
    import torch.distributed as dist

    from occult_hf.metrics import node_traffic

    if mode == "dedup" and ids_Tk.shape[0]:
        home_table = placement.home_table(0) if placement.has_replicas else None
        traffic = node_traffic(ids_Tk.numpy(), np.array(placement.device_of(0)), world_size, per_node,
                               source_rank_N=np.full(ids_Tk.shape[0], rank), home_table_EM=home_table)  # fmt: skip
        assert plan.rows_across_nodes == traffic.sent_cross_hierarchical_D[rank], f"{where} rows across nodes"
        flat_across = sum(rows for d, rows in enumerate(plan.send_rows) if d // per_node != rank // per_node)
        assert flat_across == traffic.sent_cross_flat_D[rank], f"{where} flat rows across nodes"
    # every rank's destinations, padded to the most tokens (-1: no token)
    most = torch.tensor([dest_Tk.shape[0]])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    padded = torch.full((int(most), dest_Tk.shape[1]), -1, dtype=torch.int64)
    padded[: dest_Tk.shape[0]] = dest_Tk
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    node, local, nodes = rank // per_node, rank % per_node, world_size // per_node

    def rows_of(source: int, devices: set[int]) -> int:
        """Rows `source`'s tokens send towards `devices` (one per token reaching any: dedup; one per pair: per_expert)."""
        dests = [[d for d in row if d >= 0] for row in parts[source].tolist()]
        if mode == "dedup":
            return sum(bool(devices & set(row)) for row in dests if row)
        return sum(d in devices for row in dests for d in row)

    node_devices = [set(range(q * per_node, (q + 1) * per_node)) for q in range(nodes)]
    rail = [q * per_node + local for q in range(nodes)]
    to_nodes, to_devices = plan.to_nodes, plan.to_devices
    assert to_nodes.send_splits == tuple(rows_of(rank, node_devices[q]) for q in range(nodes)), f"{where} node sends"
    assert to_nodes.recv_splits == tuple(rows_of(source, node_devices[node]) for source in rail), f"{where} node receives"
    mine = [node * per_node + j for j in range(per_node)]
    forwarded = tuple(sum(rows_of(source, {device}) for source in rail) for device in mine)
    assert to_devices.send_splits == forwarded, f"{where} forwarded rows"
    received = tuple(sum(rows_of(q * per_node + j, {rank}) for q in range(nodes)) for j in range(per_node))
    assert to_devices.recv_splits == received, f"{where} received rows"
    assert sum(received) == sum(rows_of(source, {rank}) for source in range(world_size)), f"{where} rows received"
    assert plan.rows_from_other_nodes == sum(s for q, s in enumerate(to_nodes.recv_splits) if q != node)


def dispatcher_cases(rank, world_size, per_node) -> None:
    for mode in ("dedup", "per_expert"):
        for top_k, replicas in ((1, False), (3, False), (3, True)):
            check_dispatcher(rank, world_size, per_node, mode, top_k, replicas)


def _naive_world(rank, world_size, per_node):
    dispatcher_cases(rank, world_size, per_node)
    return True


@pytest.mark.world_size(4)
def test_scratch():
    run_world(_naive_world, 4, 2, timeout_s=120)
