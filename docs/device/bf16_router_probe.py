"""Which router gradients of a bf16 occult model leave fp32 on the GPU (test_gpu_runtime's bf16 check, per
parameter): each family with shared-expert gates, occult (torch and triton backends; the block's child mirroring
on and off) against transformers' fp32 and bf16 models."""

import sys

import torch
from torch import nn
from tiny_models import tiny_model

import occult_hf
from occult_hf.moe import OccultMoE


def run(model, ids):
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
mirror = OccultMoE.__setattr__
for family in sys.argv[1:] or ["qwen2_moe", "qwen3_next", "olmoe"]:
    ref_out, ref = run(tiny_model(family).cuda(), ids)
    hf_out, hf = run(tiny_model(family).cuda().to(torch.bfloat16), ids)
    variants = {}
    for backend in ("torch", "triton"):
        for mirrored in (True, False):
            OccultMoE.__setattr__ = mirror if mirrored else nn.Module.__setattr__
            model = occult_hf.apply_occult(tiny_model(family).cuda().to(torch.bfloat16), occult_hf.OccultConfig(num_devices=4, expert_backend=backend))
            variants[f"{backend}{'' if mirrored else '-nomirror'}"] = run(model, ids)
    OccultMoE.__setattr__ = mirror
    fp32 = occult_hf.apply_occult(tiny_model(family).cuda(), occult_hf.OccultConfig(num_devices=4))
    variants["fp32"] = run(fp32, ids)
    print(f"probe {family} loss ref {ref_out.loss.item():.6f} hf {hf_out.loss.item():.6f} " + " ".join(f"{k} {v[0].loss.item():.6f}" for k, v in variants.items()))
    print(f"probe {family} logits hf {rel(hf_out.logits, ref_out.logits):.2e} " + " ".join(f"{k} {rel(v[0].logits, ref_out.logits):.2e}" for k, v in variants.items()))
    for name in ref:
        if name.endswith("gate.weight") or "shared_expert" in name:
            cells = " ".join(f"{k} {rel(v[1][name], ref[name]):.2e}" if name in v[1] else f"{k} missing" for k, v in variants.items())
            print(f"probe {family} {name} hf {rel(hf[name], ref[name]):.2e} {cells}")
