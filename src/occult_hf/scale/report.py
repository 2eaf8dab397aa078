"""The cost model's tables (markdown through `utils.tables`) and its plot (PNG): calibration, validation, projections."""

from __future__ import annotations

import textwrap
from typing import Sequence

from ..utils.atomic import atomic_save_figure
from ..utils.tables import markdown_table, number_cell
from .parameters import Calibration
from .cost import Cluster
from .projection import Projected
from .spread import Spread, spreads
from .validation import Checked

#: the validation's tolerance: a prediction within 15% of the measured row
TOLERANCE = 0.15


def calibration_table(calib: Calibration) -> str:
    rows = [[p.name, p.value, p.points, "-" if p.max_error is None else f"{p.max_error:.0%}", p.source] for p in calib.parameters]
    return markdown_table(["parameter", "value", "points", "fit's largest error", "from"], rows)


def validation_table(checked: Sequence[Checked]) -> str:
    rows = [
        [c.table, c.source, c.label, f"{c.measured_ms:.2f}", f"{c.predicted_ms:.2f}", f"{c.error:+.0%}", _others(spread),
         ("fit" if c.calibration else "") + (" **miss**" if abs(c.error) > TOLERANCE else "")]
        for c, spread in zip(checked, spreads(checked))
    ]  # fmt: skip
    headers = ["table", "measured in", "row", "measured ms", "predicted ms", "error",
               "the same work measured elsewhere, ms (spread)", ""]  # fmt: skip
    return markdown_table(headers, rows)


def _others(spread: Spread) -> str:
    parts = [f"{label} {', '.join(f'{ms:.2f}' for _, ms in values)}"
             for label, values in (("repeats", spread.repeats), ("same work", spread.same_work)) if values]  # fmt: skip
    return "-" if not parts else "; ".join(parts) + f" ({spread.spread:.0%})"


def validation_summary(checked: Sequence[Checked]) -> str:
    """One line per table: rows within the tolerance, predictions (not calibration rows) within it, the worst; then
    every miss against the other measurements of its work (`spread`)."""
    lines = []
    for table in dict.fromkeys(c.table for c in checked):
        rows = [c for c in checked if c.table == table]
        held = [c for c in rows if not c.calibration]
        within = sum(abs(c.error) <= TOLERANCE for c in rows)
        worst = max(rows, key=lambda c: abs(c.error))
        line = f"- {table}: {within} of {len(rows)} rows within {TOLERANCE:.0%}"
        if held and len(held) != len(rows):
            line += f" ({sum(abs(c.error) <= TOLERANCE for c in held)} of the {len(held)} rows no fit used)"
        lines.append(f"{line}; largest error {worst.error:+.0%} ({worst.label}, {worst.source})")
    misses = [(c, spread) for c, spread in zip(checked, spreads(checked)) if abs(c.error) > TOLERANCE]
    lines += ["", f"{len(misses)} of {len(checked)} rows miss {TOLERANCE:.0%}; each against the other measurements of its "
              f"work (`scale.spread`: the same configuration in other calls; rows of its call the model gives the same "
              f"work):", ""]  # fmt: skip
    lines.append(markdown_table(
        ["table", "row", "measured in", "error", "other measurements of the same work, ms", "spread",
         "prediction against the nearest of them", f"a measurement of the same work within {TOLERANCE:.0%}"],
        [[c.table, c.label, c.source + (" (fit)" if c.calibration else ""), f"{c.error:+.1%}",
          "; ".join(f"{ms:.2f} ({where})" for where, ms in spread.others) or "none",
          "-" if spread.spread is None else f"{spread.spread:.0%}",
          "-" if spread.nearest_error is None else f"{spread.nearest_error:+.1%}",
          "none measured" if spread.nearest_error is None else ("yes" if abs(spread.nearest_error) <= TOLERANCE else "no")]
         for c, spread in misses],
    ))  # fmt: skip
    return "\n".join(lines)


def assumptions(cluster: Cluster) -> str:
    return (
        f"MODEL, not a measurement. Assumptions: G = {cluster.devices_per_node} GPUs per node joined by NVLink at the "
        f"two-GPU rates; nodes joined at {cluster.internode_gbs:g} GB/s per GPU with {cluster.internode_latency_us:g} us "
        f"per collective call that crosses them (arguments); no overlap of communication with compute; bf16 rows; "
        f"replicated experts not modelled."
    )


def summary_table(rows: Sequence[Projected], field: str = "fwd_bwd_ms") -> str:
    """D down, methods across: `field` per D, the fastest method of each D in bold (rows of one T). The EP group is
    the expert-parallel methods' (FSDP2's "group" is every GPU), or D where only FSDP2 ran."""
    methods = list(dict.fromkeys(r.method for r in rows))
    table = []
    for count in dict.fromkeys(r.devices for r in rows):
        at = {r.method: getattr(r, field) for r in rows if r.devices == count}
        ep = next((r.ep_devices for r in rows if r.devices == count and r.method != "fsdp2"), count)
        best = min((v for v in at.values() if v is not None), default=None)
        cells = ["-" if at.get(m) is None else (f"**{at[m]:.1f}**" if at[m] == best else f"{at[m]:.1f}") for m in methods]
        table.append([count, ep, *cells])
    return markdown_table(["D", "EP group", *methods], table)


