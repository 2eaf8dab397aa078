"""The results of `occult bench paper`: one markdown table per experiment, the plot, and the files rank 0 writes
(`paper_comparison_<D>x<device>.md/.json/.png`).

Shape legend: D ranks.
"""

from __future__ import annotations

import datetime
import json
import math
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from occult_hf.benchmarks.paper_models import PAPER_HARDWARE, PAPER_MODELS
from occult_hf.benchmarks.paper_rows import EXPERIMENTS, FINETUNE_ROWS, PREFILL_ROWS, PaperRow
from occult_hf.utils.atomic import atomic_save_figure, atomic_write_text
from occult_hf.utils.tables import markdown_table


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def results_tables(rows: list[PaperRow]) -> dict[str, str]:
    """One markdown table per experiment."""
    tables = {}
    for experiment in EXPERIMENTS:
        order = [key for key, _ in (PREFILL_ROWS if experiment == "prefill" else FINETUNE_ROWS)]
        models = list(PAPER_MODELS)
        chosen = sorted(
            (r for r in rows if r.experiment == experiment),
            key=lambda r: (models.index(r.model), order.index(r.key) if r.key in order else len(order)),
        )
        if not chosen:
            continue
        base_key = "stock_1gpu" if experiment == "prefill" else "fsdp2"
        bases = {r.model: r for r in chosen if r.key == base_key and r.ran}
        unit = "forward" if experiment == "prefill" else "optimizer step"
        header = ["model", "setup", "routing", f"tokens per {unit}", f"ms per {unit}", "tokens/s", f"vs {base_key}", "CT",
                  "max rel. err. vs stock" if experiment == "prefill" else "loss (step 1)", "peak GiB per GPU",
                  f"paper ({PAPER_HARDWARE})", "not run because"]  # fmt: skip
        lines = []
        for r in chosen:
            base = bases.get(r.model)
            ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base is not None and r.ran else "-"
            check = _cell(r.max_rel_err, ".1e") if experiment == "prefill" else _cell(r.loss, ".4f")
            peaks = " / ".join(f"{p:.1f}" for p in r.peak_gib) or "-"
            cells = [r.model, r.setup, r.routing, str(r.tokens) if r.ran else "-", _cell(r.ms, ".1f"),
                     _cell(r.tokens_per_s, ",.0f"), ratio, _cell(r.ct, ".2f"), check, peaks, r.paper,
                     r.reason.replace("|", "/") or "-"]  # fmt: skip
            lines.append(cells)
        tables[experiment] = markdown_table(header, lines)
    return tables


def header_lines(args, world: int, device) -> str:
    from occult_hf.benchmarks.experts import machine_line

    launcher = f"torchrun --nproc-per-node {world} -m occult_hf.cli" if world > 1 else "occult"
    command = " ".join([launcher, *(shlex.quote(a) for a in sys.argv[1:])])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"`occult bench paper`, {world} rank(s), scale {args.scale}, machine kind {args.machine_kind}, {stamp}, "
        f"{machine_line(device)}\n\ncommand: `{command}`"
    )


def plot(rows: list[PaperRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experiments = [e for e in EXPERIMENTS if any(r.experiment == e and r.ran for r in rows)]
    fig, axes = plt.subplots(1, max(len(experiments), 1), figsize=(7 * max(len(experiments), 1), 6), squeeze=False)
    for ax, experiment in zip(axes[0], experiments):
        shown = [r for r in rows if r.experiment == experiment and r.ran]
        labels = [f"{r.model}: {r.key}" for r in shown]
        ax.barh(range(len(shown)), [r.tokens_per_s for r in shown], color="tab:blue")
        ax.set_yticks(range(len(shown)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (group)", fontsize=7)
        ax.set_title(experiment, fontsize=9)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)


def save_results(rows: list[PaperRow], args, world: int, device, plot_too: bool = True) -> None:
    """Write `paper_comparison_<D>x<device>.md/.json` and, with `plot_too`, `.png` under `args.out` (rank 0;
    the plot costs about a second per call on a CPU, so rows save without it)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = header_lines(args, world, device)
    tables = results_tables(rows)
    text = header + "".join(f"\n\n### {experiment}\n\n{table}" for experiment, table in tables.items()) + "\n"
    stem = out / f"paper_comparison_{world}x{device.type}"
    atomic_write_text(stem.with_suffix(".md"), text)
    atomic_write_text(stem.with_suffix(".json"), json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    if plot_too:
        plot(rows, stem.with_suffix(".png"))
