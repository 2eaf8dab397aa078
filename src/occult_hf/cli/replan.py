"""`occult replan`: re-choose a deployed placement's replicas from recent routing, primaries kept."""

from __future__ import annotations

import argparse

from ..placement import PLACEMENT_FILENAME
from ..registry import REPLICA_CHOICES
from ..utils.arguments import non_negative_int


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "replan",
        help="re-choose a placement's replicated experts from recent routing (primary homes kept)",
        description="Keep every expert's primary device and re-choose only the redundant copies (the replicas) "
        "from a recent routing profile, e.g. the one OccultCallback saves with each checkpoint: at most R expert "
        "copies move, where a full re-plan would move most experts. Prints the deployed and the re-planned "
        "placement measured on the recent profile.",
    )
    parser.add_argument("placement", help="the deployed placement (occult_placement.json)")
    parser.add_argument("profile", help="recent routing profile (.safetensors from `occult profile` or the callback)")
    parser.add_argument(
        "--redundant",
        type=non_negative_int,
        metavar="R",
        help="extra homes per layer (default: as many as the placement has, or its free slots when it has none)",
    )
    parser.add_argument(
        "--replica-choice",
        choices=REPLICA_CHOICES,
        default="static",
        help="the runtime's replica rule (OccultConfig.replica_choice) the copies are chosen for: static balances the "
        "loads that rule gives; load_aware the best split of the copies' loads, then the least CT (default: static)",
    )
    parser.add_argument("--out", default=PLACEMENT_FILENAME, help=f"output path (default: {PLACEMENT_FILENAME})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..placement import Placement
    from ..placement.rebalance import replan_replicas
    from ..profile import RoutingProfile
    from ..report import evaluate_placements, format_summary
    from ..utils.checks import shown
    from . import check_output_is_not_an_input
    from .place import placement_output

    out = placement_output(args.out)
    check_output_is_not_an_input("replan", out, [("PROFILE", args.profile)])  # over PLACEMENT: the documented use
    deployed, recent = Placement.load(args.placement), RoutingProfile.load(args.profile)
    replanned = replan_replicas(deployed, recent, num_redundant=args.redundant, replica_choice=args.replica_choice)
    replanned.save(out)
    print(format_summary(evaluate_placements(recent, {"deployed": deployed, "replanned": replanned})))
    kept = replanned.meta["replicas_kept_in_layers"]
    if replanned.replicas == deployed.replicas:
        print("(the replicas are unchanged: the deployed ones are still the best choice, or the placement has no slot "
              "for a replica; --redundant N asks for N per layer)")
    elif kept:
        print(f"(layers {shown(kept)} keep their deployed replicas: the re-plan found none that balance this profile better)")
    if args.replica_choice == "load_aware":  # the metrics route pairs by the static rule; the runtime will split by load
        print("(both measured under the static replica rule; the copies were chosen for the load-aware rule, which "
              "splits a replicated expert's pairs by each batch's loads: their balance under it is not shown here)")
    print(f"wrote {out}")
    return 0
