"""LoRA (peft `target_parameters` on the fused experts, `target_modules` on attention) with OccultMoE.

- One process: an occult model with LoRA computes what the stock model with the same LoRA computes
  (logits, loss, every adapter gradient); adapters train, save with plain peft, and reload into a
  fresh occult model and into the stock transformers model with identical logits.
- 2-rank gloo EP (pruned, N_d=1, DDP over the PEFT model): one saved adapter loads on both layouts
  (expert adapters cut to each rank's experts); EP logits and adapter gradients equal the
  one-process run; after an optimizer step the gathered save equals the one-process save and
  reloads in one process to the same logits.
- 2-rank gloo EP with plain `peft.get_peft_model` and DDP: each rank keeps its own experts and the
  gradients equal those of the occult helper's PEFT model.
- The adapter layout helpers: cutting to local experts and placing back is the identity.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from distributed import run_world
from tiny_models import tiny_batch, tiny_model

import occult_hf  # noqa: F401
from occult_hf.config import OccultConfig
from occult_hf.hf.apply import apply_occult
from occult_hf.hf.peft_support import (
    _place_experts,
    _select_experts,
    get_peft_model,
    load_peft_model,
    save_peft_model,
)

peft = pytest.importorskip("peft")

SIZES = dict(num_experts=16, top_k=4)
RTOL = 1e-5


def lora_config():
    return peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )


def randomize_adapters(model, seed: int) -> None:
    """Non-zero B factors (peft starts them at zero), so every factor gets gradients and matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name and p.grad is not None}


def relative_error(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def test_layout_helpers_round_trip():
    num_experts, rank = 6, 2
    a = torch.randn(num_experts * rank, 5)
    b = torch.randn(7, rank * num_experts)
    ids = [torch.tensor([0, 3, 4]), torch.tensor([1, 2, 5])]
    for factor, tensor in (("lora_A", a), ("lora_B", b)):
        parts = [_select_experts(factor, tensor, num_experts, i) for i in ids]
        assert torch.equal(_place_experts(factor, parts, ids, num_experts), tensor)
    # lora_A rows are expert-major, lora_B columns expert-minor
    assert torch.equal(_select_experts("lora_A", a, num_experts, torch.tensor([3])), a[6:8])
    assert torch.equal(_select_experts("lora_B", b, num_experts, torch.tensor([3])), b[:, [3, 9]])


def test_lora_one_process_matches_stock_trains_saves_and_reloads(tmp_path):
    input_ids = tiny_batch(batch=2, seq=16, seed=4)
    models = {}
    for kind in ("stock", "occult"):
        base = tiny_model("olmoe", **SIZES).train()
        if kind == "occult":
            base = apply_occult(base, OccultConfig(num_devices=4))
        model = get_peft_model(base, lora_config()) if kind == "occult" else peft.get_peft_model(base, lora_config())
        randomize_adapters(model, seed=1)
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        models[kind] = (model, out.logits.detach(), adapter_grads(model))
    stock, occult = models["stock"], models["occult"]
    assert relative_error(occult[1], stock[1]) <= RTOL
    assert set(occult[2]) == set(stock[2]) and any(".experts." in name for name in stock[2])
    for name, grad in stock[2].items():
        assert relative_error(occult[2][name], grad) <= RTOL, name

    model = occult[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters() if name in before)
    model.eval()
    with torch.no_grad():
        trained_logits = model(input_ids=input_ids).logits
    model.save_pretrained(tmp_path / "adapter")  # plain peft save: one process holds every expert

    reloaded = load_peft_model(apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=4)), tmp_path / "adapter")
    stock_reloaded = peft.PeftModel.from_pretrained(tiny_model("olmoe", **SIZES), tmp_path / "adapter")
    with torch.no_grad():
        assert relative_error(reloaded(input_ids=input_ids).logits, trained_logits) <= RTOL
        assert relative_error(stock_reloaded(input_ids=input_ids).logits, trained_logits) <= RTOL


