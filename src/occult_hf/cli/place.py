"""`occult place`: plan an expert placement from a routing profile and write occult_placement.json."""

from __future__ import annotations

import argparse
import os

from ..placement import PLACEMENT_FILENAME, available_planners
from ..utils.atomic import check_writable_dir
from ..utils.checks import check_devices_per_node, ends_with_separator
from ..utils.strict_json import parse_json
from . import check_output_is_not_an_input
from .devices import add_devices_per_node_argument, add_num_devices_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "place",
        help="plan an expert placement from a routing profile",
        description="Plan, for every MoE layer of a routing profile, which device holds each expert, and write "
        "occult_placement.json. Prints the plan's CT, remote copies and load balance beside contiguous placement.",
    )
    parser.add_argument(
        "profile",
        nargs="+",
        help="routing profile (.safetensors from `occult profile`); several (domains, prefill and decode, before "
        "and after a fine-tune) are pooled for CT and refined holds its load limit on each of them",
    )
    add_num_devices_argument(parser, help="devices D in the expert-parallel group (required)")
    add_devices_per_node_argument(
        parser, help="devices G per node of the cluster (dividing D): plan node-aware, the nodes per token (CT_node) "
        "first, then CT within the nodes (refined), and record the layout in the file (default: one node)",
    )  # fmt: skip
    parser.add_argument(
        "--method", default="refined", choices=available_planners(), help="placement method (default: refined)"
    )
    add_option_argument(parser)
    add_cross_validate_argument(parser, default=2)
    parser.add_argument("--out", default=PLACEMENT_FILENAME, help=f"output path (default: {PLACEMENT_FILENAME})")
    parser.set_defaults(func=run)


def add_option_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        type=planner_option,
        metavar="NAME=VALUE",
        help="planner option, repeatable (e.g. max_load_ratio=1.05, seed=1 for refined); values are JSON "
        "(numbers, true/false, null) or plain strings",
    )


def add_cross_validate_argument(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument(
        "--cross-validate",
        type=cross_validate_folds,
        default=default,
        metavar="K",
        help=f"estimate held-out CT and balance by K-fold cross-validation on the profile's token sample, "
        f"K >= 2 (re-plans K times); 0 skips (default: {default})",
    )


def cross_validate_folds(text: str) -> int:
    """argparse type of `--cross-validate`: 0 or K >= 2, checked at parse time (the planner checks K only after the
    plan)."""
    try:
        folds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 or an integer >= 2, got {text!r}") from None
    if folds < 0 or folds == 1:
        raise argparse.ArgumentTypeError(f"expected 0 or an integer >= 2, got {folds}")
    return folds


def placement_output(path: str) -> str:
    """The file `--out` names, checked before planning (a missing directory fails at once, not after the plan): a
    directory gets `occult_placement.json` inside it, as `Placement.save` writes it; a path ending in a separator
    names a directory, which must exist."""
    if os.path.isdir(path):
        path = os.path.join(path, PLACEMENT_FILENAME)
    elif ends_with_separator(path):
        raise FileNotFoundError(f"--out {path!r}: directory {path!r} does not exist")
    return check_writable_dir(path, "--out")


#: the longest `--option NAME=VALUE` (numbers, words such as "auto"); longer is a usage error, not a long error message
MAX_OPTION_CHARS = 200


def planner_option(pair: str) -> tuple[str, object]:
    """argparse type of `--option`: `"max_load_ratio=1.05"` -> `("max_load_ratio", 1.05)` (JSON, else the text).
    Checked at parse time, so a malformed pair is reported as the subcommand's usage error."""
    if len(pair) > MAX_OPTION_CHARS:  # no planner option is that long; a planner's error would quote it whole
        raise argparse.ArgumentTypeError(f"{pair[:40]!r}... has {len(pair)} characters, more than the {MAX_OPTION_CHARS} of any NAME=VALUE")
    name, sep, text = pair.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {pair!r}")
    try:
        return name, parse_json(text, f"--option {name}")
    except ValueError:  # not JSON (or NaN, Infinity): the plain string, which the planner's option checks judge
        return name, text


#: `plan_placement`'s own settings, flags of the commands that plan: given as `--option` too, they would reach it twice
PLANNING_FLAGS = {"cross_validate": "--cross-validate", "devices_per_node": "--devices-per-node"}


def refuse_flag_options(command: str, options: dict, flags: dict[str, str] = PLANNING_FLAGS) -> None:
    """An error naming the flag to use for each `--option NAME=VALUE` that sets one of `flags` (Python's "got
    multiple values" error otherwise, after the profile loaded)."""
    flagged = sorted(name for name in options if name in flags)
    if flagged:
        raise SystemExit(f"occult {command}: give {', '.join(f'{name} as {flags[name]}' for name in flagged)}, not as --option")


def planner_options(method: str, options: dict) -> dict:
    """`options` (the `--option NAME=VALUE` pairs) if `method`'s planner takes them all, checked before any planning;
    else an error naming the flag to use or the planner's options (`layers`, `progress`: not options)."""
    from ..placement import get_planner

    refuse_flag_options("place", options, {"method": "--method", **PLANNING_FLAGS})
    get_planner(method).make_options(**options)  # a ValueError naming the planner's options
    return options


def run(args: argparse.Namespace) -> int:
    from ..placement import Placement, plan_placement, pool_profiles
    from ..profile import RoutingProfile
    from ..report import evaluate_placements, format_node_table, format_promises, format_summary

    if args.num_devices is None:
        raise SystemExit("occult place: --num-devices D is required (the devices of the expert-parallel group)")
    if args.devices_per_node is not None:
        check_devices_per_node(args.devices_per_node, args.num_devices, "--devices-per-node")
    out = placement_output(args.out)
    check_output_is_not_an_input("place", out, [("PROFILE", path) for path in args.profile])
    options = planner_options(args.method, dict(args.option))

    profiles = {path: RoutingProfile.load(path) for path in args.profile}
    source = next(iter(profiles.values())) if len(profiles) == 1 else profiles
    placement = plan_placement(
        source, args.num_devices, args.method, cross_validate=args.cross_validate, devices_per_node=args.devices_per_node,
        **options,
    )  # fmt: skip
    placement.meta["profile"] = args.profile[0] if len(args.profile) == 1 else list(args.profile)
    placement.save(out)
    pooled = pool_profiles(source)[0]
    named = {"contiguous": Placement.contiguous(pooled.num_experts, args.num_devices, sorted(placement.layers))}
    named["contiguous"].devices_per_node = args.devices_per_node
    named[args.method] = placement
    results = evaluate_placements(pooled, named)
    parts = (format_summary(results), format_node_table(pooled, results), format_promises(results))  # the last two may be empty
    print("\n".join(part for part in parts if part))
    print(f"wrote {out}")
    return 0
