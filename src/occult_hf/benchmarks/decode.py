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
  `CompileConfig`: inductor, `mode="reduce-overhead"`, so CUDA graphs) and the prompt runs eagerly;
- **static-reused**: the same compiled step with one `StaticCache` per batch size, reset and passed to every call
  (`past_key_values=`, the name transformers 5.17-5.23 know), as a server keeps one per batch shape (docs/runtime.md):
  its tensors stay at one address, so CUDA-graph trees keep one graph where a new cache per call can make them record
  one per address they see.

The time per step is `(t(N) - t(1)) / (N - 1)` for the wall times `t(n)` of a whole `generate(max_new_tokens=n)`
(the median of `--repeats` runs): the prefill and generate's set-up cancel. Before them run one call that compiles
and captures, then untimed pairs of calls until a pair records no new CUDA graph (`graph_settling`: each static-cache
`generate()` makes a new cache, and CUDA-graph trees record again wherever it lands at new addresses); the notes say
how many graphs each variant recorded after its first call.
Tokens per second are `B / step`. The floor is the step's bytes at the GPU's memory bandwidth: the active
parameters (attention, routers, shared experts, k of E experts per layer, embeddings and head) read once in bf16.

By default stock and occult are timed in turns in this process. With `--isolate` each implementation is timed in a
fresh process of its own, as a server holds one model: compiled models in one process share dynamo's caches and the
device's one CUDA-graph tree manager, which can move a host-bound static step by a millisecond either way.

Correctness in the same run: greedy tokens of occult and stock with the static cache in fp32 (`--check-layers`
decoder layers, fp32: ties that bf16 rounding breaks differently cannot change a token there), and the largest
difference of the first step's logits at the full configuration, in the timed dtype.

The table, its plot and the JSON rows are rewritten after every batch size (with `--isolate` too: each process writes
its rows after each one), so a run cut at a time limit keeps the batches it finished.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import functools
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Cache, StaticCache

from occult_hf.benchmarks import failure_text, measures_a_gpu
from occult_hf.benchmarks.graph_settling import counting_graph_recordings, settle
from occult_hf.benchmarks.model import MODEL_SHAPES, build_model, dry_run_hidden, model_config
from occult_hf.utils.arguments import non_negative_int, positive_float, positive_int
from occult_hf.utils.atomic import atomic_write_text

HELP = "model.generate() per step at batch 1-64, dynamic, static and reused static cache: occult_hf vs stock transformers"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

#: the real models' decoder layer counts (the checkpoints' config.json)
FULL_LAYERS = {"olmoe-1b-7b": 16, "qwen1.5-moe-a2.7b": 24}
#: how a variant decodes (the module docstring says what each is)
CACHES = ("dynamic", "static", "static-reused")


@dataclass
class DecodeRow:
    model: str
    batch: int
    implementation: str  # "stock" or "occult"
    cache: str  # one of CACHES
    ms_per_step: float  # NaN where the run failed
    first_call_s: float  # the warm-up run: compile and capture for the static cache
    error: str | None = None  # why the run failed (the other rows still run)
    settling_calls: int = 0  # these three: the `StepTiming` fields of the same names (a row is made from one)
    graphs_settling: int = 0
    graphs_timed: int = 0

    def settling_note(self) -> str | None:
        """What CUDA-graph trees recorded after the compiling call, where they recorded anything."""
        if not (self.graphs_settling or self.graphs_timed):
            return None
        note = (f"{self.model} B={self.batch} {self.implementation} {self.cache}: {self.graphs_settling} CUDA graphs recorded "
                f"in {self.settling_calls} untimed generate() pairs after the compiling call")  # fmt: skip
        return note + (f", {self.graphs_timed} while timed (its step includes them)" if self.graphs_timed else "")


