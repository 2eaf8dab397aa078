"""`occult bench replicas`: the load-aware replica rule of one layer on one GPU: eager, its CUDA graph, its Triton kernel.

Shape legend (docs/conventions.md): T tokens per rank, k experts per token, E experts, M most homes of one
expert, G ranks of the group.

Under `replica_choice="load_aware"` every layer routes its replicated experts' pairs by the batch's loads
(`replicas.routing.load_aware_homes`): a per-expert half (`expert_routes`: the split's rounds and the tables,
about 480 small operators) and a per-pair half (about 80). Run eagerly, the rule took about twice the layer on two
H200s (docs/placement.md); `GraphedRoutes` replays the per-expert half from one CUDA graph per layer, and one Triton
kernel computes it (`kernels.replica_routes`, what the dispatchers launch on a GPU). This times, per layer and in one process, for each case (E, k) x D logical devices x T:

- `static`: the static rule (`resolve_homes`), the baseline every replicated layer pays;
- `routes eager` / `routes graphed` / `routes kernel`: the per-expert half alone, eager, replayed, one launch;
- `rule eager` / `rule graphed` / `rule kernel`: the whole rule for rank 0, with each per-expert half and the torch
  per-pair half;
- `rule all kernels`: both halves in Triton (the per-pair half as `kernels.replica_pairs`'s few launches), eager:
  what `replica_choice="load_aware"` costs a layer of an eager forward on top of its exchange, as the dispatchers
  run it;
- `rule in one graph` / `rule kernel in one graph`: the whole rule captured, with the eager or the kernel's
  per-expert half (what a layer captured as a whole pays: graphed decoding).

The G = D ranks' counts are computed from synthetic routing and handed over as if all-gathered (the one
collective of the rule is not timed: `occult bench ep`'s replica rows time it in place). Routing: each token's k
experts drawn without replacement with weights 1 / (rank + 4) (skewed as real routers are), the contiguous map
plus one redundant slot per device for the D hottest experts (second home half the group away). Each time is
the median of `--iterations` host-timed calls (`bench ep`'s `timed`: synchronised before and after; these calls
are launch-bound, so the host's time is the layer's). Every case also checks that the graphed rule routes
exactly as the eager one, and counts the pairs the kernels' rules route elsewhere (the per-expert kernel's sums run in
another order: a pair exactly on a rounding tie may move; 0 expected).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np
import torch

from occult_hf.utils.atomic import atomic_write_json, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.benchmarks.ep import timed
from occult_hf.utils.cuda_graph import capture
from occult_hf.kernels.replica_pairs import FUSED_PAIRS
from occult_hf.kernels.replica_routes import fused_expert_routes
from occult_hf.replicas.routing import (
    PIN_SLACK,
    GraphedRoutes,
    expert_routes,
    home_table_from,
    load_aware_homes,
    preference_counts,
    replica_preferences,
    resolve_homes,
)
from occult_hf.benchmarks import measures_a_gpu

HELP = "the load-aware replica rule per layer on one GPU: eager against its CUDA graph, beside the static rule"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

#: (name, E, k) of the routed experts timed
SHAPES = (("OLMoE", 64, 8), ("Qwen1.5", 60, 4))
COLUMNS = (
    "static", "routes eager", "routes graphed", "routes kernel", "rule eager", "rule graphed", "rule kernel", "rule all kernels",
    "rule in one graph", "rule kernel in one graph",
)  # fmt: skip


def synthetic_case(num_experts: int, top_k: int, num_devices: int, tokens: int, device, seed: int = 0):
    """`(ids_GTk, home_table_EM)`: every rank's routing (skewed expert weights) and a map with the D hottest
    experts replicated half the group away (one redundant slot per device)."""
    generator = torch.Generator().manual_seed(seed)
    popularity_E = 1.0 / (torch.randperm(num_experts, generator=generator).double() + 4.0)
    ids_Nk = torch.multinomial(popularity_E.expand(num_devices * tokens, -1), top_k, generator=generator)
    primary_E = np.arange(num_experts) * num_devices // num_experts
    hottest = torch.argsort(popularity_E, descending=True)[:num_devices].tolist()
    table_EM = home_table_from(primary_E, {e: [int(primary_E[e] + max(1, num_devices // 2)) % num_devices] for e in hottest})
    return ids_Nk.view(num_devices, tokens, top_k).to(device), torch.from_numpy(table_EM).to(device)


def time_case(num_experts: int, top_k: int, num_devices: int, tokens: int, device, iterations: int) -> tuple[dict[str, float | None], int | None]:
    """`(ms, moved)`: per-layer ms of each of `COLUMNS` for rank 0 (None: no CUDA graph or compiled kernel on this
    device), and the pairs the kernel's rule routes elsewhere than the eager one (None on CPU)."""
    ids_GTk, table_EM = synthetic_case(num_experts, top_k, num_devices, tokens, device)
    max_homes = table_EM.shape[1]
    gathered_GEM1 = torch.stack([
        preference_counts(ids_Tk, replica_preferences(ids_Tk, table_EM, num_devices)[1], num_experts, max_homes) for ids_Tk in ids_GTk
    ])
    ids_Tk, graphed = ids_GTk[0], GraphedRoutes()
    args = (num_devices, 0, PIN_SLACK, False)

    def rule(routes, pairs=None):
        return lambda: load_aware_homes(ids_Tk, table_EM, num_devices, lambda _: gathered_GEM1, 0, routes=routes, pairs=pairs)

    eager = rule(expert_routes)()
    if not torch.equal(rule(graphed)(), eager):
        raise RuntimeError(f"E={num_experts} D={num_devices} T={tokens}: the graphed rule routes differently from the eager one")
    on_gpu = torch.device(device).type == "cuda"
    times = {
        "static": timed(lambda: resolve_homes(ids_Tk, table_EM, num_devices), iterations, device),
        "routes eager": timed(lambda: expert_routes(gathered_GEM1, table_EM, *args), iterations, device),
        "routes graphed": timed(lambda: graphed(gathered_GEM1, table_EM, *args), iterations, device) if on_gpu else None,
        "rule eager": timed(rule(expert_routes), iterations, device),
        "rule graphed": timed(rule(graphed), iterations, device) if on_gpu else None,
        "routes kernel": None,
        "rule kernel": None,
        "rule all kernels": None,
        "rule in one graph": None,
        "rule kernel in one graph": None,
    }
    if not on_gpu:
        return times, None
    kernel_routed = rule(fused_expert_routes)()
    if not torch.equal(rule(fused_expert_routes, FUSED_PAIRS)(), kernel_routed):
        raise RuntimeError(f"E={num_experts} D={num_devices} T={tokens}: the per-pair kernels route differently from the torch per-pair half")
    moved = int((kernel_routed != eager).sum())
    times["routes kernel"] = timed(lambda: fused_expert_routes(gathered_GEM1, table_EM, *args), iterations, device)
    times["rule kernel"] = timed(rule(fused_expert_routes), iterations, device)
    times["rule all kernels"] = timed(rule(fused_expert_routes, FUSED_PAIRS), iterations, device)
    for column, routes, expected in (("rule in one graph", expert_routes, eager), ("rule kernel in one graph", fused_expert_routes, kernel_routed)):
        whole, out = capture(rule(routes), device, warmup=2)
        whole.replay()
        if not torch.equal(out, expected):
            raise RuntimeError(f"E={num_experts} D={num_devices} T={tokens}: the {column} routes differently from its uncaptured rule")
        times[column] = timed(whole.replay, iterations, device)
    return times, moved


