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
One world of 8 ranks as 2 nodes x 4 devices: the dispatcher against the naive loop (both modes, replicas), and three
families (exact with replicas; N_d within N_n, router; N_n with replicas, similarity, per_expert).

Shape legend: T tokens, H hidden, E experts, k experts per token, D devices.
"""

from __future__ import annotations

import contextlib
import os
import re
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distributed import run_world
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

HIDDEN, WIDTH, TOLERANCE, SEED = 8, 4, 1e-5, 3
EXPERTS_PER_DEVICE, FAMILY_TOP_K = 4, 3
#: the dispatcher-level cases: D + 3 experts (E=7 at D=4), unevenly placed
EXTRA_EXPERTS = 3


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
    rows = [torch.randperm(world_size + EXTRA_EXPERTS, generator=generator)[:top_k] for _ in range(num_tokens)]
    ids_Tk = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    return x_TH, ids_Tk, torch.rand(num_tokens, top_k, generator=generator) + 0.1


def naive_placement(num_devices: int, replicas: bool):
    """D + 3 experts over D devices unevenly (expert e on device 3e + 1 mod D: some hold two, some one); with
    `replicas` a second home for two experts, on the other node."""
    from occult_hf.placement import Placement

    num_experts = num_devices + EXTRA_EXPERTS
    device_of_E = [(3 * e + 1) % num_devices for e in range(num_experts)]
    extra = {e: [(device_of_E[e] + num_devices // 2 + 1) % num_devices] for e in (0, 3)} if replicas else {}
    return Placement(num_experts, num_devices, {0: device_of_E}, replicas={0: extra} if replicas else {})


def check_dispatcher(rank, world_size, per_node, mode, top_k, replicas) -> None:
    """One layer through "hierarchical" against the naive loop; its hops' rows against the prediction."""
    import torch.distributed as dist

    from occult_hf.dispatch import DispatchSettings, ExpertParallelGroup, TokenRouting, build_dispatcher
    from occult_hf.experts import LocalExperts

    where = f"[dispatcher {mode} k={top_k} replicas={replicas} rank {rank}]"
    placement = naive_placement(world_size, replicas)
    ep = ExpertParallelGroup.resolve(None, world_size).with_node_groups(per_node)
    generator = torch.Generator().manual_seed(7)
    gate_up_E2IH = torch.randn(placement.num_experts, 2 * WIDTH, HIDDEN, generator=generator) / HIDDEN**0.5
    down_EHI = torch.randn(placement.num_experts, HIDDEN, WIDTH, generator=generator) / WIDTH**0.5
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
    check_hop_rows(rank, world_size, per_node, mode, ids_Tk, dispatcher.last_destinations_Tk, sent.plan, dispatcher.layout, where)


