"""Gradient checkpointing of occult models is exact: loss, aux loss and every gradient equal the same model without
checkpointing and the plain transformers model, reentrant and non-reentrant, in one process (logical devices, with
replicas, with pruning) and under expert parallelism on 2 gloo ranks (with replicas and `dispatch_chunks=2`,
where the replica gradient sum runs per nested backward or per chunk), and through the Trainer.

A recomputed forward must not be counted as traffic twice where the counts are means: `ProfileCollector` counts
each forward once, `OccultCallback`'s logged means and the pruners' removed weight are the same with and without
checkpointing; the dispatch counters count a reentrant recomputation again (docs/runtime.md says so).
Pruning changes the function, so pruned models are compared with themselves without checkpointing only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run_world
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.* is deprecated:FutureWarning"),
]

TOLERANCE = 1e-5
SEED = 3
NUM_EXPERTS = 8
#: the `use_reentrant` values checked (None, where a function takes one: no checkpointing)
CHECKPOINTING = [True, False]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def replicated_placement(family: str, num_devices: int):
    """Experts spread evenly; experts 0..D-1 get an extra home on the next device (copies that serve pairs)."""
    from occult_hf import Placement

    layers = MOE_LAYERS[family]
    primary = (np.arange(NUM_EXPERTS) * num_devices // NUM_EXPERTS).tolist()
    replicas = {layer: {e: [(primary[e] + 1) % num_devices] for e in range(num_devices)} for layer in layers}
    return Placement(NUM_EXPERTS, num_devices, {layer: list(primary) for layer in layers}, {}, replicas=replicas)


def occult_config(case: str, num_devices: int, family: str):
    from occult_hf import OccultConfig

    if case == "plain":
        return OccultConfig(num_devices=num_devices)
    if case == "pruned":
        return OccultConfig(num_devices=num_devices, prune="router", max_devices_per_token=1)
    if case == "replicas":
        return OccultConfig(placement=replicated_placement(family, num_devices))
    if case == "chunks":
        return OccultConfig(num_devices=num_devices, dispatcher="all_to_all", dispatch_chunks=2)
    if case == "replicas_chunks":
        placement = replicated_placement(family, num_devices)
        return OccultConfig(placement=placement, dispatcher="all_to_all", dispatch_chunks=2)
    raise ValueError(case)


def step(model, ids: torch.Tensor, reentrant: bool | None) -> dict:
    """One training forward and backward (checkpointed with `use_reentrant=reentrant` unless None): loss, aux loss
    and every parameter's gradient by name."""
    model.train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert model.is_gradient_checkpointing
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.detach(), "aux_loss": None if aux is None else aux.detach(), "grads": grads}


def full_named_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of a one-process occult model under the plain model's parameter names (every expert local)."""
    from occult_hf.hf.apply import occult_modules
    from occult_hf.hf.blocks import place_full_experts

    modules = occult_modules(model)
    own = ("experts.gate_up_proj", "experts.down_proj", "ep_grad_norm_carrier")
    skip = {f"{path}.{name}" for path in modules for name in own}
    grads = {name: p.grad for name, p in model.named_parameters() if name not in skip and p.grad is not None}
    for path, module in modules.items():
        experts = module.experts
        order = torch.argsort(experts.expert_ids.cpu())
        full = [p.grad[order] for p in (experts.gate_up_proj, experts.down_proj)]
        grads.update({f"{path}.{key}": grad for key, grad in place_full_experts(module, *full).items()})
    return grads


def assert_same_step(found: dict, expected: dict, where: str, names=None) -> None:
    assert rel_err(found["loss"], expected["loss"]) <= TOLERANCE, f"{where} loss"
    if expected["aux_loss"] is not None:
        assert rel_err(found["aux_loss"], expected["aux_loss"]) <= TOLERANCE, f"{where} aux_loss"
    expected_grads = expected["grads"]
    found_grads = found["grads"] if names is None else names
    assert set(found_grads) == set(expected_grads), f"{where}: {set(found_grads) ^ set(expected_grads)}"
    for name, grad in expected_grads.items():
        assert rel_err(found_grads[name], grad) <= TOLERANCE, f"{where} grad of {name}"


def counters(model) -> dict:
    from occult_hf.hf.apply import occult_modules

    return {path: (m.stats.rows_sent.clone(), int(m.stats.forwards)) for path, m in occult_modules(model).items()}


