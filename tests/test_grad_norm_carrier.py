"""The grad-norm carriers are in every optimizer that needs them (2 gloo ranks).

A carrier outside the optimizer is neither unscaled nor checked by a GradScaler: with fp16 the clip norm was the
scaled one and differed by rank (135.8 and 125.8 where the global norm was about 1.6), and an inf in one rank's
expert gradient made that rank alone skip the step. Carriers were frozen with the experts at build time and by plain
`peft.get_peft_model`, and made trainable again only at the first forward, after the Trainer had built its optimizer.
Now they are trainable from the start, the Trainer's `create_optimizer` makes them trainable first, and a carrier
found frozen at a training forward is re-enabled with a warning naming the optimizer it is missing from.
"""

from __future__ import annotations

import pytest

from distributed import run_world
from tiny_models import tiny_batch, tiny_model


def _carriers_in_the_optimizer(rank, world_size):
    import os

    import peft
    from transformers import Trainer, TrainingArguments

    from occult_hf import OccultConfig, apply_occult
    from occult_hf.hf.apply import occult_modules
    from occult_logs import occult_records

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")  # fmt: skip
    report = {}
    model = apply_occult(tiny_model("olmoe", seed=11, output_router_logits=False), OccultConfig(num_devices=world_size))
    carriers = [m.ep_grad_norm_carrier for m in occult_modules(model).values()]
    report["at build"] = all(c.requires_grad for c in carriers)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    peft_model = peft.get_peft_model(model, lora)  # freezes the carriers with every non-adapter parameter
    args = TrainingArguments(output_dir=f"/tmp/occult_carrier_test_{rank}", per_device_train_batch_size=2, max_steps=1,
                             report_to="none", use_cpu=True, disable_tqdm=True)  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=4, seq=8, seed=rank)]
    optimizer = Trainer(model=peft_model, args=args, train_dataset=data).create_optimizer()
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    report["in the Trainer's optimizer"] = all(id(c) in held for c in carriers)

    model.requires_grad_(False)  # a manual loop that unfreezes the experts after freezing everything
    for module in occult_modules(model).values():
        module.local_experts.requires_grad_(True)
    ids = tiny_batch(batch=2, seq=8, seed=rank)
    with occult_records() as records:
        model.train()(input_ids=ids, labels=ids)
        model(input_ids=ids, labels=ids)
    report["warnings"] = [r.getMessage() for r in records if "ep_grad_norm_carrier" in r.getMessage()]
    report["re-enabled"] = all(c.requires_grad for c in carriers)
    return report


@pytest.mark.world_size(2)
def test_the_grad_norm_carriers_reach_the_optimizer():
    for report in run_world(_carriers_in_the_optimizer, 2, timeout_s=200):
        assert report["at build"] and report["in the Trainer's optimizer"] and report["re-enabled"], report
        (warning,) = report["warnings"]  # once per model, not per layer or forward
        assert warning.startswith("occult_hf: the ep_grad_norm_carrier of layer 0 was frozen while its experts train")
        assert "an optimizer built before does not hold it, so a GradScaler neither unscales nor checks it" in warning
