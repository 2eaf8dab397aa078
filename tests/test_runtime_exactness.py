"""Expert parallelism is exact: every family, 2 and 4 gloo ranks, both dispatch modes, two placements.

For each case every rank runs `apply_occult` on a tiny random model of the real transformers class,
wraps it in DDP (so the runtime's DDP ignore list is exercised), and does forward + backward on its
own batch. The reference is the unreplaced model in one process: rank r's logits, loss and aux loss
are those of the reference on rank r's batch, and the reference gradient is the mean over ranks of
the gradients of each rank's loss (what DDP training on the ranks' batches means, and what
single-process training on the concatenated batch gives when the loss is the mean of the ranks'
losses). Checked per rank, relative error <= 1e-5 in fp32: logits, loss, aux loss, the gradient of
every replicated parameter, the gradient of every local expert (mapped to the vanilla checkpoint
entries through the family adapter), and the global gradient norm that `clip_grad_norm_` sees on each rank.
The parent checks that the ranks together covered every parameter of the reference.

Also per case: each rank holds only its own experts (the original block's expert storage is
released), and in dedup mode the rows sent equal the CT count of the dispatched routing.

World 2 (E=8): every family x {dedup, per_expert} x {contiguous with one chunk, shuffled per layer
with 3 chunks (the pipelined exchange)}.
World 4 (E=6, so D does not divide E): every family x {(dedup, shuffled, 2 chunks), (per_expert,
contiguous, chunks chosen from T)}, on the "all_to_all" dispatcher. The static "padded" dispatcher (no count
exchange; what `dispatcher="auto"` picks where its padding is cheap): every family in dedup on 2 ranks (shuffled
and replicated placements alternately, and OLMoE with the load-aware replica choice), and two families on 4 ranks
(dedup and per_expert).
Replicated experts (the shuffled map plus a second home for experts 0..D-1, docs/design.md §6): every
family in dedup mode on 2 ranks, and on 4 ranks alternately dedup and per_expert; each rank's copy
must carry the expert's full gradient (the sum over its holders) and the norm counts it once. The
same with `replica_choice="load_aware"` (one more all-gather per layer; rows sent checked against
the rule recomputed from a fresh gather), on 2 ranks in dedup and on 4 in the other mode per family.
"""

from __future__ import annotations

import contextlib
import copy
import math

import numpy as np
import pytest
import torch

from distributed import run_world
from occult_hf.hf.blocks import place_full_experts
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

TOLERANCE = 1e-5
SEED = 3


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def rank_batch(rank: int) -> torch.Tensor:
    return tiny_batch(seed=500 + rank)


def placement_for(family: str, num_experts: int, num_devices: int, kind: str):
    from occult_hf import Placement

    layers = MOE_LAYERS[family]
    if kind == "contiguous":
        return Placement.contiguous(num_experts, num_devices, layers)
    base = np.arange(num_experts) * num_devices // num_experts
    maps = {layer: np.random.default_rng(10 * layer + num_experts).permutation(base).tolist() for layer in layers}
    if kind == "shuffled":
        return Placement(num_experts, num_devices, maps, {"method": "shuffled"})
    # "replicated" (also "replicated_load_aware", the same placement with replica_choice="load_aware"):
    # the shuffled map, and experts 0..D-1 get an extra home on the next device (copies
    # that must serve pairs, receive summed gradients and stay identical)
    # the first layer carries its own pin slack for the load-aware rule (as a planner's choice), the others the default
    replicas = {layer: {e: [(maps[layer][e] + 1) % num_devices] for e in range(num_devices)} for layer in layers}
    return Placement(num_experts, num_devices, maps, {"method": "replicated"}, replicas=replicas, pin_slack={layers[0]: 0.0})


def reference(family: str, num_experts: int, num_devices: int) -> dict:
    """Per-rank outputs of the unreplaced model and the mean over ranks of the per-rank gradients."""
    model = tiny_model(family, seed=SEED, num_experts=num_experts).train()
    outputs = []
    for rank in range(num_devices):
        ids = rank_batch(rank)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        aux = getattr(out, "aux_loss", None)
        outputs.append(
            {"logits": out.logits.detach(), "loss": out.loss.detach(), "aux_loss": None if aux is None else aux.detach()}
        )
    grads = {
        name: (p.grad / num_devices if p.grad is not None else torch.zeros_like(p)) for name, p in model.named_parameters()
    }
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    return {"outputs": outputs, "grads": grads, "grad_norm": norm}