@pytest.mark.parametrize(
    "family, targets, saved",
    [("olmoe", ["q_proj"], ["gate"]), ("qwen2_moe", ["q_proj", "shared_expert_gate"], ["shared_expert"])],
    ids=["router-copy", "shared-expert-gate-lora-and-copies"],
)
def test_peft_on_modules_of_the_block_itself_reaches_the_forward(family, targets, saved):
    """peft's `modules_to_save` copies of the router and shared expert, and LoRA on a linear of the block itself
    (`shared_expert_gate`), replace children of the `OccultMoE`: they run in its forward (they had been bypassed: no
    gradient, the loss of the frozen originals), with the loss and gradients of stock peft."""
    input_ids = tiny_batch(batch=2, seq=16, seed=4)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, modules_to_save=saved)
    found = {}
    for kind in ("stock", "occult"):
        base = tiny_model(family, seed=3).train()
        model = peft.get_peft_model(apply_occult(base, OccultConfig(num_devices=2)) if kind == "occult" else base, config)
        with torch.no_grad():  # the adapters drawn, the trainable copies moved from the frozen originals, alike by name
            for name, param in model.named_parameters():
                if param.requires_grad:
                    noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1
                    param.copy_(noise if "lora_" in name else param + noise)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        found[kind] = (loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    (stock_loss, stock_grads), (occult_loss, occult_grads) = found["stock"], found["occult"]
    assert relative_error(occult_loss, stock_loss) <= RTOL
    assert any("modules_to_save" in name for name in stock_grads) and set(occult_grads) == set(stock_grads)
    for name, grad in stock_grads.items():
        assert occult_grads[name] is not None and relative_error(occult_grads[name], grad) <= RTOL, name


# ----- expert parallelism -------------------------------------------------------------------------


def _plain_peft_under_ddp(rank, world_size, config, batch, check, failures):
    """Plain `peft.get_peft_model` (no occult helper) then DDP: rank-local experts must stay this rank's
    (DDP used to broadcast rank 0's over them) and the gradients, the grad-norm carriers' included,
    equal those of the occult helper's PEFT model."""
    from torch.nn.parallel import DistributedDataParallel

    models = {}
    for label, wrap in (("helper", get_peft_model), ("plain", peft.get_peft_model)):
        model = wrap(apply_occult(tiny_model("olmoe", **SIZES).train(), config), lora_config())
        randomize_adapters(model, seed=3)
        models[label] = model
    local = {name: p.detach().clone() for name, p in models["plain"].named_parameters() if ".experts." in name}
    for label, model in models.items():
        ddp = DistributedDataParallel(model)
        ddp(input_ids=batch, labels=batch).loss.backward()
    for name, param in models["plain"].named_parameters():
        if name in local and not torch.equal(param.detach(), local[name]):
            failures.append(f"plain peft: DDP overwrote this rank's {name}")
    helper = dict(models["helper"].named_parameters())
    carriers = [name for name in helper if name.endswith("ep_grad_norm_carrier")]
    for name, param in models["plain"].named_parameters():
        if helper[name].grad is None:
            if param.grad is not None:
                failures.append(f"plain peft: unexpected gradient on {name}")
            continue
        if param.grad is None:
            failures.append(f"plain peft: no gradient on {name}")
        else:
            check(f"plain peft grad {name}", param.grad, helper[name].grad)
    if not carriers or any(helper[name].grad is None for name in carriers):
        failures.append("plain peft: grad-norm carriers got no gradient")


def _ep_lora(rank, world_size, adapter_dir, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from occult_hf.hf.peft_support import _select_experts

    config = OccultConfig(num_devices=world_size, prune="router", max_devices_per_token=1)
    one_process = [dist.new_group([r]) for r in range(world_size)]
    batches = [tiny_batch(batch=2, seq=8, seed=20 + r) for r in range(world_size)]
    failures = []

    def check(what, actual, expected):
        error = relative_error(actual, expected)
        if error > RTOL:
            failures.append(f"{what}: {error:.3g}")

    # one process, D logical devices, all ranks' batches (the mean of the ranks' losses)
    reference = load_peft_model(
        apply_occult(tiny_model("olmoe", **SIZES).train(), config, group=one_process[rank]), adapter_dir, is_trainable=True
    )
    reference_logits = []
    for batch in batches:
        out = reference(input_ids=batch, labels=batch)
        (out.loss / world_size).backward()
        reference_logits.append(out.logits.detach())
    # expert parallelism: this rank's batch, DDP over the PEFT model
    model = load_peft_model(apply_occult(tiny_model("olmoe", **SIZES).train(), config), adapter_dir, is_trainable=True)
    ignored = set(model._ddp_params_and_buffers_to_ignore)
    ddp = DistributedDataParallel(model)
    out = ddp(input_ids=batches[rank], labels=batches[rank])
    out.loss.backward()
    check("logits", out.logits.detach(), reference_logits[rank])
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if "lora_" not in name:
            continue
        expected = reference_params[name].grad
        if name in ignored:  # a rank-local expert adapter: this rank's experts of the full gradient
            block = model.get_submodule(name.split(".experts.")[0])
            factor = "lora_A" if ".lora_A." in name else "lora_B"
            expected = _select_experts(factor, expected, 16, block.local_experts.expert_ids)
        check(f"grad {name}", param.grad, expected)
    if not any(".experts." in name and "lora_" in name for name in ignored):
        failures.append("expert adapters are not in the DDP ignore list")

    _plain_peft_under_ddp(rank, world_size, config, batches[rank], check, failures)

    # one optimizer step on both, then the gathered EP save against the one-process save
    for module in (reference, model):
        with torch.no_grad():
            for param in module.parameters():
                if param.requires_grad and param.grad is not None:
                    param -= 0.5 * param.grad
    save_peft_model(model, f"{out_dir}/ep")
    if rank == 0:
        reference.save_pretrained(f"{out_dir}/one_process")
    dist.barrier()
    if rank == 0:
        from safetensors.torch import load_file

        saved_ep = load_file(f"{out_dir}/ep/adapter_model.safetensors")
        saved_one = load_file(f"{out_dir}/one_process/adapter_model.safetensors")
        if sorted(saved_ep) != sorted(saved_one):
            failures.append("saved adapter keys differ")
        for key, value in saved_one.items():
            check(f"saved {key}", saved_ep[key], value)
        reloaded = load_peft_model(apply_occult(tiny_model("olmoe", **SIZES), config, group=one_process[0]), f"{out_dir}/ep")
        reference.eval()
        with torch.no_grad():
            check("reloaded logits", reloaded(input_ids=batches[1]).logits, reference(input_ids=batches[1]).logits)
    return failures


@pytest.mark.world_size(2)
def test_lora_under_expert_parallelism(tmp_path):
    base = apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=2))
    model = get_peft_model(base, lora_config())
    randomize_adapters(model, seed=2)
    model.save_pretrained(tmp_path / "adapter")
    for failures in run_world(_ep_lora, 2, str(tmp_path / "adapter"), str(tmp_path)):
        assert failures == []
