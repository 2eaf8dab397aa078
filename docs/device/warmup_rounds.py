"""Which part of occult's static-cache `generate()` is slow in a process's first rounds: the decode steps or the prefill.

`tracking_alone.py` found occult's first round of five slower than the rest in most processes (3.47 against
2.64-2.77 ms a step, 4.70 against 3.46-3.61) and stock's not, and `occult bench decode` times one round per variant.
`python docs/device/warmup_rounds.py {tracked,untracked,stock}` (MODEL as in profile_decode.py) builds one model,
makes the compiling first call, then times ROUNDS rounds of a 64-token `generate()` ("long"), a 1-token one ("short":
the prefill and the loop's set-up) and one eager forward of the prompt ("prefill"), each once per round, and prints
them with the step `occult bench decode` derives from them, (long - short) / 63, and what CUDA-graph trees did in each
call (their "cudagraphs" log: warm-up runs, recordings, re-recordings with their reasons, eager runs), with where the
64-token call's static cache put its first layer's keys and the caching allocator's segments after it (a recording
for "static input data pointer changed" need not move those keys: occult's stayed put on 2026-12-04 while its first
calls recorded, and the reasons now name the inputs that moved).
REUSE_CACHE=1 passes one `StaticCache` to every call instead (reset before each): one address, so one recording.
EARLY_INIT=1 passes a new `StaticCache` to every call, as `generate()` makes one, but with its tensors allocated before
the prefill (`early_initialization`) instead of inside it: whether the moving static inputs (each layer's
`cumulative_length`, keys and values, 2026-12-04) move because the prefill's own allocations come between them.
ROUNDS (default 8) sets the rounds, BATCH (default 1) the batch: BATCH distinct random prompts of 128 tokens (copies of
one prompt would route every row alike, which made occult's batch-64 step 2.7-3.2 ms shorter than the bench's on
2026-12-04). SNAPSHOT=1 records the caching allocator's history and prints, after each round's long call, the blocks of
the default pool that came or went since the round before, by the frame that allocated them: what outlives a call and
so moves where the next call's cache lands (with EARLY_INIT=1 at batch 32 occult recorded graphs in nine calls, stock in one)."""

import collections
import logging
import os
import re
import sys

import torch
from transformers import StaticCache

from occult_hf.benchmarks.decode import generate_greedy, static_cache_for, wall_s
from tracking_alone import one_model  # this script's sibling (docs/device/)

NEW_TOKENS, ROUNDS, BATCH = 64, int(os.environ.get("ROUNDS", 8)), int(os.environ.get("BATCH", 1))
STACK = int(os.environ.get("STACK", 1))  # SNAPSHOT=1: the frames named per block, innermost first


class GraphTreeEvents(logging.Handler):
    """Counts the CUDA-graph trees' log records by kind, and keeps the re-recording reasons on one line each: the
    status and the names of the inputs that moved (the reason's "input name: ..." lines, without their stack traces).
    torch logs "Re-recording" for every kept graph whose check fails at a step, so after the recordings stop the
    count is (kept graphs that do not match) x (steps); "Recording" counts the recordings themselves."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts, self.reasons = collections.Counter(), collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        kind = str(record.msg).removeprefix("[%s] ").split(" function")[0]
        self.counts[kind] += 1
        if kind == "Re-recording":
            reason = str(record.args[-1])
            moved = re.findall(r"input name: ([^.\s]+)", reason)
            self.reasons[reason.split("\n")[0] + (f" inputs moved: {', '.join(moved)}" if moved else "")] += 1

    def take(self) -> str:
        text = ", ".join(f"{kind} {n}" for kind, n in sorted(self.counts.items())) or "replays only"
        self.counts.clear()
        return text


def watch_graph_trees() -> GraphTreeEvents:
    torch._logging.set_logs(cudagraphs=True)
    logger = logging.getLogger("torch._inductor.cudagraph_trees.__cudagraphs")
    logger.propagate = False
    events = GraphTreeEvents()
    logger.addHandler(events)
    return events


def live_blocks() -> collections.Counter:
    """The default pool's allocated blocks as a multiset of (address, size, allocating frames): the STACK innermost
    frames of occult_hf, transformers or this script, else of all frames recorded."""
    blocks = collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if tuple(segment["segment_pool_id"]) != (0, 0):
            continue  # a CUDA-graph pool: the recordings' memory, not where a cache lands
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or [{"filename": "?", "line": 0, "name": "?"}]
            ours = [f for f in frames if re.search(r"occult_hf|transformers|warmup_rounds", f["filename"])]
            where = " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in (ours or frames)[:STACK])
            blocks[(block["address"], block["size"], where)] += 1
    return blocks


def block_changes(before: collections.Counter, after: collections.Counter) -> str:
    """The blocks that came and went between two `live_blocks`, as counts and MiB by allocating frame."""
    parts = []
    for sign, changed in (("+", after - before), ("-", before - after)):
        by_frame = collections.defaultdict(lambda: [0, 0])
        for (_, size, where), n in changed.items():
            by_frame[where][0] += n
            by_frame[where][1] += n * size
        ranked = sorted(by_frame.items(), key=lambda item: -item[1][1])[:6]
        parts += [f"{sign}{n} ({size / 2**20:.2f} MiB) {where}" for where, (n, size) in ranked]
    return "; ".join(parts) or "none"


def static_call(model, prompt, cache):
    """`generate_call(tokens)`: a static-cache `generate()` of `tokens` tokens returning where its cache put the first
    layer's keys. `cache` is `"static"` (transformers makes a new cache per call, and the output, the cache in it, is
    dropped on return, as `generate()` drops it otherwise), with REUSE_CACHE=1 the one `StaticCache` of every call
    (`generate_greedy` resets it first), as a server can keep one per batch shape, or with EARLY_INIT=1 a callable
    making each call's new cache, initialised before the call."""

    def generate_call(tokens: int) -> int:
        output = generate_greedy(model, prompt, tokens, cache() if callable(cache) else cache, return_dict_in_generate=True)
        return output.past_key_values.layers[0].keys.data_ptr()

    return generate_call


