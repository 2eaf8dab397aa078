"""What crosses nodes (issue 35, "Must show"): CT_node and bytes per token crossing nodes, by placement and pruning.

    python -m occult_hf.eval.studies.node_traffic_study                                    # the study trace only
    python -m occult_hf.eval.studies.node_traffic_study --routing-dir ../shared/data/routing --out docs/scale_results/node_traffic.md

At D = 16, 32 and 64 GPUs of G = 8 per node, for each per-token trace: placements planned on one half of its
tokens (`contiguous`; flat `refined`, which minimises CT; node-aware `refined` with `devices_per_node=G`, which
minimises CT_node first) and measured on the held-out other half (alternate 128-token windows,
`occult_hf.scale.routing.Routing.halves`), unpruned and with node-limited pruning
to N_n = 4 and 2 nodes per token (`OccultConfig.max_nodes_per_token`, the library's walk; a limit of at least the
N = D/G nodes prunes nothing and is left out), with the share of routing weight (and of slots: the study trace
records no weights) each removes. The traces:

* the study model's routing (`docs/quality_results/study_routing_h200.npz`, ships with the repository: E=64,
  top-8, 8 layers, 6,144 held-out tokens; means over its layers);
* with `--routing-dir`, Qwen1.5-MoE-A2.7B's real GSM8K trace (E=60, top-4, layer 0, 4,384 tokens, with weights).
  The other files there cannot give these figures: Mixtral-8x7B has E=8 experts (fewer than 16 devices), OLMoE's
  file holds pair counts (no per-token sets, so no CT_node), the others expert frequencies only.

Rows crossing nodes per token and direction, each token's own node uniform over the N = D/G nodes (tokens
spread evenly over the ranks), the figures `occult_hf.scale.traffic` replays: flat exchange (one row per (token,
device)) `CT x (N-1)/N`; hierarchical exchange (one copy per (token, node)) `CT_node x (N-1)/N`. Bytes: a dispatch
row of H bf16 values and 6 bytes per pair it carries (the combine returns as many rows, of 2H bytes each), at
H = 2048 (the models these traces stand for: Qwen1.5-MoE-A2.7B, and OLMoE-1B-7B for the study trace, as in
`occult bench paper`). Pruned rows move a pruned pair to the token's best kept device: CT_node and the
hierarchical crossing are exact for the router and similarity policies (their replacements lie on the kept
nodes); the flat figures count the kept experts' devices, a lower bound where a replacement lands on a new device.

Shape legend (docs/conventions.md): D devices, k experts per token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from occult_hf.profile.replay import STUDY_TRACE
from occult_hf.scale.projection import Planner
from occult_hf.scale.routing import Routing, load_routing
from occult_hf.scale.traffic import replay_traffic, row_bytes
from occult_hf.utils.atomic import atomic_write_text
from occult_hf.utils.progress import progress_bar
from occult_hf.utils.tables import markdown_table
from occult_hf.utils.errors import run_command

QWEN_TRACE = "qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
PLACEMENTS = {"contiguous": "contiguous", "refined": "flat refined", "node_refined": "node-aware refined"}
NODE_LIMITS = (None, 4, 2)
HIDDEN = 2048


def traffic_rows(routing: Routing, devices: tuple[int, ...], devices_per_node: int, progress: bool = True) -> list[list]:
    """The table's rows for one trace (module docstring)."""
    plan_half, held_out = routing.halves()
    rows = []
    cases = [(d, p, n) for d in devices for p in PLACEMENTS for n in NODE_LIMITS]
    planners: dict[int, Planner] = {}
    for count, placement, limit in progress_bar(cases, enabled=progress, desc=f"node traffic {routing.source}", unit="case"):
        nodes = count // devices_per_node
        if count > routing.num_experts or (limit is not None and limit >= nodes):
            continue  # more devices than experts; a limit of at least every node prunes nothing
        planner = planners.setdefault(count, Planner(plan_half, count, devices_per_node))
        traffics = [
            replay_traffic(held_out.ids_NLk[:, layer], held_out.weights(layer), device_of_E, count, devices_per_node, 1,
                           "dedup", HIDDEN, max_nodes_per_token=limit)
            for layer, device_of_E in enumerate(planner.device_maps(placement))
        ]  # fmt: skip
        ct, ct_node = np.mean([t.ct for t in traffics]), np.mean([t.ct_node for t in traffics])
        flat, hierarchical = ct * (nodes - 1) / nodes, ct_node * (nodes - 1) / nodes
        per_row = row_bytes("dedup", HIDDEN, routing.top_k) / 2  # one direction: dispatch and combine rows alike
        slots = np.mean([t.removed_slots for t in traffics])
        weight = None if routing.weights_NLk is None else np.mean([t.removed_weight for t in traffics])
        rows.append([
            count, PLACEMENTS[placement], "-" if limit is None else f"N_n={limit}", f"{ct:.2f}", f"{ct_node:.2f}",
            f"{flat:.2f}", f"{hierarchical:.2f}", f"{flat * per_row / 1e3:.1f}", f"{hierarchical * per_row / 1e3:.1f}",
            "-" if limit is None else f"{slots:.1%}", "-" if limit is None or weight is None else f"{weight:.1%}",
        ])  # fmt: skip
    return rows


HEADERS = ["D", "placement", "pruning", "CT", "CT_node", "rows crossing / token, flat", "hierarchical",
           "KB crossing / token, flat", "hierarchical", "slots pruned", "routing weight pruned"]  # fmt: skip


def run_study(study_trace: str, routing_dir: str | None, devices: tuple[int, ...], devices_per_node: int, progress: bool) -> str:
    """The markdown of every trace's table."""
    traces = [(study_trace, "the study model's held-out routing (E=64, top-8, 8 layers; means over layers), no weights recorded")]
    if routing_dir is not None:
        traces.append((os.path.join(routing_dir, QWEN_TRACE), "Qwen1.5-MoE-A2.7B's real GSM8K trace (E=60, top-4, layer 0), with weights"))
    parts = []
    for path, what in traces:
        routing = load_routing(path)
        plan_tokens, held_tokens = (half.ids_NLk.shape[0] for half in routing.halves())
        started = time.process_time()
        rows = traffic_rows(routing, devices, devices_per_node, progress)
        skipped = [d for d in devices if d > routing.num_experts]
        parts += [
            f"### {routing.source}: {what}",
            f"Planned on {plan_tokens:,} tokens, measured on the held-out {held_tokens:,} (alternate 128-token windows); "
            f"G = {devices_per_node}; "
            f"{time.process_time() - started:.0f} s of CPU."
            + (f" D = {', '.join(map(str, skipped))}: more devices than its {routing.num_experts} experts, left out." if skipped else ""),
            markdown_table(HEADERS, rows),
        ]  # fmt: skip
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study-trace", default=STUDY_TRACE, help="the study model's trace (default: %(default)s)")
    parser.add_argument("--routing-dir", default=None, help="../shared/data/routing: add Qwen1.5-MoE's real trace")
    parser.add_argument("--devices", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    bad = [d for d in args.devices if d % args.devices_per_node]
    if bad:
        parser.error(f"--devices {bad} not a multiple of --devices-per-node {args.devices_per_node}")
    text = run_study(args.study_trace, args.routing_dir, tuple(args.devices), args.devices_per_node, not args.no_progress)
    print(text)
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, text + "\n")


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.node_traffic_study", main))
