"""The rate of each of the six grouped GEMMs of a training step at OLMoE's expert shape, against a dense GEMM of the
same sizes.

`grouped_mm_fused` (and transformers' grouped_mm experts) run a layer's experts as six `torch._grouped_mm` calls:
the forward's gate_up and down, and the backward's input gradients (M grouped, as the forward) and weight gradients
(K grouped: each expert's segment of the pairs is the reduction). On 2026-12-02 all of them together ran at about
680 TFLOP/s. This says which kind is below the dense rate, i.e. where a faster GEMM would have to come from.

`python docs/device/grouped_mm_kinds.py` (TOKENS, default 16384; H, I, E, K default to OLMoE-1B-7B's 2048, 1024, 64,
8). Pairs are laid out by expert from a random top-K routing of TOKENS tokens, as a training step's are.
"""

import os

import torch
import triton.testing


def main() -> None:
    tokens = int(os.environ.get("TOKENS", 16384))
    hidden, inter, experts, top_k = (int(os.environ.get(k, d)) for k, d in (("H", 2048), ("I", 1024), ("E", 64), ("K", 8)))
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    ids = torch.rand(tokens, experts, device=dev).topk(top_k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    offs = counts.cumsum(0).to(torch.int32)
    n = int(offs[-1])
    print(f"{tokens} tokens, {n} pairs, {experts} experts (rows per expert {int(counts.min())}-{int(counts.max())}), H={hidden}, I={inter}")
    x = torch.randn(n, hidden, device=dev, dtype=dt)
    gu = torch.randn(n, 2 * inter, device=dev, dtype=dt)
    hw = torch.randn(n, inter, device=dev, dtype=dt)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt) * 0.02
    down = torch.randn(experts, hidden, inter, device=dev, dtype=dt) * 0.02
    gmm = torch._grouped_mm
    cases = [  # name, grouped call, dense call of the same sizes, flops
        ("fwd gate_up  x @ Wgu^T", lambda: gmm(x, gate_up.transpose(1, 2), offs=offs), (x, gate_up[0].t()), 2 * n * hidden * 2 * inter),
        ("fwd down     hw @ Wd^T", lambda: gmm(hw, down.transpose(1, 2), offs=offs), (hw, down[0].t()), 2 * n * inter * hidden),
        ("bwd g        dy @ Wd", lambda: gmm(x, down, offs=offs), (x, down[0]), 2 * n * hidden * inter),
        ("bwd dx       dgu @ Wgu", lambda: gmm(gu, gate_up, offs=offs), (gu, gate_up[0]), 2 * n * 2 * inter * hidden),
        ("bwd dWgu     dgu^T @ x", lambda: gmm(gu.t(), x, offs=offs), (gu.t(), x), 2 * n * 2 * inter * hidden),
        ("bwd dWd      dy^T @ hw", lambda: gmm(x.t(), hw, offs=offs), (x.t(), hw), 2 * n * hidden * inter),
    ]
    total_ms = 0.0
    print("| GEMM | grouped ms | grouped TFLOP/s | dense ms (one GEMM of the summed sizes) | dense TFLOP/s | grouped / dense rate |")
    print("|---|---|---|---|---|---|")
    for name, grouped, (a, b), flops in cases:
        ms_g = triton.testing.do_bench(grouped, warmup=50, rep=300, return_mode="median")
        ms_d = triton.testing.do_bench(lambda: torch.mm(a, b), warmup=50, rep=300, return_mode="median")
        total_ms += ms_g
        rate_g, rate_d = flops / ms_g / 1e9, flops / ms_d / 1e9
        print(f"| {name} | {ms_g:.3f} | {rate_g:.0f} | {ms_d:.3f} | {rate_d:.0f} | {rate_g / rate_d:.2f} |")
    print(f"six grouped GEMMs of one layer: {total_ms:.3f} ms; four layers {4 * total_ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