def occult_model(family: str, case: str, num_devices: int = 2):
    from occult_hf import apply_occult

    model = tiny_model(family, seed=SEED, num_experts=NUM_EXPERTS)
    return apply_occult(model, occult_config(case, num_devices, family))


def has_aux_loss(family: str) -> bool:
    return getattr(tiny_model(family).config, "output_router_logits", False)


def comparable(without: dict, found: dict, family: str, reentrant: bool | None) -> dict:
    """`without` (a step without checkpointing) as far as a checkpointed step can equal it: under reentrant
    checkpointing transformers loses the aux loss's gradient, so there only the loss and aux loss (found's own
    gradients stand in)."""
    return {**without, "grads": found["grads"]} if reentrant and has_aux_loss(family) else without


@pytest.mark.parametrize("reentrant", CHECKPOINTING, ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("case", ["plain", "replicas"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_checkpointing_equals_the_transformers_model(family, case, reentrant):
    """Logical devices: loss, aux loss and every gradient equal the unreplaced model's under the same checkpointing
    and the same occult model's without it; the routing counters count a reentrant recomputation again, a
    non-reentrant one not.

    Under reentrant checkpointing transformers itself loses the aux loss's gradient (its router logits are recorded
    in the checkpointed forward, which runs without grad: the routers' and norms' gradients then differ by up to 90%
    from no checkpointing in the stock model), so there the comparison without checkpointing is of loss and aux
    loss only; `test_reentrant_without_router_logits_equals_no_checkpointing` compares the gradients."""
    ids = tiny_batch(seed=500)
    where = f"[{family} {case} reentrant={reentrant}]"
    stock = tiny_model(family, seed=SEED, num_experts=NUM_EXPERTS)
    reference = step(stock, ids, reentrant)
    unchecked = occult_model(family, case)
    without = step(unchecked, ids, None)
    checked = occult_model(family, case)
    found = step(checked, ids, reentrant)
    assert_same_step(found, comparable(without, found, family, reentrant), f"{where} vs occult without checkpointing")
    assert_same_step(found, reference, f"{where} vs transformers", names=full_named_grads(checked))
    before, after = counters(unchecked), counters(checked)
    for path, (rows, forwards) in before.items():
        times = 2 if reentrant else 1
        assert torch.equal(after[path][0], times * rows) and after[path][1] == times * forwards, f"{where} {path}"


@pytest.mark.parametrize("case", ["plain", "replicas", "pruned"])
@pytest.mark.parametrize("family", [family for family in FAMILIES if has_aux_loss(family)])
def test_reentrant_without_router_logits_equals_no_checkpointing(family, case):
    """Without the aux loss (whose gradient transformers loses under reentrant checkpointing), reentrant
    checkpointing gives every gradient of the occult model without checkpointing."""
    from occult_hf import apply_occult

    ids = tiny_batch(seed=502)
    models = [
        apply_occult(tiny_model(family, seed=SEED, num_experts=NUM_EXPERTS, output_router_logits=False),
                     occult_config(case, 2, family))
        for _ in range(2)
    ]
    assert_same_step(step(models[1], ids, True), step(models[0], ids, None), f"[{family} {case}]")


@pytest.mark.parametrize("reentrant", CHECKPOINTING, ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "deepseek"])
def test_one_process_pruned_checkpointing_equals_no_checkpointing(family, reentrant):
    """Router pruning to one device per token: the same loss, aux loss, gradients and removed-weight ratio as the
    pruned model without checkpointing."""
    from occult_hf.pruning import pruners_of

    ids = tiny_batch(seed=501)
    unchecked, checked = occult_model(family, "pruned"), occult_model(family, "pruned")
    without = step(unchecked, ids, None)
    found = step(checked, ids, reentrant)
    assert_same_step(found, comparable(without, found, family, reentrant), f"[{family} pruned reentrant={reentrant}]")
    for layer, pruner in pruners_of(unchecked).items():
        sums, checked_sums = pruner.take_sums().double(), pruners_of(checked)[layer].take_sums().double()
        assert sums[0] > 0 and sums[1] > 0, sums  # pruning removed weight from some tokens
        np.testing.assert_allclose(float(checked_sums[1] / checked_sums[0]), float(sums[1] / sums[0]), rtol=1e-6)


# ----- expert parallelism on 2 gloo ranks -------------------------------------------------------------------------

EP_CASES = ["plain", "replicas", "chunks", "replicas_chunks", "pruned"]
EP_FAMILIES = ["olmoe", "deepseek_v3"]


def ep_batch(rank: int) -> torch.Tensor:
    return tiny_batch(seed=600 + rank)


def _ep_step(rank, family, case, reentrant) -> dict:
    """This rank's step of the occult model under DDP: loss, aux loss, every parameter's gradient by name, the local
    experts' gradients under the plain names (rows of other ranks' experts NaN), the norm `clip_grad_norm_` sees and
    the dispatch counters."""
    from torch.nn.parallel import DistributedDataParallel

    from occult_hf import apply_occult
    from occult_hf.hf.apply import occult_modules
    from occult_hf.hf.blocks import place_full_experts

    model = apply_occult(tiny_model(family, seed=SEED, num_experts=NUM_EXPERTS), occult_config(case, 2, family))
    for module in occult_modules(model).values():  # the case runs what it names
        assert (module.replica_grads is not None) == case.startswith("replicas"), case
        chunked = module.dispatcher.name == "all_to_all" and module.dispatcher.chunks == 2
        assert case.endswith("chunks") == chunked, case
    model.train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = ep_batch(rank)
    ddp = DistributedDataParallel(model)  # held until the backward has run: its reducer averages the gradients there
    out = ddp(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    experts = {}
    for path, module in occult_modules(model).items():
        local = module.local_experts
        full = []
        for param in (local.gate_up_proj, local.down_proj):
            filled = torch.full((NUM_EXPERTS, *param.shape[1:]), float("nan"))
            filled[local.expert_ids.tolist()] = param.grad
            full.append(filled)
        experts.update({f"{path}.{key}": grad for key, grad in place_full_experts(module, *full).items()})
    norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None)))
    aux = getattr(out, "aux_loss", None)
    return {
        "loss": out.loss.detach(), "aux_loss": None if aux is None else aux.detach(), "grads": grads,
        "experts": experts, "norm": norm, "counters": counters(model),
    }


