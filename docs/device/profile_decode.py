"""Where the time of one `generate()` step at batch 1 goes, stock against occult (issue 31).

One H200, the real configuration of `MODEL` (default olmoe-1b-7b; qwen1.5-moe-a2.7b), all its layers, random
weights, bf16, a 128-token prompt.

- `dynamic` (the default cache, eager): the host functions that take the most of a step (cProfile over
  `generate(max_new_tokens=33)`), and each host synchronisation of a prefill and one step, with where it came from
  (`torch.cuda.set_sync_debug_mode("warn")`).
- `static` (`cache_implementation="static"`: transformers compiles the step, CUDA graphs): the GPU's busy time per
  step (the kernels' durations from `torch.profiler`) against the wall time per step, and the kernels that take most.
  Where wall exceeds busy, the step waits on the host, not on the GPU: inductor's cudagraph counters and a cProfile of
  the same `generate()` say where that host time goes.

- `host` (the static cache again, three models in one process: occult, occult with `track_routing(model, False)`,
  stock): the wall time per step, three times each in turns, and the host ranges of a step that the profiler
  names: dynamo's guard check (`TorchDynamo Cache Lookup`), the compiled region, the graph launch.
- `block` (eager, no gradient, one MoE block of the first layer at decode sizes: T = 1, 8, 64 tokens): the host's
  time to issue one call of stock's block, occult's, and occult's with `track_routing(model, False)`, against each
  one's wall time per call, five rounds in turns; the profiler's operator table of occult's and stock's block (own
  CPU time, calls, kernel launches); then the whole models' dynamic-cache `generate()` step at each batch of
  `BATCHES` (default 1), five rounds in turns.
- `crossover` (eager, no gradient, one MoE block of a one-layer model of each configuration at T = 1 to 256 tokens):
  the experts from the top-k against the grouped path, each forced, the host's issue time and the wall time per
  call (five rounds in turns) and the GPU's busy time per call: where `TOPK_PAIRS_PER_EXPERT` comes from.
- `layers` (the dynamic cache, eager): the host time of a step in every layer's attention, in its MLP / MoE block
  and in the rest, and the step's wall time, stock against occult, five rounds in turns at each batch of `BATCHES`.
- `tracking` (the static cache): what `track_routing` costs a step, in its two parts: occult tracked, occult
  keeping its routing with its counters' `record` made a no-op, occult untracked and stock, seven rounds in turns; then
  each one's graph replays and the host ranges of a profiled step, and a cProfile of the tracked and the untracked step.
- `filtered` (the static cache): each model's step with `generate()`'s default compile settings and with dynamo's
  guards on modules dropped (`filtered_compile_config`), three rounds each, and whether the greedy tokens agree.

Run by docs/device/compile.sh's `profile` step (`PROFILE` names the caches); prints to stdout.
"""

import collections
import copy
import cProfile
import io
import math
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch

from occult_hf import apply_occult, occult_modules, track_routing
from occult_hf.benchmarks.decode import FULL_LAYERS, generate_greedy, time_step, wall_s
from occult_hf.benchmarks.model import build_model, model_config

STEPS = 33


