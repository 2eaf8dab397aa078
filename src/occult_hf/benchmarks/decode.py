"""`occult bench decode`: `model.generate()` on one GPU, occult_hf against stock transformers, in one run.

Shape legend: B sequences (the batch), S prompt length, N new tokens.

Per model (`--models`: the real OLMoE-1B-7B and Qwen1.5-MoE-A2.7B configurations, all their layers, random
weights) the stock transformers causal LM is built in bf16 on the GPU, and a copy with
`apply_occult(model, {"num_devices": 1})` (with `--untracked`, also `track_routing(model, False)`: the serving
setting, which keeps no routing record and no counters). Each decodes, at every batch size of `--batches`, a random prompt of
`--prompt` tokens with transformers' own `generate()` (greedy, `min_new_tokens` = `max_new_tokens`, so no sequence
stops early):

- **dynamic**: the default dynamic cache, eager;
- **static**: `cache_implementation="static"`: transformers compiles the decoding step (its default
  `CompileConfig`: inductor, `mode="reduce-overhead"`, so CUDA graphs) and the prompt runs eagerly.

The time per step is `(t(N) - t(1)) / (N - 1)` for the wall times `t(n)` of a whole `generate(max_new_tokens=n)`
(the median of `--repeats` runs, after one run that compiles and captures): the prefill and generate's set-up cancel.
Tokens per second are `B / step`. The floor is the step's bytes at the GPU's memory bandwidth: the active
parameters (attention, routers, shared experts, k of E experts per layer, embeddings and head) read once in bf16.

Correctness in the same run: greedy tokens of occult and stock with the static cache in fp32 (`--check-layers`
decoder layers, fp32: ties that bf16 rounding breaks differently cannot change a token there), and the largest
difference of the first step's logits at the full configuration, in the timed dtype.

The table, its plot and the JSON rows are rewritten after every batch size, so a run cut at a time limit keeps the
batches it finished.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from occult_hf.benchmarks import failure_text, measures_a_gpu
from occult_hf.benchmarks.model import MODEL_SHAPES, build_model, model_config
from occult_hf.utils.atomic import atomic_write_text

HELP = "model.generate() per step at batch 1-64, dynamic and static cache: occult_hf vs stock transformers"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

#: the real models' decoder layer counts (the checkpoints' config.json)
FULL_LAYERS = {"olmoe-1b-7b": 16, "qwen1.5-moe-a2.7b": 24}
#: how a variant decodes (the module docstring says what each is)
CACHES = ("dynamic", "static")
#: batch 1 targets of the static occult step: ms per token
TARGET_MS, STRETCH_MS = 3.5, 2.0


@dataclass
class DecodeRow:
    model: str
    batch: int
    implementation: str  # "stock" or "occult"
    cache: str  # "dynamic" or "static"
    ms_per_step: float  # NaN where the run failed
    first_call_s: float  # the warm-up run: compile and capture for the static cache
    error: str | None = None  # why the run failed (the other rows still run)


def generate_greedy(model, prompt_BS, new_tokens: int, cache: str):
    """`model.generate()` of exactly `new_tokens` greedy tokens with the `"dynamic"` or `"static"` cache."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_router_logits=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    return model.generate(prompt_BS, attention_mask=torch.ones_like(prompt_BS), pad_token_id=0, **kwargs)


