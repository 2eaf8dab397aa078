"""The two top-k decode kernels (`kernels/triton_topk_mlp.py`) at the real OLMoE-1B-7B and Qwen1.5-MoE-A2.7B expert
shapes, bf16, over a grid of launch configurations: GPU µs per launch (`triton.testing.do_bench_cudagraph`, so
without the host's launch cost) and the weight bytes the pairs read per µs, at each of `TOKENS`.

Prints one line per (model, kernel, T, configuration), then each (model, kernel, T)'s best configuration, its five
fastest and the shipped one's time. Run on the GPU: `python3 docs/device/topk_sweep.py` (with occult_hf importable).
"""

import itertools

import torch
from triton.testing import do_bench_cudagraph

from occult_hf.kernels import triton_expert_mlp_kernels as kernels
from occult_hf.kernels.triton_support import cdiv
from occult_hf.kernels.triton_topk_mlp import BLOCK_K as SHIPPED_K, BLOCK_N as SHIPPED_N, NUM_STAGES as SHIPPED_STAGES

SHAPES = {"olmoe-1b-7b": (64, 2048, 1024, 8), "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4)}  # L, H, I, k
TOKENS = (1, 8, 16, 32, 64)
CONFIGS = list(itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 3)))  # N, K, warps, stages


def inputs(experts, hidden, width, top_k, tokens):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices.reshape(-1).contiguous()
    weights = torch.rand(tokens * top_k, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    down = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16) / width**0.5
    hw = torch.randn(tokens * top_k, width, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    return x, ids, weights, gate_up, down, hw, out


def gate_up_launch(x, ids, weights, gate_up, hw, config, top_k):
    block_n, block_k, warps, stages = config
    width, hidden = hw.shape[1], x.shape[1]
    grid = (ids.numel(), cdiv(width, block_n))
    return lambda: kernels.topk_gate_up_kernel[grid](
        x, ids, weights, gate_up, hw, hidden, width, x.stride(0), *gate_up.stride(),
        TOP_K=top_k, ACTIVATION=kernels.ACTIVATIONS["silu"], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def down_launch(hw, ids, down, out, config, top_k):
    block_n, block_k, warps, stages = config
    hidden, width = down.shape[1], down.shape[2]
    grid = (out.shape[0], cdiv(hidden, block_n))
    return lambda: kernels.topk_down_kernel[grid](
        hw, ids, down, out, hidden, width, *down.stride(), out.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def main():
    shipped = (SHIPPED_N, SHIPPED_K, 4, SHIPPED_STAGES)
    for model, (experts, hidden, width, top_k) in SHAPES.items():
        for tokens in TOKENS:
            x, ids, weights, gate_up, down, hw, out = inputs(experts, hidden, width, top_k, tokens)
            pair_bytes = {"gate_up": 2 * width * hidden * 2, "down": hidden * width * 2}
            results = {"gate_up": {}, "down": {}}
            for config in CONFIGS:
                for name, make in (
                    ("gate_up", lambda: gate_up_launch(x, ids, weights, gate_up, hw, config, top_k)),
                    ("down", lambda: down_launch(hw, ids, down, out, config, top_k)),
                ):
                    try:
                        us = do_bench_cudagraph(make(), rep=20) * 1e3
                    except Exception as error:  # a configuration that does not compile (registers, shared memory)
                        print(f"{model} {name} T={tokens} {config}: {type(error).__name__}", flush=True)
                        continue
                    results[name][config] = us
                    print(f"{model} {name} T={tokens} {config}: {us:.1f} us", flush=True)
            for name, times in results.items():
                best = min(times, key=times.get)
                gbps = ids.numel() * pair_bytes[name] / times[best] / 1e3
                print(
                    f"best {model} {name} T={tokens}: {best} {times[best]:.1f} us ({gbps:.0f} GB/s of pair weights); "
                    f"shipped {shipped} {times.get(shipped, float('nan')):.1f} us",
                    flush=True,
                )
                ranked = sorted(times, key=times.get)[:5]
                print("   top 5: " + ", ".join(f"{c} {times[c]:.1f}" for c in ranked), flush=True)


if __name__ == "__main__":
    main()