def host_syncs(model, prompt) -> list[str]:
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-3:]
            sites.append(" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        generate_greedy(model, prompt, 2, "dynamic")
        torch.cuda.set_sync_debug_mode(0)
    return sites


def profile_dynamic(name, model, prompt):
    sites = host_syncs(model, prompt)
    print(f"{name}: {len(sites)} host synchronisations in a 2-token generate (prefill + 1 step)", flush=True)
    for site, count in collections.Counter(sites).most_common(12):
        print(f"  {count} x {site}", flush=True)
    host_profile(name, model, prompt, "dynamic")


def host_profile(name, model, prompt, cache):
    """The host functions of a whole `generate()` with `cache` under cProfile, by own and by cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    generate_greedy(model, prompt, STEPS, cache)
    torch.cuda.synchronize()
    profile.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(28)
        print(f"-- {name} {cache} by {order}\n" + text.getvalue().split("ncalls", 1)[1], flush=True)


def kernel_us(result) -> collections.Counter:
    """µs of GPU time per kernel name in a `torch.profiler` run."""
    totals = collections.Counter()
    for event in result.key_averages():
        if event.device_time_total > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key] += event.device_time_total
    return totals


def graph_replays(result, idle_us: float = 30.0) -> str:
    """The decode steps' graph replays in a `torch.profiler` run, told apart by the GPU idling more than `idle_us`
    between kernels (a host-bound step leaves a gap): per replay, the kernels' count, their summed time and the span
    from the first start to the last end. Span over sum is what launching many small kernels costs inside a graph."""
    kernels = sorted(
        (event.time_range.start, event.time_range.end)
        for event in result.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.end > event.time_range.start
    )
    replays, current = [], []
    for start, end in kernels:
        if current and start - current[-1][1] > idle_us:
            replays.append(current)
            current = []
        current.append((start, end))
    replays.append(current)
    longest = max(len(replay) for replay in replays)
    replays = [replay for replay in replays if len(replay) >= longest // 2]  # not the loop's own kernels between steps
    count = statistics.median(len(replay) for replay in replays)
    busy = statistics.median(sum(end - start for start, end in replay) for replay in replays)
    span = statistics.median(replay[-1][1] - replay[0][0] for replay in replays)
    return f"{len(replays)} graph-sized kernel runs, medians: {count:.0f} kernels, {busy / 1e3:.2f} ms of kernels in a {span / 1e3:.2f} ms span"


def profile_static(name, model, prompt, wall_ms):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as run:
        generate_greedy(model, prompt, STEPS, "static")
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prefill:
        generate_greedy(model, prompt, 1, "static")
        torch.cuda.synchronize()

    per_step = kernel_us(run)
    per_step.subtract(kernel_us(prefill))
    busy_ms = sum(per_step.values()) / 1e3 / (STEPS - 1)
    print(f"{name} static: GPU busy {busy_ms:.2f} ms of {wall_ms:.2f} ms per step", flush=True)
    print(f"{name} static: {graph_replays(run)}", flush=True)
    for kernel, us in per_step.most_common(12):
        print(f"  {us / (STEPS - 1):8.1f} us/step  {kernel[:110]}", flush=True)
    from torch._dynamo.utils import counters

    print(f"{name} static: inductor counters " + str({k: v for k, v in counters["inductor"].items() if "graph" in k}), flush=True)
    host_profile(name, model, prompt, "static")


HOST_RANGES = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "cudaGraphLaunch")


def with_untracked(models) -> dict:
    """`models` (occult, stock) with a third between them: stock converted again, `track_routing(model, False)`."""
    untracked = apply_occult(copy.deepcopy(models["stock"]), {"num_devices": 1})
    track_routing(untracked, False)
    return {"occult": models["occult"], "occult untracked": untracked, "stock": models["stock"]}


def in_turns(candidates: dict, measure, rounds: int) -> dict:
    """`measure(candidate)` for each candidate `rounds` times, in turns (so that a slower minute of the shared host
    falls on every candidate alike), as `{name: [results of each round]}`."""
    results = collections.defaultdict(list)
    for _ in range(rounds):
        for name, candidate in candidates.items():
            results[name].append(measure(candidate))
    return results


def filtered_compile_config():
    """`generate()`'s default compile settings (inductor with CUDA graphs) with dynamo's guards on modules dropped:
    torch refuses `mode` and `options` together, so the CUDA graphs are asked for as the option `mode` sets."""
    from transformers import CompileConfig

    guard_filter = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    return CompileConfig(mode=None, options={"triton.cudagraphs": True, "guard_filter_fn": guard_filter})


def profile_filtered(models, prompt):
    """Each model's static step with the default compile settings, then with `filtered_compile_config`, three rounds
    each, and whether the two give the same greedy tokens. Every model and setting has dynamo's cache to itself
    (`torch._dynamo.reset()` before each): with the guards on modules dropped, one compiled entry serves every model
    whose frames share its code, so stock and occult would run each other's graphs (seen on the CPU: occult's graph
    reading `_original` of stock's blocks). So the rounds are not in turns across models and settings."""
    for name, model in models.items():
        tokens = {}
        for label, config in (("default", None), ("filtered", filtered_compile_config())):
            torch._dynamo.reset()
            model.generation_config.compile_config = config
            walls = [time_step(model, prompt, STEPS, "static", repeats=2).ms_per_step for _ in range(3)]
            tokens[label] = generate_greedy(model, prompt, 16, "static")
            print(f"filtered {name} {label}: {' / '.join(f'{w:.2f}' for w in walls)} ms per step (3 rounds)", flush=True)
        model.generation_config.compile_config = None
        print(f"filtered {name}: 16 greedy tokens equal between the settings: {torch.equal(*tokens.values())}", flush=True)


def profiled_static_generate(model, prompt, *activities):
    """A static-cache `generate()` under `torch.profiler` with `activities`: the run, and the host ranges of a step
    that the profiler names (`HOST_RANGES`), each as ms per call and calls."""
    from torch.profiler import profile

    with profile(activities=list(activities)) as run:
        generate_greedy(model, prompt, STEPS, "static")
        torch.cuda.synchronize()
    events = {event.key: event for event in run.key_averages()}
    ranges = ", ".join(
        f"{key} {events[key].cpu_time_total / events[key].count / 1e3:.3f} ms x {events[key].count}"
        for key in HOST_RANGES if key in events
    )  # fmt: skip
    return run, ranges


def profile_tracking(models, prompt):
    """Which part of `track_routing`'s work a CUDA-graphed step pays for: the stored routing (a graph output per layer
    that the block keeps alive) or the counters (two in-place adds per layer), told apart by a variant whose counters'
    `record` does nothing; then a cProfile of the tracked and the untracked step, where the host time shows."""
    models = with_untracked(models)
    routing_only = apply_occult(copy.deepcopy(models["stock"]), {"num_devices": 1})
    for block in occult_modules(routing_only).values():
        block.stats.record = lambda counts_D2, row_bytes: None
    models = {"occult": models.pop("occult"), "occult routing only": routing_only, **models}
    walls = in_turns(models, lambda model: time_step(model, prompt, STEPS, "static", repeats=2).ms_per_step, rounds=7)
    from torch.profiler import ProfilerActivity

    for name, model in models.items():
        run, ranges = profiled_static_generate(model, prompt, ProfilerActivity.CPU, ProfilerActivity.CUDA)
        median = statistics.median(walls[name])
        print(f"tracking {name}: median {median:.2f} ms per step ({' / '.join(f'{w:.2f}' for w in walls[name])}); {ranges}", flush=True)
        print(f"tracking {name}: {graph_replays(run)}", flush=True)
        table = run.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
        print(f"-- tracking {name}: profiler over one generate()\n{table}", flush=True)
    for name in ("occult", "occult untracked"):
        host_profile(name, models[name], prompt, "static")


def profile_host(models, prompt):
    models = with_untracked(models)
    walls = in_turns(models, lambda model: time_step(model, prompt, STEPS, "static", repeats=2).ms_per_step, rounds=3)
    from torch.profiler import ProfilerActivity

    for name, model in models.items():
        _, ranges = profiled_static_generate(model, prompt, ProfilerActivity.CPU)
        print(f"host {name}: {' / '.join(f'{w:.2f}' for w in walls[name])} ms per step; {ranges}", flush=True)


BLOCK_TOKENS = (1, 8, 64)
BLOCK_CALLS = 300
ROUNDS = 5


def issue_and_wall_us(block, x):
    """`(host µs to issue one call, wall µs per call)` over `BLOCK_CALLS` calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(BLOCK_CALLS):
        block(x)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / BLOCK_CALLS * 1e6, (time.perf_counter() - start) / BLOCK_CALLS * 1e6


def profile_block(models, prompt):
    from torch.profiler import ProfilerActivity, profile

    models = with_untracked(models)
    blocks = {name: model.model.layers[0].mlp for name, model in models.items()}
    hidden = models["stock"].config.hidden_size
    with torch.no_grad():
        for tokens in BLOCK_TOKENS:
            x = torch.randn(tokens, 1, hidden, device="cuda", dtype=torch.bfloat16)
            for block in blocks.values():  # tune and warm every kernel first
                for _ in range(20):
                    block(x)
            for name, rounds in in_turns(blocks, lambda block: issue_and_wall_us(block, x), ROUNDS).items():
                issue = " ".join(f"{i:.0f}" for i, _ in rounds)
                wall = " ".join(f"{w:.0f}" for _, w in rounds)
                print(f"block T={tokens} {name}: issue {issue} us, wall {wall} us per call ({ROUNDS} rounds in turns)", flush=True)
            for name in ("occult", "stock"):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as run:
                    for _ in range(100):
                        blocks[name](x)
                    torch.cuda.synchronize()
                table = run.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                print(f"-- block T={tokens} {name}: profiler over 100 calls\n{table}", flush=True)
    for batch in [int(b) for b in os.environ.get("BATCHES", "1").split()]:
        prompt_BS = prompt[:1].expand(batch, -1).contiguous()
        rounds = in_turns(models, lambda model: time_step(model, prompt_BS, STEPS, "dynamic", repeats=1).ms_per_step, ROUNDS)
        for name, walls in rounds.items():
            print(f"dynamic B={batch} {name}: {' '.join(f'{w:.2f}' for w in walls)} ms per step ({ROUNDS} rounds in turns)", flush=True)


CROSSOVER_TOKENS = (1, 8, 16, 32, 64, 128, 256)


def with_topk_bound(block, pairs_per_expert):
    """`block`'s forward with `occult_hf.experts.TOPK_PAIRS_PER_EXPERT` at `pairs_per_expert` for the call (`math.inf`:
    the top-k path wherever its other conditions hold; 0: the grouped path)."""
    import occult_hf.experts as experts_module

    def run(x):
        shipped = experts_module.TOPK_PAIRS_PER_EXPERT
        experts_module.TOPK_PAIRS_PER_EXPERT = pairs_per_expert
        try:
            return block(x)
        finally:
            experts_module.TOPK_PAIRS_PER_EXPERT = shipped

    return run


def profile_crossover():
    """One eager MoE block (no gradient, the first layer of each model) computing its experts from the top-k
    (`LocalExperts.forward_topk`) and by the grouped path, at each of `CROSSOVER_TOKENS`: the host µs to issue a
    call, the wall µs per call (five rounds in turns) and the GPU's busy µs per call (the profiler's kernels), the
    path forced either way through the bound `LocalExperts.computes_topk` reads (`with_topk_bound`)."""
    from torch.profiler import ProfilerActivity, profile

    for name in FULL_LAYERS:
        stock = build_model(model_config(name, 1), torch.device("cuda"), torch.bfloat16)
        model = apply_occult(stock, {"num_devices": 1})
        track_routing(model, False)
        block = model.model.layers[0].mlp
        paths = {"topk": with_topk_bound(block, math.inf), "grouped": with_topk_bound(block, 0)}
        with torch.no_grad():
            for tokens in CROSSOVER_TOKENS:
                x = torch.randn(tokens, 1, stock.config.hidden_size, device="cuda", dtype=torch.bfloat16)
                for run in paths.values():  # tune and warm every kernel first
                    for _ in range(20):
                        run(x)
                rounds = in_turns(paths, lambda run: issue_and_wall_us(run, x), ROUNDS)
                for label, run in paths.items():
                    with profile(activities=[ProfilerActivity.CUDA]) as traced:
                        for _ in range(100):
                            run(x)
                        torch.cuda.synchronize()
                    busy = sum(kernel_us(traced).values()) / 100
                    issue = " ".join(f"{i:.0f}" for i, _ in rounds[label])
                    wall = " ".join(f"{w:.0f}" for _, w in rounds[label])
                    print(f"crossover {name} T={tokens} {label}: GPU busy {busy:.0f} us, issue {issue} us, wall {wall} us per call", flush=True)
        del stock, model, block, paths
        torch.cuda.empty_cache()


def host_ms_by_part(model, prompt_BS) -> dict[str, float]:
    """Host ms a dynamic-cache decoding step spends in each decoder layer's attention, its MLP / MoE block and the
    rest (from forward pre- and post-hooks on every layer's `self_attn` and `mlp`: the hooks' own cost falls on
    every model alike), and the step's wall ms."""
    spent = collections.Counter()
    entered = {}

    def enter(part):
        return lambda module, args: entered.__setitem__(part, time.perf_counter())

    def leave(part):
        return lambda module, args, output: spent.update({part: time.perf_counter() - entered[part]})

    handles = []
    for layer in model.model.layers:
        for part in ("self_attn", "mlp"):
            module = getattr(layer, part)
            handles += [module.register_forward_pre_hook(enter(part)), module.register_forward_hook(leave(part))]
    try:
        walls = {}
        for tokens in (1, STEPS):
            spent.clear()
            walls[tokens] = {"wall": wall_s(lambda: generate_greedy(model, prompt_BS, tokens, "dynamic")), **spent}
    finally:
        for handle in handles:
            handle.remove()
    per_step = {part: (walls[STEPS][part] - walls[1][part]) * 1e3 / (STEPS - 1) for part in ("self_attn", "mlp", "wall")}
    per_step["rest"] = per_step["wall"] - per_step["self_attn"] - per_step["mlp"]
    return per_step


