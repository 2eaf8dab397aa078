"""`occult report`: per-layer communication and balance of placements on a routing profile, with plots."""

from __future__ import annotations

import argparse
import dataclasses
import os

from ..placement import available_planners
from ..utils.arguments import non_negative_int, positive_int
from ..utils.checks import check_devices_per_node, did_you_mean
from .place import add_cross_validate_argument, add_option_argument, refuse_flag_options
from .devices import add_devices_per_node_argument, add_num_devices_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="per-layer CT, remote copies and load balance of placements, with PNG plots",
        description="Measure placements on a routing profile: per layer, mean CT and its bound, remote copies, "
        "split co-activation pairs, load balance against its floor and the slowest device. Placements come "
        "from files, or are planned here with --num-devices and --methods. (To see everything run end to end "
        "without a model download, try `occult demo`.)",
    )
    parser.add_argument("profile", nargs="?", help="routing profile (.safetensors from `occult profile`)")
    parser.add_argument("placements", nargs="*", help="occult_placement.json files to measure")
    add_num_devices_argument(parser, help="plan placements for D devices here")
    parser.add_argument(
        "--methods",
        default=",".join(available_planners()),
        help="comma-separated methods to plan with --num-devices (default: %(default)s)",
    )
    add_devices_per_node_argument(
        parser, help="devices G per node: plan node-aware here, and measure every placement on G-device nodes (CT_node, "
        "rows crossing nodes); a file's own layout is used otherwise",
    )  # fmt: skip
    parser.add_argument("--hidden-size", type=positive_int, help="the model's hidden size: also print the bytes per token crossing nodes")
    add_option_argument(parser)
    add_cross_validate_argument(parser, default=0)
    parser.add_argument("--plots", default="occult_report", help="directory for the PNG plots (default: occult_report)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.add_argument("--heatmap-layer", type=non_negative_int, help="layer of the co-activation heatmap")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..profile import RoutingProfile
    from ..report import check_heatmap_layer
    from . import check_output_dir

    if args.profile is None:
        raise SystemExit(
            "occult report: give a routing PROFILE (make one with `occult profile`); "
            "to see profile, placement and report run end to end on an embedded default, run `occult demo`"
        )
    if not args.placements and args.num_devices is None:
        raise SystemExit("occult report: give placement files, or --num-devices D to plan placements here")
    refuse_flag_options("report", dict(args.option))
    if args.devices_per_node is not None:  # against --num-devices here, against each file's D once it is read
        check_devices_per_node(args.devices_per_node, args.num_devices or args.devices_per_node, "--devices-per-node")
    if not args.no_plots:
        check_output_dir(args.plots, "--plots")
    profile = RoutingProfile.load(args.profile)
    check_heatmap_layer(profile, args.heatmap_layer, "--heatmap-layer")
    placements = load_placements(args.placements)
    if args.devices_per_node is not None:  # the planned ones record it themselves
        for placement in placements.values():
            placement.devices_per_node = check_devices_per_node(args.devices_per_node, placement.num_devices, "--devices-per-node")
    if args.num_devices is not None:
        planned = plan_methods(
            profile, args.num_devices, args.methods.split(","), dict(args.option), args.cross_validate, args.devices_per_node
        )
        for name, placement in planned.items():
            placements[_unique(name, placements)] = placement
    print_report(profile, placements, None if args.no_plots else args.plots, args.heatmap_layer, args.hidden_size)
    return 0


def load_placements(paths: list[str]) -> dict:
    """Placement files by a unique display name: their method, else their file name."""
    from ..placement import Placement

    named = {}
    for path in paths:
        placement = Placement.load(path)
        name = placement.meta.get("method") or os.path.splitext(os.path.basename(path))[0]
        named[_unique(name, named)] = placement
    return named


def _unique(name: str, taken: dict) -> str:
    """`name`, primed until no placement in `taken` has it (two files of one method stay apart)."""
    while name in taken:
        name = f"{name}'"
    return name


def plan_methods(
    profile, num_devices: int, methods: list[str], options: dict, cross_validate: int = 0, devices_per_node: int | None = None
) -> dict:
    """Plan with each method; `options` go to the methods that accept them; `cross_validate` K >= 2 adds
    each plan's expected held-out figures; `devices_per_node` plans node-aware where a method can."""
    from ..placement import get_planner, plan_placement

    valid = {method: {f.name for f in dataclasses.fields(get_planner(method).options_class)} for method in methods}
    unused = set(options) - set().union(*valid.values())
    if unused:
        hint = did_you_mean(sorted(unused), sorted(set().union(*valid.values())))
        raise SystemExit(f"occult report: no method in {methods} has option(s) {sorted(unused)}{hint}")
    return {
        method: plan_placement(
            profile, num_devices, method, cross_validate=cross_validate, devices_per_node=devices_per_node,
            **{k: v for k, v in options.items() if k in fields},
        )  # fmt: skip
        for method, fields in valid.items()
    }


def print_report(
    profile, placements: dict, plot_dir: str | None, heatmap_layer: int | None = None, hidden_size: int | None = None
) -> None:
    """Print the profile's description and the report, then (with `plot_dir`) write the plots: the table is out
    before a plot can fail."""
    from ..report import check_heatmap_layer, evaluate_placements, format_report, write_plots
    from .profile import describe_profile

    layer = check_heatmap_layer(profile, heatmap_layer, "--heatmap-layer")
    results = evaluate_placements(profile, placements)
    print(describe_profile(profile))
    print(format_report(profile, results, hidden_size))
    for path in [] if plot_dir is None else write_plots(profile, results, plot_dir, layer):
        print(f"wrote {path}")
