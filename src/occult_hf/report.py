"""What a placement does to communication and balance, as a table and PNG plots.

`evaluate_placements` measures named placements on a routing profile (through
`occult_hf.metrics.evaluate_placement`); `format_table` prints, as a markdown table, one row per (layer, placement)
with CT and its bounds, remote copies, load balance against its floor and the slowest device,
then the means over layers; `format_node_table` adds, for placements that state their devices per node,
CT_node, CT and the rows (and, given the hidden size, bytes) per token crossing nodes under the flat and
the hierarchical exchange; `plot_cost_by_layer` and `plot_coactivation` draw the per-layer cost
by method and the co-activation matrix in each placement's device order.

Shape legend: E routed experts, D devices.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass

import numpy as np

from .utils.atomic import atomic_save_figure
from .utils.checks import shown
from .utils.tables import markdown_table, number_cell
from .metrics import LayerMetrics, evaluate_placement, summarize
from .placement import Placement
from .profile import RoutingProfile


@dataclass(frozen=True)
class PlacementResult:
    """One named placement measured on one profile."""

    name: str
    placement: Placement
    per_layer: dict[int, LayerMetrics]

    @property
    def summary(self) -> dict[str, float | None]:
        return summarize(self.per_layer)


def evaluate_placements(profile: RoutingProfile, placements: dict[str, Placement]) -> list[PlacementResult]:
    """Measure each named placement on `profile` (its sample when it has one, else its pair counts); each must
    name exactly the profile's layers."""
    if not placements:
        raise ValueError("evaluate_placements needs at least one placement")
    for placement in placements.values():  # a layer the profile lacks would be reported on nothing
        placement.validate_for(profile.num_experts, profile.layers, exact=True, against="the routing profile")
    return [PlacementResult(name, p, evaluate_placement(profile, p)) for name, p in placements.items()]


# ----- table -----------------------------------------------------------------------------------
_HEADERS = ("layer", "placement", "D", "CT", "bound", "remote", "cut/tok", "balance", "floor", "slowest", "max recv")
#: numbers right, the placement's name left
_ALIGN = "rl" + "r" * (len(_HEADERS) - 2)


def format_table(profile: RoutingProfile, results: list[PlacementResult]) -> str:
    """Per-layer rows for every placement, then the means over layers (rows `mean`), as a markdown table.

    Columns: CT (mean devices per token, on the profile's token sample; "-" without one), its
    bound `lower-upper` for the placement's capacities, remote copies per token (tokens on ranks in
    contiguous chunks), split co-activation pairs per token, load balance (max/mean device load)
    and its floor (the best any placement with these capacities can do), the slowest device as
    `d<id>` with its load over the mean, and the rows the busiest receiving rank gets.
    """
    rows = []
    for layer in sorted(profile.layers):
        for result in results:
            m = result.per_layer[layer]
            rows.append([
                layer, result.name, result.placement.num_devices, number_cell(m.ct), f"{m.ct_lower}-{m.ct_upper}",
                number_cell(m.remote_copies), number_cell(m.cut_per_token), number_cell(m.balance), number_cell(m.balance_floor),
                f"d{m.slowest_device} {m.load_D[m.slowest_device] / m.load_D.mean():.2f}",
                "-" if m.max_received_rows is None else m.max_received_rows,
            ])  # fmt: skip
    return markdown_table(_HEADERS, rows + _summary_rows(results), align=_ALIGN)


def format_summary(results: list[PlacementResult]) -> str:
    """The table's rows of means over layers (one per placement), as a markdown table."""
    return markdown_table(_HEADERS, _summary_rows(results), align=_ALIGN)


def _summary_rows(results: list[PlacementResult]) -> list[list]:
    """Means over layers; the slowest column holds the worst layer's balance."""
    rows = []
    for result in results:
        s = result.summary
        rows.append([
            "mean", result.name, result.placement.num_devices, number_cell(s["ct"]), number_cell(s["ct_lower"], 1),
            number_cell(s["remote_copies"]), number_cell(s["cut_per_token"]), number_cell(s["balance"]), number_cell(s["balance_floor"]),
            f"worst {s['worst_balance']:.2f}", "-" if s["max_received_rows"] is None else int(s["max_received_rows"]),
        ])  # fmt: skip
    return rows


def bf16_row_bytes(hidden_size: int, top_k: int) -> int:
    """Bytes of one dispatched bf16 row on the wire (`dispatch.base.dispatch_format`: activations, k int32 slots,
    k bf16 routing weights); the hierarchical exchange's node copies have the same form."""
    import torch

    from .dispatch.base import dispatch_format

    return dispatch_format(hidden_size, torch.bfloat16, top_k, torch.bfloat16).row_bytes