def profile_layers(models, prompt):
    """`host_ms_by_part` of stock, occult and occult untracked, five rounds in turns, at each batch of `BATCHES`."""
    models = with_untracked(models)
    for batch in [int(b) for b in os.environ.get("BATCHES", "1").split()]:
        prompt_BS = prompt[:1].expand(batch, -1).contiguous()
        for model in models.values():
            generate_greedy(model, prompt_BS, STEPS, "dynamic")  # tune and warm
        for name, rounds in in_turns(models, lambda model: host_ms_by_part(model, prompt_BS), ROUNDS).items():
            parts = ", ".join(f"{part} {' '.join(f'{r[part]:.2f}' for r in rounds)}" for part in ("wall", "self_attn", "mlp", "rest"))
            print(f"layers B={batch} {name} (ms per step, {ROUNDS} rounds in turns): {parts}", flush=True)


def main():
    caches = sys.argv[1:] or ["dynamic", "static"]
    if caches == ["crossover"]:
        return profile_crossover()
    device = torch.device("cuda")
    name = os.environ.get("MODEL", "olmoe-1b-7b")
    config = model_config(name, FULL_LAYERS[name])
    stock = build_model(config, device, torch.bfloat16)
    models = {"occult": apply_occult(copy.deepcopy(stock), {"num_devices": 1}), "stock": stock}  # occult first: a cut run keeps it
    prompt = torch.randint(0, config.vocab_size, (1, 128), device=device)
    if caches == ["host"]:
        return profile_host(models, prompt)
    if caches == ["tracking"]:
        return profile_tracking(models, prompt)
    if caches == ["filtered"]:
        return profile_filtered(models, prompt)
    if caches == ["block"]:
        return profile_block(models, prompt)
    if caches == ["layers"]:
        return profile_layers(models, prompt)
    for cache in caches:
        for name, model in models.items():
            wall_ms = time_step(model, prompt, STEPS, cache, repeats=2).ms_per_step
            print(f"== {name} {cache}: {wall_ms:.2f} ms per step", flush=True)
            (profile_dynamic(name, model, prompt) if cache == "dynamic" else profile_static(name, model, prompt, wall_ms))


if __name__ == "__main__":
    main()