def generate_greedy(model, prompt_BS, new_tokens: int, cache: str | Cache, **generate_kwargs):
    """`model.generate()` of exactly `new_tokens` greedy tokens with the `"dynamic"` or `"static"` cache, or with the
    `Cache` given (reset first: the serving recipe), and any other `generate_kwargs`."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_router_logits=False, **generate_kwargs)
    if isinstance(cache, Cache):
        cache.reset()
        kwargs["past_key_values"] = cache
    elif cache == "static":
        kwargs["cache_implementation"] = "static"
    return model.generate(prompt_BS, attention_mask=torch.ones_like(prompt_BS), pad_token_id=0, **kwargs)


def static_cache_for(model, prompt_BS, new_tokens: int) -> StaticCache:
    """A `StaticCache` for `prompt_BS` and `new_tokens` more, sized as `generate(cache_implementation="static")` sizes
    the one it makes (the serving recipe keeps one per batch shape)."""
    return StaticCache(config=model.config, max_cache_len=prompt_BS.shape[1] + new_tokens)


def wall_s(fn) -> float:
    """Seconds `fn()` takes, the GPU's queue drained before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass(frozen=True)
class StepTiming:
    """What `time_step` measured: ms per step, and how the static step came to be a replay (`graph_settling`)."""

    ms_per_step: float
    first_call_s: float  # the call that compiles (with the static cache, also the first CUDA graph's recording)
    settling_calls: int  # untimed (1-token, N-token) call pairs after it, until a pair recorded no CUDA graph
    graphs_settling: int  # the CUDA graphs those pairs recorded
    graphs_timed: int  # CUDA graphs recorded while timed: 0 once settled, else the step includes recordings


def time_step(model, prompt_BS, new_tokens: int, cache: str, repeats: int) -> StepTiming:
    """`generate()` on `prompt_BS` with `cache`: one call that compiles, untimed pairs of calls until CUDA-graph trees
    stop recording (`graph_settling.settle`), then `repeats` timed pairs: the medians of the calls of 1 and of
    `new_tokens` tokens. `"static-reused"` makes its one `StaticCache` here, sized as `"static"` sizes each call's."""
    if cache == "static-reused":
        cache = static_cache_for(model, prompt_BS, new_tokens)

    def call_s(tokens: int) -> float:
        return wall_s(lambda: generate_greedy(model, prompt_BS, tokens, cache))

    def pair() -> tuple[float, float]:  # the same calls in the same order settling and timed: the same allocations
        return call_s(1), call_s(new_tokens)

    first = call_s(new_tokens)
    with counting_graph_recordings() as recorded:
        pairs, settling = settle(pair, recorded, prompt_BS.device)
        before = recorded[0]
        short, long = (statistics.median(walls) for walls in zip(*(pair() for _ in range(repeats))))
        timed = recorded[0] - before
    return StepTiming((long - short) * 1e3 / (new_tokens - 1), first, pairs, settling, timed)


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


def occult_version(model, args):
    """`model` with occult_hf applied on one device (in place), its routing untracked under `--untracked`."""
    from occult_hf import apply_occult, track_routing

    occult = apply_occult(model, {"num_devices": 1})
    track_routing(occult, not args.untracked)
    return occult


def check_tokens(shape: str, args, device) -> str:
    """Greedy tokens of occult and stock, static cache, fp32, `--check-layers` layers: equal or not (a line)."""
    config = model_config(shape, args.check_layers, args.hidden, args.intermediate)
    stock = build_model(config, device, torch.float32, args.seed, copies=2)
    occult = occult_version(copy.deepcopy(stock), args)
    prompt = torch.randint(0, config.vocab_size, (4, args.prompt), device=device, generator=torch.Generator(device).manual_seed(1))
    tokens = {name: generate_greedy(model, prompt, 16, "static") for name, model in (("stock", stock), ("occult", occult))}
    equal = torch.equal(tokens["stock"], tokens["occult"])
    del stock, occult
    free_memory(device)
    return f"{shape}: greedy tokens (fp32, {args.check_layers} layers, B=4, 16 new, static cache) occult == stock: {equal}"


def free_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def full_config(shape: str, args):
    return model_config(shape, args.layers or FULL_LAYERS[shape], args.hidden, args.intermediate)