def detail_table(rows: Sequence[Projected]) -> str:
    baseline = {(r.devices, r.tokens): r.fwd_bwd_ms for r in rows if r.method == "transformers_ep"}
    table = []
    for r in rows:
        base = baseline.get((r.devices, r.tokens))
        speedup = "-" if base is None or r.fwd_bwd_ms is None else f"{base / r.fwd_bwd_ms:.2f}x"
        moved = "-" if r.removed_slots is None else (
            f"{r.removed_slots:.1%} of slots" + ("" if r.removed_weight is None else f", {r.removed_weight:.1%} of weight")
        )  # fmt: skip
        table.append([
            r.devices, r.tokens, r.method, r.ep_devices, number_cell(r.ct), number_cell(r.ct_node), number_cell(r.internode_mb, 1), moved,
            number_cell(r.imbalance), number_cell(r.fwd_ms), number_cell(r.fwd_bwd_ms), speedup, number_cell(r.prefill_ms, 1), number_cell(r.step_ms, 1), r.note,
        ])  # fmt: skip
    headers = ["D", "T", "method", "EP group", "CT", "CT_node", "inter-node MB", "pruning moves", "busiest / mean pairs",
               "layer fwd ms", "layer fwd+bwd ms", "fwd+bwd vs transformers' EP", "prefill ms", "train step ms", "note"]  # fmt: skip
    return markdown_table(headers, table)


#: a method's colour is tab10's (ten distinct hues; tab20's come in light/dark pairs of one hue, hard to tell apart),
#: cycled, and its marker one of these per round of ten methods: any number of methods stays apart
PLOT_MARKERS = "osD^vPX*"
BASELINE_STYLE = "--"
#: the width the legend takes right of the panels
LEGEND_INCHES = 2.6


def method_styles(methods: Sequence[str]) -> dict[str, dict]:
    """Each method's line style (colour, marker, dashes for the baselines): as many methods as given, each its own."""
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    return {
        method: {"color": palette[i % len(palette)], "marker": PLOT_MARKERS[i // len(palette) % len(PLOT_MARKERS)],
                 "linestyle": BASELINE_STYLE if method in ("transformers_ep", "fsdp2") else "-"}
        for i, method in enumerate(methods)
    }  # fmt: skip


def projection_figure(cases: Sequence[tuple[str, Sequence[Projected]]], devices_per_node: int):
    """One panel per case and T: each method's forward+backward per MoE layer against D (log scales); one legend of
    every method drawn in any panel (a method one case refuses still has its line in another)."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    from matplotlib.lines import Line2D

    methods = list(dict.fromkeys(r.method for _, rows in cases for r in rows))
    styles = method_styles(methods)
    drawn: set[str] = set()
    token_counts = list(dict.fromkeys(r.tokens for _, rows in cases for r in rows))
    figure = Figure(figsize=(6 * len(cases) + LEGEND_INCHES, 4.6 * len(token_counts)))
    axes = figure.subplots(len(token_counts), len(cases), squeeze=False)
    for (row, tokens), (column, (title, case_rows)) in ((a, b) for a in enumerate(token_counts) for b in enumerate(cases)):
        axis, rows = axes[row][column], [r for r in case_rows if r.tokens == tokens]
        for method in dict.fromkeys(r.method for r in rows):
            points = [(r.devices, r.fwd_bwd_ms) for r in rows if r.method == method and r.fwd_bwd_ms is not None]
            if points:
                axis.plot(*zip(*points), markersize=3, label=method, **styles[method])
                drawn.add(method)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel(f"GPUs D ({devices_per_node} per node)")
        axis.set_ylabel("MoE layer forward+backward, ms (model)")
        axis.set_title("\n".join(textwrap.wrap(f"{title}; T = {tokens} tokens per GPU", 60)), fontsize=8)
        axis.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], markersize=3, label=m, **styles[m]) for m in methods if m in drawn]
    panels = 1 - LEGEND_INCHES / figure.get_figwidth()  # the share of the width left of the legend
    figure.suptitle("occult plan-cluster: projected MoE layer time (a model, not a measurement)", x=panels / 2, fontsize=10)
    figure.tight_layout(rect=(0, 0, panels, 1))
    figure.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(panels, 0.95))
    return figure


def plot_projections(cases: Sequence[tuple[str, Sequence[Projected]]], path: str, devices_per_node: int) -> None:
    """`projection_figure` as a PNG at `path`."""
    atomic_save_figure(projection_figure(cases, devices_per_node), path, dpi=100)


__all__ = ["TOLERANCE", "assumptions", "calibration_table", "detail_table", "method_styles", "plot_projections",
           "projection_figure", "summary_table", "validation_summary", "validation_table"]  # fmt: skip