def _as(convert, value):
    """`value` with every tensor (or array) in it converted: tensors leave a rank as numpy arrays."""
    if isinstance(value, dict):
        return {key: _as(convert, item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_as(convert, item) for item in value)
    return convert(value) if isinstance(value, (torch.Tensor, np.ndarray)) else value


def _ep_world(rank, world_size, cases):
    return {case: _as(lambda t: t.detach().numpy().copy(), _ep_step(rank, *case)) for case in cases}


def ep_reference(family: str, reentrant: bool | None, world_size: int = 2) -> dict:
    """The unreplaced model under the same checkpointing: each rank's loss and aux loss, and the mean over ranks of
    the per-rank gradients (DDP's) with its norm."""
    model = tiny_model(family, seed=SEED, num_experts=NUM_EXPERTS)
    steps = [step(model, ep_batch(rank), reentrant) for rank in range(world_size)]  # .grad accumulates over ranks
    grads = {name: grad / world_size for name, grad in steps[-1]["grads"].items()}
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))
    return {"ranks": steps, "grads": grads, "norm": norm}


def check_ep_against_transformers(found: dict, reference: dict, rank: int, where: str) -> set[str]:
    """Loss, aux loss, dense and local expert gradients and the global norm of one rank against the unreplaced model;
    returns the names compared."""
    expected = reference["ranks"][rank]
    assert rel_err(found["loss"], expected["loss"]) <= TOLERANCE, f"{where} loss"
    if expected["aux_loss"] is not None:
        assert rel_err(found["aux_loss"], expected["aux_loss"]) <= TOLERANCE, f"{where} aux_loss"
    compared = set()
    for name, grad in {**found["grads"], **found["experts"]}.items():
        if name in reference["grads"]:
            known = ~torch.isnan(grad)
            assert rel_err(grad[known], reference["grads"][name][known]) <= TOLERANCE, f"{where} grad of {name}"
            compared.add(name)
    assert abs(found["norm"] - reference["norm"]) <= TOLERANCE * reference["norm"], f"{where} norm"
    return compared


