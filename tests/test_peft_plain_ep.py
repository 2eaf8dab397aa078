"""Plain peft under expert parallelism, as peft's own docs use it (issue 32): `PeftModel.save_pretrained`
on 2 gloo ranks used to have both ranks write their own half of the expert adapters into the same files,
silently, and the adapter then failed to load (`size mismatch ... [16, 64] vs [32, 64]`).

One world of 2 ranks, a plain `peft.get_peft_model` over an EP model with different adapters on each
rank's experts, then:
- `save_pretrained` on every rank writes one adapter of all experts; `PeftModel.from_pretrained` loads
  it back on the EP layout with the same logits;
- HF `Trainer` with the PEFT model trains a step and `trainer.save_model` (whose inner
  `save_pretrained` runs on rank 0 alone) writes the trained adapter;
- `save_pretrained(state_dict=<this rank's>)` is refused on every rank before a file is written, and
  a `save_pretrained` that only rank 0 calls fails within the join timeout, naming rank 1, writing nothing.
In this process, both adapters load into the stock transformers model with plain peft and give the EP
model's logits.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import run_world
from tiny_models import tiny_batch, tiny_model

peft = pytest.importorskip("peft")

SIZES = dict(num_experts=16, top_k=4)
RTOL = 1e-5
JOIN_TIMEOUT_S = 5


def lora_config():
    return peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip


def relative_error(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _ep_peft_model(rank: int):
    """Non-zero adapters (peft starts B at zero): attention's the same on every rank, as DDP keeps them,
    and each rank's experts their own values, so that a save holding one rank's experts shows."""
    from occult_hf import OccultConfig, apply_occult

    model = peft.get_peft_model(apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=2)), lora_config())
    shared, own = torch.Generator().manual_seed(10), torch.Generator().manual_seed(20 + rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=own if ".experts." in name else shared) * 0.1)
    return model


def _world(rank, world_size, root):
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from occult_hf import OccultConfig, apply_occult

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29518")  # fmt: skip  (what torchrun sets: the Trainer reads it)
    report = {}
    batch = tiny_batch(batch=2, seq=8, seed=30)
    model = _ep_peft_model(rank)
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    model.save_pretrained(f"{root}/plain")  # peft's own docs: every rank calls it
    dist.barrier()
    reloaded = peft.PeftModel.from_pretrained(apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=2)), f"{root}/plain")
    with torch.no_grad():
        report["reloaded_error"] = relative_error(reloaded(input_ids=batch).logits, logits)
    report["logits"] = logits.numpy()  # by value: a tensor would travel as a file descriptor of this process

    args = TrainingArguments(output_dir=f"{root}/trainer", per_device_train_batch_size=2, max_steps=1, learning_rate=0.05,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=4, seq=8, seed=31)]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    model.eval()
    with torch.no_grad():
        report["trained_logits"] = model(input_ids=batch).logits.numpy()
    trainer.save_model(f"{root}/trainer")

    try:
        model.save_pretrained(f"{root}/local", state_dict=model.state_dict())  # this rank's experts only
    except ValueError as error:
        report["local_state_dict"] = str(error)
    report["local_written"] = os.path.exists(f"{root}/local")
    with torch.no_grad():  # the adapters change after the Trainer's snapshot (as a next step would change them)
        next(param for name, param in model.named_parameters() if ".experts." in name and "lora_" in name).mul_(1.0)
    dist.barrier()
    if rank == 0:  # the usual HF habit, `if rank == 0: model.save_pretrained(...)`
        start = time.perf_counter()
        try:
            model.save_pretrained(f"{root}/rank0_only")
        except RuntimeError as error:
            report["rank0_only"] = (type(error).__name__, str(error), time.perf_counter() - start)
        report["rank0_only_written"] = os.path.exists(f"{root}/rank0_only")
    dist.barrier()
    return report


@pytest.mark.world_size(2)
def test_plain_peft_save_and_load_under_expert_parallelism(tmp_path):
    root = str(tmp_path)
    reports = run_world(_world, 2, root, env={"OCCULT_JOIN_TIMEOUT_S": str(JOIN_TIMEOUT_S)}, timeout_s=300)
    for rank, report in enumerate(reports):
        assert report["reloaded_error"] <= RTOL, (rank, report["reloaded_error"])
        assert "this rank's 8 experts, not all 16" in report.get("local_state_dict", ""), rank
        assert not report["local_written"], rank
    logits = {key: torch.from_numpy(reports[0][key]) for key in ("logits", "trained_logits")}
    assert relative_error(torch.from_numpy(reports[1]["logits"]), logits["logits"]) <= RTOL  # one model across the ranks
    name, message, seconds = reports[0]["rank0_only"]
    assert name == "EPPeerError" and seconds < JOIN_TIMEOUT_S + 10, message
    assert "PeftModel.save_pretrained on rank 0: EP ranks [1] did not reach it" in message
    assert not reports[0]["rank0_only_written"]

    batch = tiny_batch(batch=2, seq=8, seed=30)
    for adapter, key in (("plain", "logits"), ("trainer", "trained_logits")):
        stock = peft.PeftModel.from_pretrained(tiny_model("olmoe", **SIZES), tmp_path / adapter).eval()
        with torch.no_grad():
            assert relative_error(stock(input_ids=batch).logits, logits[key]) <= RTOL, adapter
    assert relative_error(logits["trained_logits"], logits["logits"]) > 1e-3  # the Trainer step changed it