def table(rows: list[dict]) -> str:
    """Markdown: one row per case, the columns' ms, the ratios of the rules to the static one, and the pairs the
    kernel's rule moved."""
    head = [
        "model (E, k)", "D", "T per rank", *(f"{c} ms" for c in COLUMNS), "rule eager / graphed", "rule graphed / static",
        "rule kernel / static", "rule all kernels / static", "kernel moved pairs",
    ]  # fmt: skip
    lines = []
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for row in rows:
        t = row["ms"]
        ratio = "-" if t["rule graphed"] is None else f"{t['rule eager'] / t['rule graphed']:.1f}x"
        over = "-" if t["rule graphed"] is None else f"{t['rule graphed'] / t['static']:.1f}x"
        kernel = "-" if t["rule kernel"] is None else f"{t['rule kernel'] / t['static']:.2f}x"
        all_kernels = "-" if t["rule all kernels"] is None else f"{t['rule all kernels'] / t['static']:.2f}x"
        moved = "-" if row["kernel moved"] is None else str(row["kernel moved"])
        cells = [f"{row['model']} ({row['E']}, {row['k']})", str(row["D"]), str(row["T"]), *(fmt(t[c]) for c in COLUMNS), ratio, over, kernel, all_kernels, moved]
        lines.append(cells)
    return markdown_table(head, lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from occult_hf.utils.arguments import positive_int

    parser.add_argument("--devices", nargs="+", type=positive_int, default=[8, 2], help="logical devices D (the group's ranks)")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=[16384, 128], help="tokens per rank")
    parser.add_argument("--iterations", type=positive_int, default=30, help="timed calls per cell (the median is shown)")
    parser.add_argument("--out", default="docs", help="folder for bench_replicas_<device>.md / .json (default: ./docs)")


def run(args: argparse.Namespace) -> int:
    device = torch.device("cpu" if args.cpu else "cuda")  # on the CPU the eager columns only, to check the script
    rows = []
    for name, experts, top_k in SHAPES:
        for num_devices in args.devices:
            for tokens in args.tokens:
                ms, moved = time_case(experts, top_k, num_devices, tokens, device, args.iterations)
                rows.append({"model": name, "E": experts, "k": top_k, "D": num_devices, "T": tokens, "ms": ms, "kernel moved": moved})
    from occult_hf.benchmarks.experts import machine_line

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = f"`occult bench replicas`, one process, {stamp}, {machine_line(device)}; ms per layer for rank 0, median of {args.iterations}"
    text = f"{header}\n\n{table(rows)}\n"
    print("\n" + text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"bench_replicas_{device.type}.md", text)
    atomic_write_json(out / f"bench_replicas_{device.type}.json", {"header": header, "rows": rows})
    return 0


__all__ = ["COLUMNS", "SHAPES", "add_arguments", "run", "synthetic_case", "table", "time_case"]