def decode_prompt(config, args, device) -> torch.Tensor:
    """`[max batch, --prompt]` random token ids, the same in every process of a run (its own seeded generator)."""
    generator = torch.Generator(device).manual_seed(args.seed)
    return torch.randint(0, config.vocab_size, (max(args.batches), args.prompt), device=device, generator=generator)


def stock_and_occult(config, args, device) -> dict:
    stock = build_model(config, device, args.dtype, args.seed, copies=2)
    return {"stock": stock, "occult": occult_version(copy.deepcopy(stock), args)}


def first_step_note(shape: str, models: dict, prompt_BS: torch.Tensor, args) -> str:
    """The largest difference of occult's and stock's last-position logits for the prompt's first sequence."""
    with torch.no_grad():
        logits = {name: model(input_ids=prompt_BS[:1]).logits[:, -1].float() for name, model in models.items()}
    difference = (logits["occult"] - logits["stock"]).abs().max().item()
    return f"{shape}: max |occult - stock| of the first step's logits ({str(args.dtype).removeprefix('torch.')}) = {difference:.3g}"


def time_rows(shape: str, models: dict, prompt_BS: torch.Tensor, args, done: Callable[[list[DecodeRow]], None]) -> None:
    """Time every batch size and cache of each of `models` (implementation name -> model); `done(rows so far)` after
    each batch size. A variant that fails is a row with its reason, and the others still run."""
    rows = []
    for batch in args.batches:
        for cache in args.caches:
            for name, model in models.items():
                try:
                    timing = time_step(model, prompt_BS[:batch], args.new_tokens, cache, args.repeats)
                except Exception as error:  # noqa: BLE001 - one failed variant is a row of the table, not the end of the run
                    why = failure_text(error)
                    rows.append(DecodeRow(shape, batch, name, cache, float("nan"), float("nan"), why))
                    print(f"{shape} B={batch} {name} {cache}: failed: {why}", flush=True)
                    torch._dynamo.reset()
                    continue
                rows.append(DecodeRow(shape, batch, name, cache, **asdict(timing)))
                print(f"{shape} B={batch} {name} {cache}: {timing.ms_per_step:.2f} ms/step (first call {timing.first_call_s:.1f} s)", flush=True)
                if note := rows[-1].settling_note():
                    print(note, flush=True)
        done(rows)


def measure(shape: str, args, device, done: Callable[[list[DecodeRow], str, float], None]) -> None:
    """Time every variant of `shape`; after each batch size (with `--isolate`: after each implementation's process),
    `done(rows so far, note, floor)`: the note (the logits' difference, the floor) and the batch-1 floor in ms per
    step, so that a run cut short keeps what it finished."""
    config = full_config(shape, args)
    floor_ms = active_bytes(config, args.dtype) / (args.bandwidth_gbs * 1e6)
    models, prompt_BS = stock_and_occult(config, args, device), decode_prompt(config, args, device)
    note = first_step_note(shape, models, prompt_BS, args)
    print(note, flush=True)
    note += f"; floor at batch 1 (active parameters at {args.bandwidth_gbs:.0f} GB/s) {floor_ms:.2f} ms/step"
    if args.isolate:  # the models leave this process before the timed ones start
        del models
        free_memory(device)
        return measure_isolated(shape, args, lambda rows: done(rows, note, floor_ms))
    time_rows(shape, models, prompt_BS, args, lambda rows: done(rows, note, floor_ms))
    del models
    free_memory(device)


#: what a process of `--isolate` is given of the run's arguments
ISOLATED_ARGS = ("layers", "hidden", "intermediate", "batches", "caches", "prompt", "new_tokens", "repeats", "untracked", "seed")