def check_hop_rows(rank, world_size, per_node, mode, ids_Tk, dest_Tk, plan, layout, where) -> None:
    """Each hop's rows against the prediction: in dedup the rows crossing nodes from `metrics.node_traffic` (flat and
    hierarchical) for the layer's `layout` (None where its replica rule is not the metrics' static one: pruning or
    the load-aware choice with replicas), and in every mode a literal count over every rank's destinations of what
    this rank sends to each node, receives from each node on its rail, forwards to each device of its node and
    receives there."""
    import torch.distributed as dist

    from occult_hf.metrics import node_traffic

    if mode == "dedup" and ids_Tk.shape[0] and layout is not None:
        home_table = layout.home_table_EM.numpy() if layout.replicated else None
        traffic = node_traffic(ids_Tk.numpy(), layout.device_of_E.numpy(), world_size, per_node,
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


def dispatcher_cases(rank, world_size, per_node) -> None:
    for mode in ("dedup", "per_expert"):
        for top_k, replicas in ((1, False), (3, False), (3, True)):
            check_dispatcher(rank, world_size, per_node, mode, top_k, replicas)


# ----- every family through apply_occult ------------------------------------------------------------------
def rank_batch(rank: int) -> torch.Tensor:
    return tiny_batch(seed=500 + rank)


def family_placement(family: str, num_devices: int, replicas: bool):
    """Each layer's experts (4 a device) shuffled over the devices; with `replicas` experts 0..D/2-1 get a second home
    on the other half of the devices, another node (so the replica rule's choice decides which node serves a pair)."""
    from occult_hf.placement import Placement

    num_experts = EXPERTS_PER_DEVICE * num_devices
    base = np.arange(num_experts) // EXPERTS_PER_DEVICE
    maps = {layer: np.random.default_rng(10 * layer + num_devices).permutation(base).tolist() for layer in MOE_LAYERS[family]}
    extra = {layer: {e: [(maps[layer][e] + num_devices // 2) % num_devices] for e in range(num_devices // 2)} for layer in maps}
    return Placement(num_experts, num_devices, maps, replicas=extra if replicas else {})


def family_config(case: dict, num_devices: int, profiles: dict):
    """The `OccultConfig` of a case: `family`, `mode`, `replicas`, and where given `replica_choice`, `prune`, `n_d`,
    `n_n`, `per_node` (devices_per_node; absent: unset). A case's `launched` is the `$LOCAL_WORLD_SIZE` it runs with."""
    from occult_hf import OccultConfig

    prune = case.get("prune")
    return OccultConfig(
        placement=family_placement(case["family"], num_devices, case["replicas"]), dispatch=case["mode"],
        devices_per_node=case.get("per_node"), replica_choice=case.get("replica_choice", "static"), prune=prune,
        max_devices_per_token=case.get("n_d"), max_nodes_per_token=case.get("n_n"),
        profile=profiles.get(case["family"]) if prune == "similarity" else None,
    )  # fmt: skip


def family_model(family: str, num_devices: int):
    return tiny_model(family, seed=SEED, num_experts=EXPERTS_PER_DEVICE * num_devices, top_k=FAMILY_TOP_K).train()


def vanilla_grads(model, modules: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`(replicated, experts)`: every parameter's gradient under its stock transformers name, the routed experts' of
    `modules` (an occult model's `occult_modules`) apart, in expert order, NaN for an expert this rank does not hold.
    The norm carriers are left out."""
    from occult_hf.hf.blocks import place_full_experts

    skip = {f"{path}.{name}" for path in modules for name in ("experts.gate_up_proj", "experts.down_proj", "ep_grad_norm_carrier")}
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in model.named_parameters() if n not in skip}
    experts = {}
    for path, module in modules.items():
        full = []
        for param in (module.experts.gate_up_proj, module.experts.down_proj):
            filled = torch.full((module.layout.num_experts, *param.shape[1:]), float("nan"))
            filled[module.experts.expert_ids] = param.grad
            full.append(filled)
        experts.update({f"{path}.{key}": grad for key, grad in place_full_experts(module, *full).items()})
    return grads, experts


def mean_over_ranks(grads: dict[str, torch.Tensor], world_size: int) -> dict[str, torch.Tensor]:
    """The mean over the ranks of each gradient (what DDP makes of the replicated parameters' gradients)."""
    import torch.distributed as dist

    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= world_size
    return grads


def check_family_case(rank, world_size, case: dict, profiles: dict, alone) -> None:
    """One case on this rank against its reference, computed here: the stock transformers model, or with pruning the
    same pruned model in this process alone (`alone`: a group of this one rank; logical devices, the same node
    layout), on this rank's batch, gradients averaged over the ranks. Logits, loss, aux loss, every gradient; the
    hops' rows against the prediction."""
    from occult_hf.hf.apply import apply_occult, occult_modules

    where = f"[{case} D={world_size} rank {rank}]"
    ids = rank_batch(rank)
    config = family_config(case, world_size, profiles)
    reference = family_model(case["family"], world_size)
    if case.get("prune"):
        apply_occult(reference, config, group=alone)
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    replicated, experts = vanilla_grads(reference, occult_modules(reference) if case.get("prune") else {})
    expected_grads = mean_over_ranks({**replicated, **experts}, world_size)

    with local_world_size(case.get("launched")):
        model = apply_occult(family_model(case["family"], world_size), config)
    modules = occult_modules(model)
    plans = {path: recorded_plans(module.dispatcher) for path, module in modules.items()}
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert rel_err(out.logits, expected.logits) <= TOLERANCE, f"{where} logits"
    assert rel_err(out.loss, expected.loss) <= TOLERANCE, f"{where} loss"
    if getattr(expected, "aux_loss", None) is not None:
        assert rel_err(out.aux_loss, expected.aux_loss) <= TOLERANCE, f"{where} aux loss"
    replicated, experts = vanilla_grads(model, modules)
    grads = {**mean_over_ranks(replicated, world_size), **experts}  # the experts' are the mean already (1/D)
    assert grads.keys() == expected_grads.keys(), f"{where} parameters"
    for name, grad in grads.items():
        known = ~grad.isnan()
        assert known.any() and rel_err(grad[known], expected_grads[name][known]) <= TOLERANCE, f"{where} grad of {name}"
    own_rule = case["replicas"] and (case.get("prune") or case.get("replica_choice") == "load_aware")
    for path, module in modules.items():
        assert module.dispatcher.name == "hierarchical", f"{where} {path}: {module.dispatcher.name}"
        (plan,) = plans[path]
        check_hop_rows(rank, world_size, module.ep.devices_per_node, case["mode"], module.last_topk_ids_Tk,
                       module.dispatcher.last_destinations_Tk, plan, None if own_rule else module.layout, where)  # fmt: skip


def recorded_plans(dispatcher) -> list:
    """The plan of each `run()` of `dispatcher` from now on (the model keeps only its row counts)."""
    plans, run = [], dispatcher.run

    def recording(*args, **kwargs):
        out_TH, plan = run(*args, **kwargs)
        plans.append(plan)
        return out_TH, plan

    dispatcher.run = recording
    return plans


def family_cases(per_node: int) -> list[dict]:
    """Every family exact (dedup, two in per_expert; shuffled and replicated alternately, OLMoE also with the
    load-aware replica choice), then pruning: router and similarity, N_n, N_d and both, with and without replicas."""
    cases = [
        dict(family=family, mode="per_expert" if i in (1, 5) else "dedup", replicas=bool(i % 2), per_node=per_node)
        for i, family in enumerate(FAMILIES)
    ]
    cases.append(dict(family="olmoe", mode="dedup", replicas=True, replica_choice="load_aware", per_node=per_node))
    cases += [
        dict(family="olmoe", mode="dedup", replicas=False, prune="router", n_n=1, per_node=per_node),
        dict(family="qwen2_moe", mode="dedup", replicas=True, prune="similarity", n_n=1, per_node=per_node),
        dict(family="deepseek_v3", mode="dedup", replicas=True, prune="router", n_d=1, per_node=per_node),
        dict(family="mixtral", mode="per_expert", replicas=False, prune="similarity", n_d=2, n_n=1, per_node=per_node),
    ]
    return cases


def profiles_for(families, num_devices: int) -> dict[str, str]:
    """A routing profile of each family's tiny model (similarity pruning reads one), in a temporary folder."""
    import tempfile

    from occult_hf.profile import RoutingProfile

    folder = tempfile.mkdtemp(prefix="occult_hierarchical_")
    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    paths = {}
    for family in families:
        paths[family] = f"{folder}/{family}.safetensors"
        RoutingProfile.collect(family_model(family, num_devices), documents, progress=False).save(paths[family])
    return paths


@contextlib.contextmanager
def local_world_size(value: str | None):
    """`$LOCAL_WORLD_SIZE` set to `value` inside the block (None: unset), as a launcher of several nodes sets it."""
    before = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if value is not None:
        os.environ["LOCAL_WORLD_SIZE"] = value
    try:
        yield
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if before is not None:
            os.environ["LOCAL_WORLD_SIZE"] = before


def check_one_node(rank, world_size) -> str:
    """devices_per_node unset, equal to D, and `$LOCAL_WORLD_SIZE` equal to the group: one node, the flat dispatcher
    "auto" takes today, with the same logits and gradients bit for bit. Returns its name."""
    from occult_hf.hf.apply import apply_occult, occult_modules

    ids, runs = rank_batch(rank), {}
    for label, per_node, launched in (("unset", None, None), ("= D", world_size, None), ("$LOCAL_WORLD_SIZE = D", None, str(world_size))):
        case = dict(family="olmoe", mode="dedup", replicas=True, per_node=per_node)
        with local_world_size(launched):
            model = apply_occult(family_model("olmoe", world_size), family_config(case, world_size, {}))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        modules = occult_modules(model)
        assert not any(m.ep.spans_nodes for m in modules.values()), label
        names = {m.dispatcher.name for m in modules.values()}
        runs[label] = (names, out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (names, logits, grads), *others = runs.values()
    for label, (other_names, other_logits, other_grads) in zip(list(runs)[1:], others):
        assert other_names == names and torch.equal(other_logits, logits), f"one node, {label}"
        assert other_grads.keys() == grads.keys() and all(torch.equal(other_grads[n], g) for n, g in grads.items()), label
    (name,) = names
    return name


def check_compiled_layer(rank, world_size) -> str:
    """A compiled layer of a model on two nodes (`fullgraph=True`, no graph break) takes the flat static exchange as
    "all_to_all" does, with the eager two-level exchange's outputs. Returns the class that served the compiled run."""
    from occult_hf.hf.apply import apply_occult, occult_modules

    case = dict(family="olmoe", mode="dedup", replicas=True, per_node=2)
    model = apply_occult(family_model("olmoe", world_size), family_config(case, world_size, {})).eval()
    layer = next(iter(occult_modules(model).values()))
    served = []
    traced_run = layer.dispatcher._traced.run
    layer.dispatcher._traced.run = lambda *args, **kwargs: served.append(type(layer.dispatcher._traced).__name__) or traced_run(*args, **kwargs)
    x_BSH = torch.randn(2, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        eager = layer(x_BSH)
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="eager", fullgraph=True)(x_BSH)
    assert served and rel_err(compiled, eager) <= TOLERANCE, served
    return served[0]


def bad_node_settings(rank, world_size) -> dict[str, tuple[str, float]]:
    """What apply_occult raises on this rank, and how fast, for each bad node setting."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    settings = {
        "devices_per_node=3": (OccultConfig(devices_per_node=3), None),
        "$LOCAL_WORLD_SIZE=3": (OccultConfig(), "3"),
        "hierarchical on one node": (OccultConfig(dispatcher="hierarchical"), None),
        "devices_per_node differs": (OccultConfig(devices_per_node=1 if rank == world_size - 1 else 2), None),
        "$LOCAL_WORLD_SIZE differs": (OccultConfig(), "1" if rank == 0 else "2"),
    }
    found = {}
    for label, (config, launched) in settings.items():
        start = time.monotonic()
        try:
            with local_world_size(launched):
                apply_occult(family_model("olmoe", world_size), config)
            found[label] = ("no error", 0.0)
        except Exception as error:  # noqa: BLE001 - what each rank sees is the point
            found[label] = (f"{type(error).__name__}: {error}", time.monotonic() - start)
    return found


#: what each rank's error must say, by bad setting
BAD_SETTING_ERRORS = {
    "devices_per_node=3": r"OccultConfig.devices_per_node=3 does not divide num_devices=4",
    "$LOCAL_WORLD_SIZE=3": r"\$LOCAL_WORLD_SIZE=3 does not divide num_devices=4",
    "hierarchical on one node": r"OccultConfig.dispatcher='hierarchical' cannot serve 4 devices .*it needs an expert-parallel "
    r"group that spans nodes: OccultConfig.devices_per_node",
    "devices_per_node differs": r"disagree at apply_occult on devices_per_node \(rank 0 2, rank 1 2, rank 2 2, rank 3 1\)",
    "$LOCAL_WORLD_SIZE differs": r"disagree at apply_occult on devices_per_node \(rank 0 1, rank 1 2, rank 2 2, rank 3 2\)",
}


def rows_of_another_format(rank, world_size) -> str:
    """The error each rank raises when rank 3 dispatches float64 rows and the others float32: at the count exchange
    of both hops, before any row moves."""
    from occult_hf.dispatch import DispatchSettings, ExchangeError, ExpertParallelGroup, TokenRouting, build_dispatcher

    placement = naive_placement(world_size, replicas=False)
    ep = ExpertParallelGroup.resolve(None, world_size).with_node_groups(2)
    dispatcher = build_dispatcher(DispatchSettings(), ep, placement.layout(0, rank), label="layer 0")
    x_TH, ids_Tk, weights_Tk = naive_inputs(rank, world_size, 2)
    try:
        dispatcher.dispatch(x_TH.double() if rank == 3 else x_TH, TokenRouting(ids_Tk, weights_Tk))
    except ExchangeError as error:
        return str(error)
    return "no error"


def unused_chunks_warnings(rank, world_size) -> list[str]:
    """What occult_hf logs when "auto" takes "hierarchical" (one chunk) for two layers with `chunks=2`."""
    import logging

    from occult_hf.dispatch import DispatchSettings, ExpertParallelGroup, build_dispatcher
    from occult_hf.utils.logging import get_logger

    placement = naive_placement(world_size, replicas=False)
    ep = ExpertParallelGroup.resolve(None, world_size).with_node_groups(2)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        names = [build_dispatcher(DispatchSettings(chunks=2), ep, placement.layout(0, rank)).name for _ in range(2)]
    finally:
        get_logger().removeHandler(handler)
    assert names == ["hierarchical", "hierarchical"], names
    return [record.getMessage() for record in records]


def _four_rank_world(rank, world_size, cases, profiles):
    import torch.distributed as dist

    alone, _ = dist.new_subgroups(group_size=1)
    dispatcher_cases(rank, world_size, 2)
    for case in cases:
        check_family_case(rank, world_size, case, profiles, alone)
    return (
        check_one_node(rank, world_size), check_compiled_layer(rank, world_size), bad_node_settings(rank, world_size),
        rows_of_another_format(rank, world_size), unused_chunks_warnings(rank, world_size),
    )  # fmt: skip


def _eight_rank_world(rank, world_size, cases, profiles):
    import torch.distributed as dist

    alone, _ = dist.new_subgroups(group_size=1)
    for mode in ("dedup", "per_expert"):
        check_dispatcher(rank, world_size, 4, mode, 3, replicas=True)
    for case in cases:
        check_family_case(rank, world_size, case, profiles, alone)


@pytest.mark.world_size(4)
def test_two_nodes_of_two_devices_every_family_exact():
    cases = family_cases(per_node=2)
    # $LOCAL_WORLD_SIZE below the group (torchrun on 2 nodes) takes the two-level exchange without devices_per_node
    cases.append(dict(family="qwen3_moe", mode="dedup", replicas=True, launched="2"))
    profiles = profiles_for({c["family"] for c in cases if c.get("prune") == "similarity"}, 4)
    results = run_world(_four_rank_world, 4, cases, profiles, timeout_s=300)
    for rank, (one_node, compiled, errors, format_error, chunk_warnings) in enumerate(results):
        assert one_node in ("padded", "all_to_all") and compiled == "PaddedDispatcher"
        assert chunk_warnings == [
            "OccultConfig.dispatch_chunks=2 is unused: dispatcher='auto' chose 'hierarchical' for this group, which runs "
            "one chunk (only ['all_to_all'] overlap chunks)"
        ], chunk_warnings
        other, mine = ("float64", "float32") if rank < 3 else ("float32", "float64")
        assert format_error.startswith(f"layer 0: EP rank {3 if rank < 3 else 0} sends rows of format [{other} x {HIDDEN}, "), format_error
        assert f"and this rank [{mine} x {HIDDEN}, " in format_error, format_error
        for label, pattern in BAD_SETTING_ERRORS.items():
            message, seconds = errors[label]
            assert re.search(pattern, message), (label, message)
            assert seconds < 10, (label, seconds)


@pytest.mark.world_size(8)
def test_two_nodes_of_four_devices_every_family_exact():
    cases = family_cases(per_node=4)
    profiles = profiles_for({c["family"] for c in cases if c.get("prune") == "similarity"}, 8)
    run_world(_eight_rank_world, 8, cases, profiles, timeout_s=300)