def _check_case(
    rank, world_size, family, num_experts, mode, placement_kind, chunks, ref, device="cpu", expert_backend="auto", dispatcher="all_to_all"
) -> set[str]:
    """Run one case on this rank (on `device`: the GPU test runs it under NCCL) with `dispatcher`; return the
    reference parameter names it compared."""
    from torch.nn.parallel import DistributedDataParallel

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules
    from occult_hf.placement import resolve_homes
    from occult_hf.replicas.routing import load_aware_homes

    where = f"[{family} E={num_experts} D={world_size} {mode} {placement_kind} chunks={chunks} rank {rank}]"
    placement = placement_for(family, num_experts, world_size, placement_kind)
    model = tiny_model(family, seed=SEED, num_experts=num_experts).to(device).train()
    full_parameters = sum(p.numel() for p in model.parameters())
    load_aware = placement_kind.endswith("load_aware")
    config = OccultConfig(
        placement=placement, dispatch=mode, dispatch_chunks=chunks, expert_backend=expert_backend,
        replica_choice="load_aware" if load_aware else "static", dispatcher=dispatcher,
    )
    apply_occult(model, config)
    assert all(m.dispatcher.name == dispatcher for m in occult_modules(model).values())
    ddp = DistributedDataParallel(model)
    ids = rank_batch(rank).to(device)
    with _counting_collectives() as forward_calls:
        out = ddp(input_ids=ids, labels=ids)
    with _counting_collectives() as backward_calls:
        out.loss.backward()
    # per MoE layer: one count exchange ("padded": none, but the ranks' most tokens and row formats gathered host to
    # host, one all-gather on the gloo host group), then one exchange per direction and chunk (rows and their metadata
    # packed together); backward one per direction and chunk; one grad-norm all-reduce per backward
    layers, group_chunks = len(occult_modules(model)), chunks or 1
    padded = dispatcher == "padded"
    # load-aware replica choice: one all-gather of the per-expert counts per layer
    gathers = layers * (int(load_aware) + int(padded))
    expected_calls = {
        "all_to_all_single": layers * (int(not padded) + 2 * group_chunks),
        **({"all_gather": gathers} if gathers else {}),
    }
    assert forward_calls == expected_calls, f"{where} {forward_calls}"
    # with replicas one more all-reduce per backward: the copies' gradients summed among holders, all layers at once
    reduces = 1 + int(placement.has_replicas)
    assert backward_calls == {"all_to_all_single": layers * 2 * group_chunks, "all_reduce": reduces}, f"{where} {backward_calls}"

    expected = ref["outputs"][rank]
    assert rel_err(out.logits, expected["logits"]) <= TOLERANCE, f"{where} logits"
    assert rel_err(out.loss, expected["loss"]) <= TOLERANCE, f"{where} loss"
    if expected["aux_loss"] is not None:
        assert rel_err(out.aux_loss, expected["aux_loss"]) <= TOLERANCE, f"{where} aux_loss"

    ref_grads, compared = ref["grads"], set()
    modules = occult_modules(model)
    expert_names = {f"{path}.experts.{n}" for path in modules for n in ("gate_up_proj", "down_proj")}
    carriers = {f"{path}.ep_grad_norm_carrier" for path in modules}
    for name, param in model.named_parameters():
        if name in expert_names or name in carriers:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        assert rel_err(grad, ref_grads[name]) <= TOLERANCE, f"{where} grad of {name}"
        compared.add(name)
    local_elements = 0
    for path, module in modules.items():
        experts = module.experts
        local_ids = experts.expert_ids.tolist()
        assert local_ids == placement.experts_on(module.layer_idx, rank), f"{where} local experts of {path}"
        full = []
        for param in (experts.gate_up_proj, experts.down_proj):
            local_elements += param.numel()
            filled = torch.full((num_experts, *param.shape[1:]), float("nan"))
            filled[local_ids] = (param.grad if param.grad is not None else torch.zeros_like(param)).cpu()
            full.append(filled)
        for key, grad in place_full_experts(module, *full).items():
            known = ~torch.isnan(grad)
            if known.any():
                name = f"{path}.{key}"
                assert rel_err(grad[known], ref_grads[name][known]) <= TOLERANCE, f"{where} grad of {name}"
                compared.add(name)
        assert all(p.numel() == 0 for p in _original_expert_parameters(module)), f"{where} expert storage kept"
        if mode == "dedup":
            topk_ids_Tk = module.last_topk_ids_Tk.cpu()
            table_EM = torch.from_numpy(placement.home_table(module.layer_idx))
            if load_aware:  # the rule again, from a fresh gather of every rank's counts, with the layer's pin slack
                slack = placement.pin_slack_of(module.layer_idx)
                assert module.dispatcher.layout.pin_slack == slack, f"{where} pin slack of {path}"
                dest_Tk = load_aware_homes(topk_ids_Tk, table_EM, world_size, _gather_all, rank, pin_slack=slack)
            else:
                dest_Tk = resolve_homes(topk_ids_Tk, table_EM, world_size)
            ct_rows = int((torch.zeros(topk_ids_Tk.shape[0], world_size, dtype=torch.bool).scatter_(1, dest_Tk, True)).sum())
            assert int(module.stats.rows_sent.sum()) == ct_rows, f"{where} rows sent != CT count"

    # every rank holds only its share of the experts
    dense = full_parameters - sum(num_experts * p[0].numel() for m in modules.values() for p in (m.experts.gate_up_proj, m.experts.down_proj))
    assert sum(p.numel() for p in model.parameters()) == dense + local_elements + len(modules), f"{where} memory"
    # the norm clip_grad_norm_ sees on this rank is the global one
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
    assert abs(norm - ref["grad_norm"]) <= TOLERANCE * ref["grad_norm"], f"{where} grad norm {norm} vs {ref['grad_norm']}"
    return compared


