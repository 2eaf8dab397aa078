"""`occult plan-cluster`: the calibrated cost model (`occult_hf.scale`) of MoE layers and models from 8 to 256 GPUs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from . import check_output_dir
from .devices import add_devices_per_node_argument

DEFAULT_DEVICES = (8, 16, 32, 64, 128, 256)


def register(subparsers) -> None:
    from ..profile.replay import STUDY_TRACE
    from ..scale.methods import DEFAULT_METHODS

    parser = subparsers.add_parser(
        "plan-cluster",
        help="model (not measure) MoE layer and model time per method from 8 to 256 GPUs, calibrated on H200 runs",
        description="Predict an MoE layer's forward and forward+backward time, and a whole model's, for each dispatch "
        "(per_expert, dedup, hierarchical), placement (contiguous, occult, refined, node_refined) and node/device-limited "
        "pruning, against transformers' EP and FSDP2, at D GPUs of G per node. Calibrated on the H200 measurements "
        "shipped with the package (bench experts on one GPU, bench ep and bench paper on two; docs/scale.md); the "
        "routing of a trace is replayed at D (placements planned on its first half, measured on the second). "
        "--validate prints the calibration and its predictions of the measured two-GPU rows instead.",
    )
    parser.add_argument(
        "--case", action="append", metavar="MODEL=TRACE",
        help=f"a model (olmoe-1b-7b, qwen1.5-moe-a2.7b, deepseek-moe-16b, deepseek-v3) and the per-token routing trace "
        f"to replay (repeatable; default olmoe-1b-7b={STUDY_TRACE}, the study model's routing that ships in the "
        f"repository). A trace with E/m experts and the model's k is split into the model's E (deepseek-v3 from the "
        f"study trace: occult_hf.scale.synthetic)",
    )  # fmt: skip
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEFAULT_DEVICES), help="GPU counts D (default: %(default)s)")
    add_devices_per_node_argument(parser, help="GPUs G per node (default: 8)", default=8)
    parser.add_argument("--tokens-per-rank", type=int, nargs="+", default=[16384],
                        help="tokens T each GPU routes per layer; several: a table each (default: 16384)")  # fmt: skip
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="methods: <dispatch>+<placement>[+Nd=n][+Nn=n], transformers_ep, fsdp2 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--internode-gbs", type=float, default=50.0, help="inter-node GB/s per GPU (assumption; default: 50)")
    parser.add_argument("--internode-latency-us", type=float, default=10.0,
                        help="inter-node latency per message, us (assumption; default: 10)")  # fmt: skip
    parser.add_argument("--trace-layers", type=int, nargs="+", help="replay only these trace layers (default: all)")
    parser.add_argument(
        "--measurements", help="calibrate on a docs/ folder (its benchmark files) or a measurements JSON instead of the shipped one"
    )
    parser.add_argument("--validate", action="store_true", help="print the calibration and its predictions of the measured two-GPU rows")
    parser.add_argument("--out", help="also write plan_cluster.md/.json/.png (or plan_cluster_validation.md) here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..scale.calibration import calibrate
    from ..scale.cost import Cluster
    from ..scale.measurements import load_measurements

    if args.out is not None:
        check_output_dir(args.out)
    cluster = Cluster(args.devices_per_node, args.internode_gbs, args.internode_latency_us)
    measurements = load_measurements(args.measurements)
    calib = calibrate(measurements)
    if args.validate:
        text = _validation(calib, measurements)
        if args.out is not None:
            from ..utils.atomic import atomic_write_text

            os.makedirs(args.out, exist_ok=True)
            atomic_write_text(os.path.join(args.out, "plan_cluster_validation.md"), text + "\n")
    else:
        text = _projections(args, calib, cluster)
    print(text)
    return 0


def _validation(calib, measurements) -> str:
    from ..scale.report import calibration_table, validation_summary, validation_table
    from ..scale.validation import validate

    checked = validate(calib, measurements)
    return "\n\n".join([
        "## Calibration", calibration_table(calib), "## Predicted against measured (2 x H200, NVLink)",
        validation_summary(checked), validation_table(checked),
    ])  # fmt: skip


def default_trace() -> str:
    """The study model's trace (`profile.replay.STUDY_TRACE`): from the working directory, else from the
    source checkout this package runs from; a wheel does not hold it (the error says to give --case)."""
    from ..profile.replay import STUDY_TRACE

    checkout = Path(__file__).resolve().parents[3] / STUDY_TRACE
    if os.path.isfile(STUDY_TRACE) or not checkout.is_file():
        return STUDY_TRACE
    return str(checkout)


def _cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    cases = []
    for entry in args.case or [f"olmoe-1b-7b={default_trace()}"]:
        model, sep, trace = entry.partition("=")
        if not sep or not model or not trace:
            raise ValueError(f"--case {entry!r} must be MODEL=TRACE")
        cases.append((model, trace))
    return cases


def _projections(args: argparse.Namespace, calib, cluster) -> str:
    from ..scale.methods import parse_method
    from ..scale.projection import check_devices, project
    from ..scale.report import assumptions, detail_table, plot_projections, summary_table
    from ..scale.routing import fit_to_model, load_routing
    from ..scale.specs import model_spec

    for name in args.methods:
        parse_method(name)
    for count in args.devices:
        check_devices(count, cluster.devices_per_node)
    if min(args.tokens_per_rank) < 1:
        raise ValueError(f"--tokens-per-rank must be >= 1, got {args.tokens_per_rank}")
    cases = [(model_spec(model), trace) for model, trace in _cases(args)]
    parts, results = [assumptions(cluster)], []
    for spec, trace in cases:
        routing = fit_to_model(load_routing(trace), spec)
        if args.trace_layers is not None:
            routing = routing.select_layers(args.trace_layers)
        rows = project(calib, spec, routing, args.devices, args.methods, cluster, args.tokens_per_rank, progress=not args.no_progress)
        title = f"{spec.name}, routing {routing.source}"
        results.append((title, rows))
        parts.append(f"## {title}")
        for tokens in args.tokens_per_rank:
            parts += [f"MoE layer forward+backward at T = {tokens} tokens per GPU, ms (mean over the model's MoE layers; "
                      f"fastest in bold):", summary_table([r for r in rows if r.tokens == tokens])]  # fmt: skip
        parts.append(detail_table(rows))
    text = "\n\n".join(parts)
    if args.out is not None:
        _write(args.out, text, results, plot_projections)
    return text


def _write(out: str, text: str, results, plot) -> None:
    import dataclasses

    from ..utils.atomic import atomic_write_json, atomic_write_text

    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "plan_cluster.md"), text + "\n")
    atomic_write_json(os.path.join(out, "plan_cluster.json"),
                      {title: [dataclasses.asdict(row) for row in rows] for title, rows in results})  # fmt: skip
    plot(results, os.path.join(out, "plan_cluster.png"))