def wall_s(fn) -> float:
    """Seconds `fn()` takes, the GPU's queue drained before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_step(model, prompt_BS, new_tokens: int, cache: str, repeats: int) -> tuple[float, float]:
    """`(ms per step, seconds of the first call)` of `generate()` on `prompt_BS` with `cache`."""
    first = wall_s(lambda: generate_greedy(model, prompt_BS, new_tokens, cache))
    generate_greedy(model, prompt_BS, 1, cache)
    long = statistics.median(wall_s(lambda: generate_greedy(model, prompt_BS, new_tokens, cache)) for _ in range(repeats))
    short = statistics.median(wall_s(lambda: generate_greedy(model, prompt_BS, 1, cache)) for _ in range(repeats))
    return (long - short) * 1e3 / (new_tokens - 1), first


def active_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one decoding step must read at least: every parameter a token uses (k of E routed experts)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    moe_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = config.num_experts_per_tok * 3 * hidden * moe_width
    shared = 3 * hidden * getattr(config, "shared_expert_intermediate_size", 0) + hidden
    router = hidden * config.num_experts
    vocabulary = 2 * config.vocab_size * hidden
    return (layers * (attention + experts + shared + router) + vocabulary) * dtype.itemsize


def memory_bandwidth_gbs(device) -> float:
    """GB/s of a large device-to-device copy (bytes read plus written), measured here."""
    import triton.testing

    source = torch.empty(2**30 // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=100, return_mode="median")
    return 2 * source.numel() * source.element_size() / ms / 1e6


def occult_copy(stock, args):
    """`stock` with occult_hf applied on one device, its routing untracked under `--untracked`."""
    from occult_hf import apply_occult, track_routing

    occult = apply_occult(copy.deepcopy(stock), {"num_devices": 1})
    track_routing(occult, not args.untracked)
    return occult


def check_tokens(shape: str, args, device) -> str:
    """Greedy tokens of occult and stock, static cache, fp32, `--check-layers` layers: equal or not (a line)."""
    config = model_config(shape, args.check_layers, args.hidden, args.intermediate)
    stock = build_model(config, device, torch.float32, args.seed)
    occult = occult_copy(stock, args)
    prompt = torch.randint(0, config.vocab_size, (4, args.prompt), device=device, generator=torch.Generator(device).manual_seed(1))
    tokens = {name: generate_greedy(model, prompt, 16, "static") for name, model in (("stock", stock), ("occult", occult))}
    equal = torch.equal(tokens["stock"], tokens["occult"])
    del stock, occult
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return f"{shape}: greedy tokens (fp32, {args.check_layers} layers, B=4, 16 new, static cache) occult == stock: {equal}"


def measure(shape: str, args, device, done: Callable[[list[DecodeRow], str, float], None]) -> None:
    """Time every variant of `shape`; after each batch size, `done(rows so far, note, floor)`: the note (the logits'
    difference, the floor) and the batch-1 floor in ms per step, so that a run cut short keeps the batches it
    finished."""
    config = model_config(shape, args.layers or FULL_LAYERS[shape], args.hidden, args.intermediate)
    floor_ms = active_bytes(config, args.dtype) / (args.bandwidth_gbs * 1e6)
    stock = build_model(config, device, args.dtype, args.seed)
    occult = occult_copy(stock, args)
    models = {"stock": stock, "occult": occult}
    generator = torch.Generator(device).manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (max(args.batches), args.prompt), device=device, generator=generator)
    with torch.no_grad():
        logits = {name: model(input_ids=prompt[:1]).logits[:, -1].float() for name, model in models.items()}
    note = f"{shape}: max |occult - stock| of the first step's logits ({str(args.dtype).removeprefix('torch.')}) = {(logits['occult'] - logits['stock']).abs().max().item():.3g}"
    print(note, flush=True)
    note += f"; floor at batch 1 (active parameters at {args.bandwidth_gbs:.0f} GB/s) {floor_ms:.2f} ms/step"
    rows = []
    for batch in args.batches:
        for cache in args.caches:
            for name, model in models.items():
                try:
                    ms, first = time_step(model, prompt[:batch], args.new_tokens, cache, args.repeats)
                except Exception as error:  # noqa: BLE001 - one failed variant is a row of the table, not the end of the run
                    why = failure_text(error)
                    rows.append(DecodeRow(shape, batch, name, cache, float("nan"), float("nan"), why))
                    print(f"{shape} B={batch} {name} {cache}: failed: {why}", flush=True)
                    torch._dynamo.reset()
                    continue
                rows.append(DecodeRow(shape, batch, name, cache, ms, first))
                print(f"{shape} B={batch} {name} {cache}: {ms:.2f} ms/step (first call {first:.1f} s)", flush=True)
        done(rows, note, floor_ms)
    del stock, occult, models
    if device.type == "cuda":
        torch.cuda.empty_cache()


def results_table(rows: list[DecodeRow]) -> str:
    """One line per (model, batch): every variant's ms per step and tokens per second, and occult's ratios."""
    from occult_hf.utils.tables import markdown_table

    by = {(r.model, r.batch, r.implementation, r.cache): r for r in rows}
    caches = [cache for cache in CACHES if cache in {r.cache for r in rows}]
    headers = ["model", "B"]
    for cache in caches:
        headers += [f"stock {cache} ms", f"occult {cache} ms", f"occult {cache} tok/s"]
    headers += [f"occult {c} vs stock {s}" for c in caches for s in caches]
    lines = []
    for model, batch in sorted({(r.model, r.batch) for r in rows}):
        line = [model, batch]
        for cache in caches:
            stock, occult = by[(model, batch, "stock", cache)], by[(model, batch, "occult", cache)]
            line += [f"{stock.ms_per_step:.2f}", f"{occult.ms_per_step:.2f}", f"{batch * 1e3 / occult.ms_per_step:.0f}"]
        line += [
            f"{by[(model, batch, 'stock', s)].ms_per_step / by[(model, batch, 'occult', c)].ms_per_step:.1f}x"
            for c in caches for s in caches
        ]  # fmt: skip
        lines.append(line)
    return markdown_table(headers, lines)


def plot(rows: list[DecodeRow], floors_ms: dict[str, float], path: Path) -> None:
    """ms per step against the batch, one panel per model: each implementation and cache, and the batch-1 floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult_hf.utils.atomic import atomic_save_figure

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for implementation, cache in dict.fromkeys((r.implementation, r.cache) for r in rows if r.model == model):
            line = sorted((r.batch, r.ms_per_step) for r in rows if (r.model, r.implementation, r.cache) == (model, implementation, cache))
            ax.plot(*zip(*line), marker="o", linestyle="-" if implementation == "occult" else "--", label=f"{implementation}, generate(), {cache} cache")
        ax.axhline(floors_ms[model], color="grey", linestyle=":", label="floor at batch 1 (memory)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("ms per step (log)")
        ax.set_title(f"{model}: generate() per step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(FULL_LAYERS), choices=list(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    parser.add_argument("--hidden", type=int, default=None, help="override H (CPU dry runs)")
    parser.add_argument("--intermediate", type=int, default=None, help="override the expert/MLP widths (CPU dry runs)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (S)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per generate (N)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-layers", type=int, default=2, help="layers of the fp32 greedy-token check (0: skip)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the floor (default: measured)")
    parser.add_argument("--untracked", action="store_true", help="occult with track_routing(model, False), as for serving")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for bench_decode_<device>.md/.json/.png")


def run(args: argparse.Namespace) -> int:
    from occult_hf.benchmarks.experts import machine_line

    args.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = memory_bandwidth_gbs(device) if device.type == "cuda" else 100.0
    notes = [check_tokens(shape, args, device) for shape in args.models] if args.check_layers else []
    for note in notes:
        print(note, flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"`occult bench decode`, {str(args.dtype).removeprefix('torch.')}, prompt {args.prompt}, {args.new_tokens} new tokens, "
        f"{'occult untracked (`track_routing(model, False)`), ' if args.untracked else ''}"
        f"{stamp}, {machine_line(device)}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_of, notes_of, floors_ms = {}, {}, {}

    def write(shape: str, rows: list[DecodeRow], note: str, floor_ms: float) -> None:
        """The table, notes, plot and JSON of every batch finished so far (rewritten after each one)."""
        rows_of[shape], notes_of[shape], floors_ms[shape] = list(rows), note, floor_ms
        every = [r for shape_rows in rows_of.values() for r in shape_rows]
        lines = notes + list(notes_of.values()) + [f"{r.model} B={r.batch} {r.implementation} {r.cache} failed: {r.error}" for r in every if r.error]
        text = f"{header}\n\n{results_table(every)}\n\n" + "\n".join(f"- {line}" for line in lines)
        atomic_write_text(out / f"bench_decode_{device.type}.md", text + "\n")
        plot(every, floors_ms, out / f"bench_decode_{device.type}.png")
        atomic_write_text(out / f"bench_decode_{device.type}.json", json.dumps({"header": header, "notes": lines, "rows": [asdict(r) for r in every]}, indent=1))

    for shape in args.models:
        measure(shape, args, device, functools.partial(write, shape))
    print("\n" + (out / f"bench_decode_{device.type}.md").read_text())
    return 0
