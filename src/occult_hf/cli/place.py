"""`occult place`: plan an expert placement from a routing profile and write occult_placement.json."""

from __future__ import annotations

import argparse
import json

from ..placement import PLACEMENT_FILENAME, available_planners
from .devices import add_num_devices_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "place",
        help="plan an expert placement from a routing profile",
        description="Plan, for every MoE layer of a routing profile, which device holds each expert, and write "
        "occult_placement.json. Prints the plan's CT, remote copies and load balance beside contiguous placement.",
    )
    parser.add_argument("profile", help="routing profile (.safetensors from `occult profile`)")
    add_num_devices_argument(parser, help="devices D in the expert-parallel group (required)")
    parser.add_argument(
        "--method", default="refined", choices=available_planners(), help="placement method (default: refined)"
    )
    add_option_argument(parser)
    parser.add_argument("--out", default=PLACEMENT_FILENAME, help=f"output path (default: {PLACEMENT_FILENAME})")
    parser.set_defaults(func=run)


def add_option_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="planner option, repeatable (e.g. max_load_ratio=1.05, seed=1 for refined); values are JSON "
        "(numbers, true/false, null) or plain strings",
    )


def parse_options(pairs: list[str]) -> dict:
    """`["max_load_ratio=1.05", "objective=ct"]` -> `{"max_load_ratio": 1.05, "objective": "ct"}`."""
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"occult: --option expects NAME=VALUE, got {pair!r}")
        try:
            options[name] = json.loads(text)
        except json.JSONDecodeError:
            options[name] = text
    return options


def run(args: argparse.Namespace) -> int:
    from ..placement import Placement, plan_placement
    from ..profile import RoutingProfile
    from ..report import evaluate_placements, format_summary

    if args.num_devices is None:
        raise SystemExit("occult place: --num-devices D is required (the devices of the expert-parallel group)")
    profile = RoutingProfile.load(args.profile)
    placement = plan_placement(profile, args.num_devices, args.method, **parse_options(args.option))
    placement.meta["profile"] = args.profile
    placement.save(args.out)
    named = {"contiguous": Placement.contiguous(profile.num_experts, args.num_devices, profile.layers)}
    named[args.method] = placement
    print(format_summary(evaluate_placements(profile, named)))
    print(f"wrote {args.out}")
    return 0
