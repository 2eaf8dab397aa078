"""The two top-k decode kernels (`kernels/triton_topk_mlp.py`) at the real OLMoE-1B-7B and Qwen1.5-MoE-A2.7B expert
shapes, bf16, over a grid of launch configurations: GPU µs per launch (`triton.testing.do_bench_cudagraph`, so
without the host's launch cost) and the weight bytes the pairs read per µs, at each of `TOKENS`.

Prints one line per (model, kernel, T, configuration), then each (model, kernel, T)'s best configuration, its five
fastest and the shipped one's time. Run on the GPU: `python3 docs/device/topk_sweep.py` (with occult_hf importable).
"""

import itertools

import torch
from triton.testing import do_bench_cudagraph

from occult_hf.kernels.triton_topk_mlp import SHIPPED_TILES, TopKTiles, launch_topk_down, launch_topk_gate_up

SHAPES = {"olmoe-1b-7b": (64, 2048, 1024, 8), "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4)}  # L, H, I, k
TOKENS = (1, 8, 16, 32, 64)
CONFIGS = [TopKTiles(*tiles) for tiles in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 3))]


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


def main():
    for model, (experts, hidden, width, top_k) in SHAPES.items():
        for tokens in TOKENS:
            x, ids, weights, gate_up, down, hw, out = inputs(experts, hidden, width, top_k, tokens)
            pair_bytes = {"gate_up": 2 * width * hidden * 2, "down": hidden * width * 2}
            results = {"gate_up": {}, "down": {}}
            for config in CONFIGS:
                for name, run in (
                    ("gate_up", lambda: launch_topk_gate_up(x, ids, weights, gate_up, hw, top_k, "silu", config)),
                    ("down", lambda: launch_topk_down(hw, ids, down, out, top_k, config)),
                ):
                    try:
                        us = do_bench_cudagraph(run, rep=20) * 1e3
                    except Exception as error:  # a configuration that does not compile (registers, shared memory)
                        print(f"{model} {name} T={tokens} {tuple(config)}: {type(error).__name__}", flush=True)
                        continue
                    results[name][config] = us
                    print(f"{model} {name} T={tokens} {tuple(config)}: {us:.1f} us", flush=True)
            for name, times in results.items():
                best = min(times, key=times.get)
                gbps = ids.numel() * pair_bytes[name] / times[best] / 1e3
                print(
                    f"best {model} {name} T={tokens}: {tuple(best)} {times[best]:.1f} us ({gbps:.0f} GB/s of pair weights); "
                    f"shipped {tuple(SHIPPED_TILES)} {times.get(SHIPPED_TILES, float('nan')):.1f} us",
                    flush=True,
                )
                ranked = sorted(times, key=times.get)[:5]
                print("   top 5: " + ", ".join(f"{tuple(c)} {times[c]:.1f}" for c in ranked), flush=True)


if __name__ == "__main__":
    main()