def format_node_table(profile: RoutingProfile, results: list[PlacementResult], hidden_size: int | None = None) -> str:
    """What crosses nodes, per layer and placement (those that state `devices_per_node`), then the means: CT_node
    (distinct nodes per token), CT, and per token and direction the rows that cross nodes when each (token, device)
    row is sent directly ("flat") and when one copy per (token, node) crosses and is forwarded inside the node
    ("hier."), with their bytes when `hidden_size` is given (bf16 rows, `bf16_row_bytes`). Empty when no placement
    states a node layout or the profile has no token sample."""
    noded = [r for r in results if r.placement.devices_per_node is not None]
    if not noded or not profile.has_samples:
        return ""
    size = None if hidden_size is None else bf16_row_bytes(hidden_size, profile.top_k)
    header = ["layer", "placement", "D", "G", "CT_node", "CT", "x-node rows flat", "x-node rows hier."]
    if size is not None:
        header += ["x-node bytes flat", "x-node bytes hier."]

    def cells(label, result, ct_node, ct, flat, hier):
        row = [label, result.name, result.placement.num_devices, result.placement.devices_per_node,
               number_cell(ct_node), number_cell(ct), number_cell(flat), number_cell(hier)]  # fmt: skip
        if size is not None:
            row += [f"{flat * size:,.0f}", f"{hier * size:,.0f}"]
        return row

    rows = []
    for layer in sorted(profile.layers):
        for result in noded:
            m = result.per_layer[layer]
            rows.append(cells(layer, result, m.nodes.ct_node_mean, m.ct, m.nodes.cross_rows_flat, m.nodes.cross_rows_hierarchical))
    for result in noded:
        s = result.summary
        rows.append(cells("mean", result, s["ct_node"], s["ct"], s["cross_rows_flat"], s["cross_rows_hierarchical"]))
    lines = [markdown_table(header, rows, align="rl" + "r" * (len(header) - 2))]
    if size is not None:
        lines.append(f"(bytes: rows of {size} B: hidden {hidden_size} in bf16, {profile.top_k} int32 slots and bf16 weights)")
    return "\n".join(lines)


def format_promises(results: list[PlacementResult]) -> str:
    """What each placement's planner promised beyond its profile, from its meta: the expected held-out
    figures by cross-validation, the worst of several profiles, and the replicas. Empty when none.

    A placement's meta is free-form (docs/design.md §6): an entry not in the form the planners write (a hand edit,
    another tool) is named in a line of its own instead of ending the report whose table is already measured."""
    lines = []
    for result in results:
        meta = result.placement.meta
        for key, describe in (("expected_held_out", _held_out_line), ("worst_profile", _worst_profile_line)):
            if meta.get(key):
                lines.append(f"{result.name}: {_meta_line(key, meta, describe)}")
        if result.placement.has_replicas:
            lines.append(f"{result.name}: {_replicas_line(result.placement)}")
    return "\n".join(lines)


def _meta_line(key: str, meta: dict, describe) -> str:
    """`describe(meta)`, or a line naming the meta entry `key` and why it cannot be read."""
    try:
        return describe(meta)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        return f"meta {key!r} is not in the form the planners write ({type(error).__name__}: {error}); not shown"


def _held_out_line(meta: dict) -> str:
    """The cross-validation estimate `placement.validation.run_cross_validation` writes (or why it was skipped)."""
    expected = meta["expected_held_out"]
    if "skipped" in expected:
        return f"no held-out estimate ({expected['skipped']})"
    m = expected["mean"]
    return (
        f"expected held-out ({expected['folds']}-fold cross-validation on its profile, mean over layers): CT "
        f"{number_cell(m['ct'])}, balance {number_cell(m['balance'])} (worst fold and layer "
        f"{number_cell(m['balance_worst'])}; held-out floor {number_cell(m['balance_floor'])})"
    )


def _worst_profile_line(meta: dict) -> str:
    """Each layer's worst profile and its balance, as `placement.registry` writes them for several profiles."""
    cells = ", ".join(f"layer {l} {w['profile']} {float(w['balance']):.2f}" for l, w in meta["worst_profile"].items())
    return f"worst of {len(meta.get('profiles', []))} profiles: {cells}"


def _replicas_line(placement: Placement) -> str:
    extra = {l: sum(len(d) for d in r.values()) for l, r in placement.replicas.items()}
    return (
        f"replicas in {len(extra)} layers ({min(extra.values())}-{max(extra.values())} extra homes per layer), "
        f"{placement.slots_per_device or '-'} slots per device"
    )