def _gather_all(local: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else local.device
    parts = [torch.empty_like(local, device=on) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.to(on))
    return torch.stack(parts).to(local.device)


@contextlib.contextmanager
def _counting_collectives():
    """Count the calls of the torch.distributed collectives the runtime uses (DDP's reducer is not among them)."""
    import torch.distributed as dist

    calls, originals = {}, {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce", "all_gather")}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _original_expert_parameters(module):
    """The routed-expert parameters of the original (hidden) block."""
    return list(module.adapter.experts_module(module.original_block).parameters())


def _exactness_world(rank, world_size, cases, references, on_gpu=False, expert_backend="auto"):
    covered = {}
    device = f"cuda:{rank}" if on_gpu else "cpu"
    for case in cases:
        family, num_experts, mode, placement_kind, chunks, *dispatcher = case  # the dispatcher: "all_to_all" unless named
        ref = references[(family, num_experts)]
        covered[case] = _check_case(
            rank, world_size, family, num_experts, mode, placement_kind, chunks, ref, device, expert_backend, *dispatcher
        )
    return covered


def _run(world_size: int, num_experts: int, cases, on_gpu: bool = False, expert_backend: str = "auto"):
    """Run `cases` in one world (NCCL on GPUs `cuda:0..` when `on_gpu`, else gloo) against the CPU reference."""
    families = sorted({case[0] for case in cases})
    references = {(family, num_experts): reference(family, num_experts, world_size) for family in families}
    backend = "nccl" if on_gpu else "gloo"
    covered = run_world(_exactness_world, world_size, cases, references, on_gpu, expert_backend, backend=backend)
    for case in cases:
        union = set().union(*(rank_result[case] for rank_result in covered))
        missing = set(references[(case[0], num_experts)]["grads"]) - union
        assert not missing, f"{case}: parameters never compared: {sorted(missing)[:5]}"


@pytest.mark.world_size(2)
def test_exact_on_2_ranks_all_families_modes_and_placements():
    chunks_of = {"contiguous": 1, "shuffled": 3}
    cases = [
        (family, 8, mode, kind, chunks_of[kind])
        for family in FAMILIES
        for mode in ("dedup", "per_expert")
        for kind in ("contiguous", "shuffled")
    ]
    cases += [(family, 8, "dedup", "replicated", 2) for family in FAMILIES]
    # replica_choice="load_aware": the pairs of a replicated expert split over its homes by the gathered counts
    cases += [(family, 8, "dedup", "replicated_load_aware", 2) for family in FAMILIES]
    # "padded" (what "auto" picks where its padding is cheap): static capacities, no count exchange
    cases += [(family, 8, "dedup", kind, 1, "padded") for family, kind in zip(FAMILIES, ("shuffled", "replicated") * len(FAMILIES))]
    cases += [("olmoe", 8, "dedup", "replicated_load_aware", 1, "padded")]
    _run(2, 8, cases)


STARVED_EXPERT = 7


def _starved_model():
    """Tiny DeepSeek-V3 whose routers never choose expert 7 (its selection bias -100), in training mode."""
    model = tiny_model("deepseek_v3", seed=SEED).train()
    with torch.no_grad():
        for layer in MOE_LAYERS["deepseek_v3"]:
            model.model.layers[layer].mlp.gate.e_score_correction_bias[STARVED_EXPERT] = -100.0
    return model


def _starved_rank_world(rank, world_size):
    """Rank 1 holds only the expert no token chooses: its expert computation gets no pair, in every layer."""
    from occult_hf import OccultConfig, Placement
    from occult_hf.hf.apply import apply_occult

    homes = [int(expert == STARVED_EXPERT) for expert in range(8)]
    placement = Placement(8, 2, {layer: homes for layer in MOE_LAYERS["deepseek_v3"]})
    found = {}
    for dispatcher in ("all_to_all", "padded"):
        model = apply_occult(_starved_model(), OccultConfig(placement=placement, dispatcher=dispatcher))
        ids = rank_batch(rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # before the fix rank 1 skipped the backward's exchanges: its peer waited for it
        # numpy: tensors through the result queue need the child alive
        grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None and "experts" not in name and "carrier" not in name}
        found[dispatcher] = (float(loss.detach()), grads)
    return found


@pytest.mark.world_size(2)
def test_a_rank_whose_experts_get_no_token_joins_the_backward():
    """A rank whose local experts receive no (row, expert) pair in a step (the portable PyTorch backend) still takes
    part in the backward's exchanges, under "all_to_all" and "padded": losses and the dense gradients equal one process."""
    model = _starved_model()
    losses, world_size = [], 2
    for rank in range(world_size):
        ids = rank_batch(rank)
        out = model(input_ids=ids, labels=ids)
        (out.loss / world_size).backward()
        losses.append(float(out.loss.detach()))
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    results = run_world(_starved_rank_world, world_size, env={"OCCULT_EXCHANGE_TIMEOUT_S": "20"}, timeout_s=200)
    for dispatcher in ("all_to_all", "padded"):
        for rank, found in enumerate(results):
            loss, grads = found[dispatcher]
            assert abs(loss - losses[rank]) <= 1e-5 * abs(losses[rank]), (dispatcher, rank)
        # the dense part's gradients, averaged over the ranks (DDP's job, done here), equal one process's
        for name in results[0][dispatcher][1]:
            mean = torch.from_numpy(results[0][dispatcher][1][name] + results[1][dispatcher][1][name]) / world_size
            assert rel_err(mean, expected[name]) <= 1e-5, (dispatcher, name)


def _experts_unfrozen_after_apply_world(rank, world_size):
    """The model frozen whole after `apply_occult`, then only its routed experts unfrozen (fine-tuning the experts):
    the norm `clip_grad_norm_` sees, and the flags `unapply_occult` leaves on the original experts."""
    from occult_hf import OccultConfig, unapply_occult
    from occult_hf.hf.apply import apply_occult, occult_modules

    model = apply_occult(tiny_model("qwen2_moe", seed=SEED).train(), OccultConfig(placement=placement_for("qwen2_moe", 8, 2, "shuffled")))
    model.requires_grad_(False)
    for module in occult_modules(model).values():
        module.experts.requires_grad_(True)
    try:
        copy.deepcopy(model)
        copied = "no error"
    except TypeError as error:  # was pickle's "cannot pickle 'ProcessGroup'"
        copied = str(error)
    ids = rank_batch(rank)
    model(input_ids=ids, labels=ids).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    local_sq = sum(float(p.grad.square().sum()) for m in occult_modules(model).values() for p in m.experts.parameters())
    first = next(iter(occult_modules(model).values()))
    first.experts.requires_grad_(False)  # frozen while converted: unapply must not bring back the flags of apply time
    unapply_occult(model)
    flags = {name: p.requires_grad for name, p in model.named_parameters() if ".experts." in name}
    return norm, local_sq, flags, copied


@pytest.mark.world_size(2)
def test_experts_unfrozen_after_apply_are_clipped_by_the_global_norm():
    """The grad-norm carrier followed the experts' `requires_grad` of build time: experts unfrozen afterwards were
    clipped by each rank's own norm (0.0615 and 0.0658 where the global one is 0.0901); and `unapply_occult` gave the
    original experts back the flags they had before `apply_occult`. A deep copy is refused by name."""
    results = run_world(_experts_unfrozen_after_apply_world, 2, timeout_s=200)
    (norm_0, local_0, flags_0, copied), (norm_1, local_1, flags_1, _) = results
    assert copied.startswith("copy.deepcopy of a model whose experts are spread over an expert-parallel group of 2 ranks"), copied
    assert abs(norm_0 - norm_1) <= 1e-6 * norm_0 and abs(norm_0**2 - (local_0 + local_1)) <= 1e-5 * norm_0**2
    for flags in (flags_0, flags_1):
        first_layer = min(MOE_LAYERS["qwen2_moe"])
        assert flags and all(trains == (f"layers.{first_layer}." not in name) for name, trains in flags.items()), flags


@pytest.mark.world_size(4)
def test_exact_on_4_ranks_with_uneven_expert_counts():
    """E=6 on 4 ranks: two ranks hold 2 experts, two hold 1."""
    cases = [(family, 6, "dedup", "shuffled", 2) for family in FAMILIES]
    cases += [(family, 6, "per_expert", "contiguous", None) for family in FAMILIES]
    cases += [(family, 6, mode, "replicated", 1) for family, mode in zip(FAMILIES, ("dedup", "per_expert") * len(FAMILIES))]
    cases += [(family, 6, mode, "replicated_load_aware", 1) for family, mode in zip(FAMILIES, ("per_expert", "dedup") * len(FAMILIES))]
    cases += [(family, 6, mode, "contiguous", 1, "padded") for family, mode in zip(FAMILIES[:2], ("dedup", "per_expert"))]
    _run(4, 6, cases)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_with_logical_devices_is_exact(family):
    """No process group: num_devices is logical, every expert is local, the model is unchanged."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    ref = reference(family, 8, 1)
    model = tiny_model(family, seed=SEED, num_experts=8).train()
    apply_occult(model, OccultConfig(placement=placement_for(family, 8, 3, "shuffled")))
    ids = rank_batch(0)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert rel_err(out.logits, ref["outputs"][0]["logits"]) <= TOLERANCE
    assert rel_err(out.loss, ref["outputs"][0]["loss"]) <= TOLERANCE
    for path, module in occult_modules(model).items():
        entries = place_full_experts(module, module.experts.gate_up_proj.grad, module.experts.down_proj.grad)
        for key, grad in entries.items():
            assert rel_err(grad, ref["grads"][f"{path}.{key}"]) <= TOLERANCE, key
        assert module.stats.rows_sent.shape == (3,) and int(module.stats.pairs_sent.sum()) == module.last_topk_ids_Tk.numel()


def test_parameter_order_is_the_same_in_every_process():
    """An occult model's parameters come in one order whatever the process's string hashing (`PYTHONHASHSEED`): DDP
    matches parameters across ranks by position, and an optimizer's state is saved and loaded by position. The block's
    children had been registered in a set's order, which differs between processes."""
    import os
    import subprocess
    import sys

    script = (
        "from occult_hf import OccultConfig, apply_occult; from tiny_models import tiny_model; "
        "print([name for name, _ in apply_occult(tiny_model('qwen2_moe'), OccultConfig(num_devices=2)).named_parameters()])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    processes = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**env, "PYTHONHASHSEED": str(seed)})
        for seed in range(6)
    ]  # fmt: skip
    orders = {process.communicate(timeout=300)[0] for process in processes}
    assert len(orders) == 1 and orders.pop().strip() == str([name for name, _ in tiny_model("qwen2_moe").named_parameters()])


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_order_is_the_stock_models(family):
    """The experts were registered after the block's other children: an optimizer state saved with the stock model
    failed to load into the converted one (and back) at `step()`, with a tensor-size error, for 6 of 8 families."""
    from occult_hf import OccultConfig, apply_occult

    stock = [name for name, _ in tiny_model(family).named_parameters()]
    assert [name for name, _ in apply_occult(tiny_model(family), OccultConfig(num_devices=2)).named_parameters()] == stock


@pytest.mark.parametrize("family, dispatch", [("olmoe", "dedup"), ("qwen2_moe", "per_expert"), ("deepseek_v3", "dedup")])
def test_a_float64_model_keeps_float64_precision(family, dispatch):
    """In fp64 the experts' outputs are weighted and summed in fp64, as stock's eager experts do (they were summed in
    fp32: 1e-7 off stock, where two stock expert implementations agree exactly)."""
    import copy

    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    built = tiny_model(family, seed=SEED, num_experts=8)
    stock = AutoModelForCausalLM.from_config(built.config, experts_implementation="eager")
    stock.load_state_dict(built.state_dict())
    stock = stock.double().train()
    model = apply_occult(copy.deepcopy(stock), OccultConfig(placement=placement_for(family, 8, 4, "shuffled"), dispatch=dispatch))
    ids = rank_batch(0)
    want, got = stock(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    want.loss.backward()
    got.loss.backward()
    assert got.logits.dtype == torch.float64 and rel_err(got.logits, want.logits) <= 1e-12
    stock_grads = dict(stock.named_parameters())
    for path, module in occult_modules(model).items():
        entries = place_full_experts(module, module.experts.gate_up_proj.grad, module.experts.down_proj.grad)
        for key, grad in entries.items():
            assert rel_err(grad, stock_grads[f"{path}.{key}"].grad) <= 1e-12, key


@pytest.mark.gpu
@pytest.mark.world_size(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a 2-rank NCCL world")
def test_two_ranks_under_nccl_match_one_process_in_fp32():
    """fp32 logits, loss, aux loss, every replicated and expert gradient and the global gradient norm at 2 NCCL ranks
    (one GPU each) against one process, within 1e-5, both dispatch modes, one chunk and several, two families.

    This checks the dispatcher, so the experts run on the torch backend: the Triton kernels autotune
    in fp32 for every tiny shape, minutes per rank (an H200 run on 2026-11-30 was still in ptxas
    after 145 s), and their own GPU tests compare them with fp32 (tests/test_triton_kernels.py)."""
    cases = [
        (family, 8, mode, "shuffled", chunks)
        for family in ("olmoe", "qwen2_moe")
        for mode in ("dedup", "per_expert")
        for chunks in (1, 3)
    ]
    # replicated experts with the load-aware replica choice: its all-gather of counts under NCCL
    cases += [("olmoe", 8, "dedup", "replicated_load_aware", 2), ("qwen2_moe", 8, "per_expert", "replicated_load_aware", 1)]
    # "padded" (what dispatcher="auto" takes where its padding is cheap; fp32 "torch" is the reference, which reads
    # the static layout's valid pair count on the host): its equal-split exchanges under NCCL
    cases += [("olmoe", 8, "dedup", "shuffled", 1, "padded"), ("qwen2_moe", 8, "dedup", "replicated", 1, "padded")]
    _run(2, 8, cases, on_gpu=True, expert_backend="torch")
