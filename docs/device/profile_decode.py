"""Where the host's time goes in one dynamic-cache `generate()` step at batch 1, stock against occult (issue 31).

One H200, the real OLMoE-1B-7B configuration (16 layers), random weights, bf16. Per model: CUDA-event time per
step, the host functions that take the most of it (cProfile over `generate(max_new_tokens=32)`), and how many
host synchronisations one step makes (`torch.cuda.set_sync_debug_mode("warn")` counts each as a warning).
Run by docs/device/compile.sh's `profile` step; prints to stdout.
"""

import collections
import copy
import cProfile
import io
import pstats
import time
import traceback
import warnings

import torch

from occult_hf import apply_occult
from occult_hf.benchmarks.model import build_model, model_config


def generate(model, prompt, new_tokens):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), pad_token_id=0, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, output_router_logits=False)


def main():
    device = torch.device("cuda")
    config = model_config("olmoe-1b-7b", 16)
    stock = build_model(config, device, torch.bfloat16)
    models = {"stock": stock, "occult": apply_occult(copy.deepcopy(stock), {"num_devices": 1})}
    prompt = torch.randint(0, config.vocab_size, (1, 128), device=device)
    for name, model in models.items():
        generate(model, prompt, 8)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(model, prompt, 33)
        torch.cuda.synchronize()
        long = time.perf_counter() - start
        start = time.perf_counter()
        generate(model, prompt, 1)
        torch.cuda.synchronize()
        print(f"== {name}: {(long - (time.perf_counter() - start)) * 1e3 / 32:.2f} ms per step", flush=True)
        sites = []

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-3:]
                sites.append(" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames)))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            generate(model, prompt, 2)
            torch.cuda.set_sync_debug_mode(0)
        print(f"{name}: {len(sites)} host synchronisations in a 2-token generate (prefill + 1 step)", flush=True)
        for site, count in collections.Counter(sites).most_common(12):
            print(f"  {count} x {site}", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        generate(model, prompt, 33)
        torch.cuda.synchronize()
        profile.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(28)
            print(f"-- {name} by {order}\n" + text.getvalue().split("ncalls", 1)[1], flush=True)


if __name__ == "__main__":
    main()