# ----- plots -----------------------------------------------------------------------------------
def _figure(width: float, height: float):
    """A matplotlib Figure without pyplot (no global backend or state is touched)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def plot_cost_by_layer(profile: RoutingProfile, results: list[PlacementResult], path: str | os.PathLike) -> str:
    """Two panels over layers: CT by placement with the CT lower bound (split pairs per token when the
    profile has no token sample), and load balance by placement with its floor. Returns the path."""
    from matplotlib.ticker import MaxNLocator

    layers = sorted(profile.layers)
    fig = _figure(max(6.0, 0.25 * len(layers) + 4), 6.5)
    cost_axes, balance_axes = fig.subplots(2, 1, sharex=True)
    use_ct = profile.has_samples
    for result in results:
        metrics = [result.per_layer[l] for l in layers]
        cost = [m.ct if use_ct else m.cut_per_token for m in metrics]
        cost_axes.plot(layers, cost, marker="o", markersize=3, label=result.name)
        balance_axes.plot(layers, [m.balance for m in metrics], marker="o", markersize=3, label=result.name)
    first = [results[0].per_layer[l] for l in layers]
    if use_ct:
        cost_axes.plot(layers, [m.ct_lower for m in first], "k--", linewidth=1, label="CT lower bound")
    balance_axes.plot(layers, [m.balance_floor for m in first], "k--", linewidth=1, label="balance floor")
    cost_axes.set_ylabel("mean CT (devices per token)" if use_ct else "split co-activation pairs per token")
    balance_axes.set_ylabel("load balance (max / mean)")
    balance_axes.set_xlabel("MoE layer")
    balance_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    devices = sorted({r.placement.num_devices for r in results})
    source = textwrap.shorten(str(profile.meta.get("source") or "routing profile"), width=70, placeholder="...")
    cost_axes.set_title(
        f"{source}\nE={profile.num_experts}, k={profile.top_k}, D={','.join(map(str, devices))}", fontsize=9
    )
    for axes in (cost_axes, balance_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    atomic_save_figure(fig, path, dpi=110)
    return os.fspath(path)


def plot_coactivation(
    profile: RoutingProfile, results: list[PlacementResult], layer: int, path: str | os.PathLike
) -> str:
    """Co-activation per token at `layer`, experts ordered by device (then id) for each placement,
    with device blocks outlined: mass inside the blocks stays on one device. Returns the path."""
    from matplotlib.patches import Rectangle

    routing = profile.layer(layer)
    coactivation_EE = routing.coactivation / max(routing.token_count, 1)
    fig = _figure(3.4 * len(results) + 0.8, 3.7)
    axes_list = np.atleast_1d(fig.subplots(1, len(results)))
    vmax = float(coactivation_EE.max()) or 1.0
    for axes, result in zip(axes_list, results):
        device_of_E = np.asarray(result.placement.device_of(layer))
        order_E = np.lexsort((np.arange(len(device_of_E)), device_of_E))
        image = axes.imshow(coactivation_EE[np.ix_(order_E, order_E)], cmap="viridis", vmin=0, vmax=vmax)
        edges = np.cumsum(np.bincount(device_of_E, minlength=result.placement.num_devices))[:-1] - 0.5
        bounds = [-0.5, *edges, len(device_of_E) - 0.5]
        for start, end in zip(bounds, bounds[1:]):
            axes.add_patch(Rectangle((start, start), end - start, end - start, fill=False, edgecolor="white", linewidth=1.2))
        m = result.per_layer[layer]
        axes.set_title(f"{result.name}: intra-device {m.intra_device_ratio:.0%}", fontsize=9)
        axes.set_xticks([])
        axes.set_yticks([])
        axes.set_xlabel("experts by device")
    fig.colorbar(image, ax=list(axes_list), shrink=0.8, label="co-activations per token")
    fig.suptitle(f"layer {layer} co-activation ordered by placement", fontsize=10)
    atomic_save_figure(fig, path, dpi=110)
    return os.fspath(path)


def check_heatmap_layer(profile: RoutingProfile, layer: int | None, setting: str = "heatmap_layer") -> int:
    """The heatmap's layer (default: the profile's first), or raise naming `setting` when the profile lacks it: checked
    before the placements are measured, not after the first plot is written."""
    if layer is None:
        return min(profile.layers)
    if layer not in profile.layers:
        raise ValueError(
            f"{setting} {layer} is not a layer of the routing profile (it has {shown(sorted(profile.layers))})"
        )
    return int(layer)


def format_report(profile: RoutingProfile, results: list[PlacementResult], hidden_size: int | None = None) -> str:
    """The table, then the node table (`format_node_table`) and the plans' promises (`format_promises`) where they
    have rows."""
    parts = (format_table(profile, results), format_node_table(profile, results, hidden_size), format_promises(results))
    return "\n".join(part for part in parts if part)


def write_plots(
    profile: RoutingProfile, results: list[PlacementResult], plot_dir: str | os.PathLike, layer: int
) -> list[str]:
    """Both plots in `plot_dir` (made if missing), the heatmap at `layer`. Returns their paths."""
    os.makedirs(plot_dir, exist_ok=True)
    return [
        plot_cost_by_layer(profile, results, os.path.join(plot_dir, "ct_by_layer.png")),
        plot_coactivation(profile, results, layer, os.path.join(plot_dir, f"coactivation_layer{layer}.png")),
    ]


__all__ = [
    "PlacementResult",
    "evaluate_placements",
    "format_node_table",
    "format_promises",
    "format_summary",
    "format_table",
    "plot_cost_by_layer",
    "bf16_row_bytes",
    "check_heatmap_layer",
    "format_report",
    "plot_coactivation",
    "write_plots",
]