@pytest.mark.world_size(2)
@pytest.mark.parametrize("family", EP_FAMILIES)
def test_ep_checkpointing_is_exact(family):
    """2 gloo ranks under DDP, every case: checkpointing (reentrant and not) gives each rank the loss, aux loss,
    gradients (dense and its experts', replicated copies summed), global norm of the same model without it, and
    (unpruned) those of the unreplaced model under the same checkpointing."""
    cases = [(family, case, reentrant) for case in EP_CASES for reentrant in (None, True, False)]
    results = _as(torch.as_tensor, run_world(_ep_world, 2, cases, timeout_s=400))
    references = {reentrant: ep_reference(family, reentrant) for reentrant in (None, True, False)}
    for case in EP_CASES:
        for reentrant in (None, True, False):
            covered = set()
            for rank, found in enumerate(results):
                where = f"[{family} {case} reentrant={reentrant} rank {rank}]"
                checked, without = found[(family, case, reentrant)], found[(family, case, None)]
                expected = comparable(without, checked, family, reentrant)
                assert_same_step(checked, expected, f"{where} vs no checkpointing")
                if not (reentrant and has_aux_loss(family)):
                    assert abs(checked["norm"] - without["norm"]) <= TOLERANCE * without["norm"], f"{where} norm"
                times = 2 if reentrant else 1
                for path, (rows, forwards) in without["counters"].items():
                    assert torch.equal(checked["counters"][path][0], times * rows), f"{where} {path} rows"
                    assert checked["counters"][path][1] == times * forwards, f"{where} {path} forwards"
                if case != "pruned":
                    covered |= check_ep_against_transformers(checked, references[reentrant], rank, where)
            if case != "pruned":
                assert covered == set(references[reentrant]["grads"]), f"{family} {case}: not compared"


# ----- the Trainer ------------------------------------------------------------------------------------------------


class NextTokenData(torch.utils.data.Dataset):
    """Sequences counting up from a random start."""

    def __init__(self, size: int, seq: int = 16, vocab: int = 128) -> None:
        starts = torch.randint(3, vocab - seq, (size,), generator=torch.Generator().manual_seed(0))
        self.input_ids = starts[:, None] + torch.arange(seq)[None, :]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


def _trainer_run(output_dir, case: str, reentrant: bool | None):
    """3 steps of a Trainer (`gradient_checkpointing` from its arguments) with an `OccultCallback`: the log history,
    the recent window's token count per layer and the final weights."""
    from transformers import Trainer, TrainingArguments

    from occult_hf import OccultCallback

    model = occult_model("deepseek_v3", case)  # no aux loss: its gradient is lost under reentrant checkpointing
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, warmup_steps=0,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=reentrant is not None,
        gradient_checkpointing_kwargs=None if reentrant is None else {"use_reentrant": reentrant},
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=NextTokenData(12))
    callback = OccultCallback(check_every=3, sample_size=1024).attach(trainer)
    trainer.train()
    assert model.is_gradient_checkpointing == (reentrant is not None)
    windows = {layer: callback.recent_profile.layer(layer).token_count for layer in MOE_LAYERS["deepseek_v3"]}
    return trainer.state.log_history, windows, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", CHECKPOINTING, ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("case", ["pruned", "replicas"])
def test_trainer_with_gradient_checkpointing_equals_one_without(tmp_path, case, reentrant):
    """`TrainingArguments(gradient_checkpointing=True)`: the same losses, gradient norms and final weights as without,
    and `OccultCallback`'s logged numbers (CT, remote copies, load balance, removed weight) and drift window (a
    `ProfileCollector`: 3 steps x 4 rows x 16 tokens) are not counted twice by the recomputation."""
    history, windows, weights = _trainer_run(tmp_path / "plain", case, None)
    found_history, found_windows, found_weights = _trainer_run(tmp_path / "checkpointed", case, reentrant)
    assert windows == found_windows == {layer: 3 * 4 * 16 for layer in MOE_LAYERS["deepseek_v3"]}
    steps = [entry for entry in history if "loss" in entry]
    found_steps = [entry for entry in found_history if "loss" in entry]
    assert len(steps) == len(found_steps) == 3
    keys = {key for key in steps[0] if key.startswith("occult/")}
    assert {"occult/ct", "occult/load_balance", "occult/remote_copies"} <= keys
    assert ("occult/removed_weight" in keys) == (case == "pruned")
    for entry, found in zip(steps, found_steps):
        assert found.keys() == entry.keys()
        for key in ("loss", "grad_norm", *keys):
            assert found[key] == pytest.approx(entry[key], rel=TOLERANCE), key
    for name, weight in weights.items():
        assert rel_err(found_weights[name], weight) <= TOLERANCE, name
