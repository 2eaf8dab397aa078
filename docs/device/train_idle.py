"""Where the GPU idles in a compiled training step, and what the host was doing then.

`occult bench model --compile --profile` measured compiled occult's OLMoE forward+backward (4 layers, 16,384 tokens)
at 65.6 ms with 62.6 ms of GPU busy time, and compiled stock at 71.0 with 70.6: occult's step idles about 3 ms, stock's
0.4. This script profiles one forward+backward of each compiled model (`bench model`'s `decoder_steps`) and prints:

- the wall, the GPU busy time, and the idle time (gaps between the kernels, memsets and copies);
- the largest gaps, with the kernels on either side of each and the host operation that launched the one after;
- the host's innermost ranges (operators, Python functions with `with_stack`) by the idle time they overlap: what
  the GPU waited for.

`python docs/device/train_idle.py [MODELS...]` (default "stock occult"; SHAPE, default olmoe-1b-7b; STACK=0 leaves
Python frames out, which changes the host timing less; the first profile of each model is always without them). The
chrome traces are written to TRACE_DIR when it is set.
"""

import copy
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from occult_hf import apply_occult
from occult_hf.benchmarks.ep import idle_gaps
from occult_hf.benchmarks.model import build_model, decoder_steps, model_config

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
TOP = 15


def traced_step(step, stack: bool, label: str) -> tuple[list[dict], str]:
    """The chrome-trace events of one `step(True)` (forward+backward) after two warm ones, and the trace's path."""
    step(True)
    step(True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        step(True)
        torch.cuda.synchronize()
    path = os.path.join(os.environ.get("TRACE_DIR") or tempfile.mkdtemp(), f"trace_{label}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"], path


def self_intervals(host_events) -> list[tuple[str, float, float]]:
    """(name, start, end) pieces of each host event's span not covered by an event nested in it (same thread)."""
    pieces = []
    by_thread = defaultdict(list)
    for event in host_events:
        by_thread[event["tid"]].append(event)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, cursor]: the open ranges and where their uncovered part resumes

        def close_until(time):
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= time:
                event, cursor = stack.pop()
                end = event["ts"] + event["dur"]
                if end > cursor:
                    pieces.append((event["name"], cursor, end))
                if stack:
                    stack[-1][1] = max(stack[-1][1], end)

        for event in events:
            close_until(event["ts"])
            if stack:
                parent = stack[-1]
                if event["ts"] > parent[1]:
                    pieces.append((parent[0]["name"], parent[1], event["ts"]))
                parent[1] = max(parent[1], event["ts"])
            stack.append([event, event["ts"]])
        close_until(float("inf"))
    return pieces


def overlap(a0, a1, b0, b1) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def report(name: str, events: list[dict]) -> None:
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    launches = {e["args"].get("correlation"): e for e in host if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    start = min(e["ts"] for e in device)
    end = max(e["ts"] + e["dur"] for e in device)
    gaps = [(a, b, device[i], device[j]) for a, b, i, j in idle_gaps([(e["ts"], e["ts"] + e["dur"]) for e in device])]
    idle = sum(b - a for a, b, _, _ in gaps)
    print(f"== {name}: device span {(end - start) / 1e3:.2f} ms, busy {(end - start - idle) / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms "
          f"in {len(gaps)} gaps ({sum(1 for a, b, _, _ in gaps if b - a > 20)} over 20 us), {len(device)} device events")
    host_pieces = self_intervals(host)

    def launcher(event):
        launch = launches.get(event.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        inside = [p for p in host_pieces if p[1] <= launch["ts"] <= p[2] and p[0] != launch["name"]]
        return min(inside, key=lambda p: p[2] - p[1])[0][:70] if inside else launch["name"]

    print(f"largest {TOP} gaps: us | kernel before | kernel after | host range around the launch of the kernel after")
    for a, b, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:TOP]:
        print(f"  {b - a:8.1f} | {before['name'][:50]} | {after['name'][:50]} | {launcher(after)}")
    tally = defaultdict(float)
    for a, b, _, _ in gaps:
        if b - a < 5:
            continue
        for piece_name, p0, p1 in host_pieces:
            tally[piece_name] += overlap(a, b, p0, p1)
    print("host ranges by the idle time they overlap (gaps of 5 us or more; threads add up):")
    for piece_name, us in sorted(tally.items(), key=lambda item: -item[1])[: TOP + 10]:
        print(f"  {us / 1e3:8.3f} ms  {piece_name[:110]}")
    print(flush=True)


def main() -> None:
    models = sys.argv[1:] or ["stock", "occult"]
    shape = os.environ.get("SHAPE", "olmoe-1b-7b")
    stack = os.environ.get("STACK", "1") != "0"
    config = model_config(shape, 4)
    device = torch.device("cuda")
    stock = build_model(config, device, torch.bfloat16, copies=3)
    ids_BS = torch.randint(0, config.vocab_size, (8, 2048), device=device)
    for name in models:
        model = stock if name == "stock" else apply_occult(copy.deepcopy(stock), {"num_devices": 1})
        torch._dynamo.reset()
        compiled = torch.compile(model.model)
        step = decoder_steps(model, ids_BS, compiled)
        for with_stack in (False, stack) if stack else (False,):
            events, path = traced_step(step, with_stack, f"{shape}_{name}_stack{int(with_stack)}")
            report(f"{shape} {name} compiled, forward+backward, with_stack={with_stack} ({os.path.basename(path)})", events)
        if model is not stock:
            del model, compiled, step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