def measure_isolated(shape: str, args, done: Callable[[list[DecodeRow]], None]) -> None:
    """Each implementation of `shape` timed in a fresh Python process of its own (`python -m
    occult_hf.benchmarks.decode SPEC`), as a server holds one model: compiled models in one process share dynamo's
    caches and the device's one CUDA-graph tree manager, which moves host-bound static steps (docs/compile_h200.md,
    "2026-12-04, 08:41-09:16 UTC"). `done(rows so far)` after each process; a process that fails or dies
    leaves a row with its exit status and the end of its output for every variant it did not time. Each process writes
    its rows after every batch size, and `done` follows it there too, so a run cut short (Ctrl-C, or `timeout`'s
    SIGTERM) keeps those batches."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="occult_decode_") as scratch:
        for implementation in ("stock", "occult"):
            spec = Path(scratch) / f"{implementation}.json"
            rows_path = Path(scratch) / f"{implementation}_rows.json"
            write_isolated_spec(spec, shape, implementation, rows_path, args)
            written = RowsFile(rows_path)
            status, tail, stopped_by = run_streaming(isolated_command(spec), lambda: written.changed() and done(rows + written.rows()))
            timed = written.rows()
            rows += timed
            if stopped_by is not None:  # the batches the process wrote since its last line of output count too
                done(rows)
                raise KeyboardInterrupt if stopped_by == signal.SIGINT else SystemExit(128 + stopped_by)
            if status:
                why = f"its process (one per implementation, --isolate) exited with status {status}: {tail}"
                seen = {(r.batch, r.cache) for r in timed}
                rows += [DecodeRow(shape, batch, implementation, cache, float("nan"), float("nan"), why)
                         for batch in args.batches for cache in args.caches if (batch, cache) not in seen]  # fmt: skip
            done(rows)


class RowsFile:
    """The rows an `--isolate` process has written so far (a JSON list of `DecodeRow`s), and whether they changed."""

    def __init__(self, path: Path) -> None:
        self.path, self._seen = path, None

    def changed(self) -> bool:
        stamp = self.path.stat().st_mtime_ns if self.path.is_file() else None
        changed, self._seen = stamp != self._seen, stamp
        return changed

    def rows(self) -> list[DecodeRow]:
        return [DecodeRow(**row) for row in json.loads(self.path.read_text())] if self.path.is_file() else []


def run_streaming(command: list[str], after_each_line: Callable[[], object]) -> tuple[int, str, int | None]:
    """Run `command`, echoing its output (stderr merged) as it comes and calling `after_each_line()` after each line;
    `(exit status, its last 300 characters on one line, the signal that stopped this run or None)`. A SIGTERM
    (`timeout`'s) or Ctrl-C here kills the process rather than leave it on the GPU, and this returns once its output
    is read, so that the caller can keep what it wrote before raising; any other interruption kills it too."""
    last_lines, stopped_by = collections.deque(maxlen=20), []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as process:

        def stop(signum, frame):
            stopped_by.append(signum)
            process.kill()

        with signals_handled_by(stop, signal.SIGTERM, signal.SIGINT):
            try:
                for line in process.stdout:
                    print(line, end="", flush=True)
                    last_lines.append(line)
                    after_each_line()
                status = process.wait()
            except BaseException:
                process.kill()
                raise
    return status, " ".join("".join(last_lines).split())[-300:], stopped_by[0] if stopped_by else None


@contextmanager
def signals_handled_by(handler, *signums):
    """`handler` for `signums` while inside (only the main thread can handle signals; elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


def write_isolated_spec(spec: Path, shape: str, implementation: str, rows_path: Path, args) -> None:
    """What `time_alone` reads: the model, the implementation, where to write its rows, and the run's arguments."""
    atomic_write_text(spec, json.dumps({"shape": shape, "implementation": implementation, "rows": str(rows_path),
                                        "dtype": str(args.dtype).removeprefix("torch."),
                                        "args": {name: getattr(args, name) for name in ISOLATED_ARGS}}))  # fmt: skip


def isolated_command(spec: Path) -> list[str]:
    return [sys.executable, "-m", "occult_hf.benchmarks.decode", str(spec)]


def time_alone(spec_path: str) -> int:
    """The process of one implementation under `--isolate`: time its rows and write them after each batch size."""
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"], dtype=getattr(torch, spec["dtype"]))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    config = full_config(spec["shape"], args)
    model = build_model(config, device, args.dtype, args.seed)
    if spec["implementation"] == "occult":
        model = occult_version(model, args)

    def write_rows(rows: list[DecodeRow]) -> None:
        atomic_write_text(Path(spec["rows"]), json.dumps([asdict(r) for r in rows]))

    time_rows(spec["shape"], {spec["implementation"]: model}, decode_prompt(config, args, device), args, write_rows)
    return 0


def results_table(rows: list[DecodeRow]) -> str:
    """One line per (model, batch): every variant's ms per step and tokens per second, and occult's ratios (nan where
    a variant failed or has not run yet)."""
    from occult_hf.utils.tables import markdown_table

    by = {(r.model, r.batch, r.implementation, r.cache): r.ms_per_step for r in rows}

    def ms(*key) -> float:  # NaN for a variant not timed yet (under `--isolate`, occult's rows come after stock's)
        return by.get(key, float("nan"))

    caches = [cache for cache in CACHES if cache in {r.cache for r in rows}]
    headers = ["model", "B"]
    for cache in caches:
        headers += [f"stock {cache} ms", f"occult {cache} ms", f"occult {cache} tok/s"]
    headers += [f"occult {c} vs stock {s}" for c in caches for s in caches]
    lines = []
    for model, batch in sorted({(r.model, r.batch) for r in rows}):
        line = [model, batch]
        for cache in caches:
            stock, occult = ms(model, batch, "stock", cache), ms(model, batch, "occult", cache)
            line += [f"{stock:.2f}", f"{occult:.2f}", f"{batch * 1e3 / occult:.0f}"]
        line += [f"{ms(model, batch, 'stock', s) / ms(model, batch, 'occult', c):.1f}x" for c in caches for s in caches]
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
        timed = [r for r in rows if r.model == model and math.isfinite(r.ms_per_step)]  # failed variants have no point
        for implementation, cache in dict.fromkeys((r.implementation, r.cache) for r in timed):
            line = sorted((r.batch, r.ms_per_step) for r in timed if (r.implementation, r.cache) == (implementation, cache))
            ax.plot(*zip(*line), marker="o", linestyle="-" if implementation == "occult" else "--", label=f"{implementation}, generate(), {cache} cache")
        ax.axhline(floors_ms[model], color="grey", linestyle=":", label="floor at batch 1 (memory)")
        if timed:  # a log axis needs a positive point
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
    parser.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the real model's)")
    parser.add_argument("--hidden", type=dry_run_hidden, default=None, help="override H (CPU dry runs)")
    parser.add_argument("--intermediate", type=positive_int, default=None, help="override the expert/MLP widths (CPU dry runs)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    parser.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens (S)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per generate (N)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--check-layers", type=non_negative_int, default=2, help="layers of the fp32 greedy-token check (0: skip)")
    parser.add_argument("--bandwidth-gbs", type=positive_float, default=None, help="memory bandwidth for the floor (default: measured)")
    parser.add_argument("--untracked", action="store_true", help="occult with track_routing(model, False), as for serving")
    parser.add_argument("--isolate", action="store_true",
                        help="time stock and occult each in a process of its own (as a server holds one model), not both in this one")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for bench_decode_<device>.md/.json/.png (default: ./docs)")


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
        f"{'each implementation in a process of its own (`--isolate`), ' if args.isolate else ''}"
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
        lines += [note for note in map(DecodeRow.settling_note, every) if note]
        text = f"{header}\n\n{results_table(every)}\n\n" + "\n".join(f"- {line}" for line in lines)
        atomic_write_text(out / f"bench_decode_{device.type}.md", text + "\n")
        plot(every, floors_ms, out / f"bench_decode_{device.type}.png")
        atomic_write_text(out / f"bench_decode_{device.type}.json", json.dumps({"header": header, "notes": lines, "rows": [asdict(r) for r in every]}, indent=1))

    for shape in args.models:
        measure(shape, args, device, functools.partial(write, shape))
    print("\n" + (out / f"bench_decode_{device.type}.md").read_text())
    return 0


if __name__ == "__main__":  # one implementation's process under --isolate
    sys.exit(time_alone(sys.argv[1]))