def new_cache(model, prompt, initialised: bool = False) -> StaticCache:
    """A `StaticCache` for `prompt` and NEW_TOKENS more, as `generate()` sizes its own; `initialised`: its tensors
    allocated now (`early_initialization`, as transformers does for a chunked prefill) rather than in the prefill."""
    cache = static_cache_for(model, prompt, NEW_TOKENS)
    if initialised:  # with the shape transformers gives its own early-initialised caches (a chunked prefill's)
        heads, head_dim = model._get_static_cache_init_shape()
        cache.early_initialization(prompt.shape[0], heads, head_dim, model.dtype, prompt.device)
    return cache


def main() -> None:
    variant = sys.argv[1]
    name, model, prompt = one_model(variant)
    if BATCH > 1:  # distinct rows, seeded: the bench's prompts route like these, copies of one row would not
        generator = torch.Generator(prompt.device).manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (BATCH, prompt.shape[1]), device=prompt.device, generator=generator)
    reused, early = os.environ.get("REUSE_CACHE") == "1", os.environ.get("EARLY_INIT") == "1"
    cache = "static"
    if reused:
        cache = new_cache(model, prompt)
    elif early:
        cache = lambda: new_cache(model, prompt, initialised=True)  # noqa: E731
    generate_call = static_call(model, prompt, cache)
    variant += f", batch {BATCH}" + (", one StaticCache reused" if reused else ", a new early-initialised StaticCache a call" if early else "")
    events = watch_graph_trees()
    snapshot = os.environ.get("SNAPSHOT") == "1"
    if snapshot:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    first = wall_s(lambda: generate_call(NEW_TOKENS))
    print(f"warmup {name} {variant}: first call {first:.1f} s ({events.take()})", flush=True)
    where, blocks = {}, live_blocks() if snapshot else None

    def long_call() -> None:
        where["keys"] = generate_call(NEW_TOKENS)

    for round_ in range(ROUNDS):
        long = wall_s(long_call) * 1e3
        in_long = events.take()
        stats = torch.cuda.memory_stats()
        allocator = (f"keys at {where['keys']:#x}, {stats['segment.all.current']} segments, "
                     f"{stats['reserved_bytes.all.current'] / 2**20:.0f} MiB reserved")  # fmt: skip
        short = wall_s(lambda: generate_call(1)) * 1e3
        with torch.no_grad():
            prefill = wall_s(lambda: model(input_ids=prompt)) * 1e3
        step = (long - short) / (NEW_TOKENS - 1)
        print(f"warmup {name} {variant} round {round_}: long {long:.1f} ms, short {short:.1f} ms, "
              f"prefill {prefill:.1f} ms, step {step:.2f} ms; graph trees in the long call: {in_long}, then: {events.take()}; "
              f"{allocator}", flush=True)
        if snapshot:
            now = live_blocks()
            print(f"warmup {name} {variant} round {round_}: default-pool blocks since the round before: {block_changes(blocks, now)}", flush=True)
            blocks = now
    for reason, n in events.reasons.most_common(5):
        print(f"warmup {name} {variant}: re-recorded {n} times: {reason}", flush=True)


if __name__ == "__main__":
    main()
