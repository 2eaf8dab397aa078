"""`occult plan-cluster`: the calibrated cost model (`occult_hf.scale`) of MoE layers and models from 8 to 256 GPUs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..utils.arguments import non_negative_float, positive_float, positive_int
from . import check_output_dir, reader_gone
from .devices import add_devices_per_node_argument

DEFAULT_DEVICES = (8, 16, 32, 64, 128, 256)
#: the arguments only a projection reads (their parser default is None, so that --validate can refuse them) and
#: their defaults; --methods defaults to `scale.methods.DEFAULT_METHODS`, --case to the study trace
PROJECTION_DEFAULTS = {
    "case": None, "devices": list(DEFAULT_DEVICES), "devices_per_node": 8, "tokens_per_rank": [16384], "methods": None,
    "internode_gbs": 50.0, "internode_latency_us": 10.0, "trace_layers": None,
}  # fmt: skip
#: what --validate says when the measurements lack `bench paper`'s replayed splits (`scale.measurements`)
NO_SPLITS_NOTE = (
    "Note: these measurements hold no replayed splits (a docs/ folder has none; `python -m "
    "occult_hf.benchmarks.paper_replay DOCS_DIR` adds them to the measurements file it writes): every expert-parallel "
    "`bench paper` row is predicted with its pairs split evenly over its two ranks, so those rows' errors differ from "
    "the shipped measurements'."
)


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
        "routing of a trace is replayed at D (its tokens split into alternate 128-token windows: placements planned on "
        "one half, measured on the other). --validate prints the calibration and its predictions of the measured "
        "two-GPU rows instead (it takes no projection argument).",
    )
    parser.add_argument(
        "--case", action="append", metavar="MODEL=TRACE",
        help=f"a model (olmoe-1b-7b, qwen1.5-moe-a2.7b, deepseek-moe-16b, deepseek-v3) and the per-token routing trace "
        f"to replay (repeatable; default olmoe-1b-7b={STUDY_TRACE}, the study model's routing that ships in the "
        f"repository). A trace with E/m experts and the model's k is split into the model's E (deepseek-v3 from the "
        f"study trace: occult_hf.scale.synthetic)",
    )  # fmt: skip
    parser.add_argument("--devices", type=positive_int, nargs="+",
                        help=f"GPU counts D, each once (default: {' '.join(map(str, DEFAULT_DEVICES))})")  # fmt: skip
    add_devices_per_node_argument(parser, help="GPUs G per node (default: 8)")
    parser.add_argument("--tokens-per-rank", type=positive_int, nargs="+",
                        help="tokens T each GPU routes per layer; several: a table each (default: 16384)")  # fmt: skip
    parser.add_argument("--methods", nargs="+",
                        help=f"methods: <dispatch>+<placement>[+Nd=n][+Nn=n], transformers_ep, fsdp2; an N_d or N_n that "
                        f"prunes nothing at every D is refused (default: {' '.join(DEFAULT_METHODS)})")  # fmt: skip
    parser.add_argument("--internode-gbs", type=positive_float, help="inter-node GB/s per GPU (assumption; default: 50)")
    parser.add_argument("--internode-latency-us", type=non_negative_float,
                        help="inter-node latency per collective call that crosses nodes, us (assumption; default: 10)")  # fmt: skip
    parser.add_argument("--trace-layers", type=int, nargs="+", help="replay only these trace layers (default: all)")
    parser.add_argument(
        "--measurements",
        help="calibrate on a measurements JSON, or on a docs/ folder's benchmark files, instead of the shipped file "
        "(a docs/ folder lacks the replayed bench paper splits the shipped file holds: --validate's bench paper "
        "predictions then differ; the projections do not use them)",
    )
    parser.add_argument("--validate", action="store_true", help="print the calibration and its predictions of the measured two-GPU rows")
    parser.add_argument("--out", help="also write plan_cluster.md/.json/.png (or plan_cluster_validation.md) here, "
                        "after the tables are printed")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..scale.calibration import calibrate
    from ..scale.cost import Cluster
    from ..scale.measurements import load_measurements

    if args.out is not None:
        check_output_dir(args.out)
    if args.validate:
        _refuse_projection_arguments(args)
        measurements = load_measurements(args.measurements)
        text = _validation(calibrate(measurements), measurements)
        return _emit(text, args.out, lambda out: _write_validation(out, text))
    methods_given = args.methods is not None
    _fill_defaults(args)
    cluster = Cluster(args.devices_per_node, args.internode_gbs, args.internode_latency_us)
    cases = _load_cases(args, cluster, methods_given)
    text, results = _projections(args, calibrate(load_measurements(args.measurements)), cluster, cases)
    return _emit(text, args.out, lambda out: _write(out, text, results, cluster))


def _refuse_projection_arguments(args: argparse.Namespace) -> None:
    """--validate predicts the measured two-GPU rows: a projection argument beside it would be silently ignored."""
    given = [f"--{name.replace('_', '-')}" for name in PROJECTION_DEFAULTS if getattr(args, name) is not None]
    if given:
        raise ValueError(f"--validate takes no projection argument, got {', '.join(given)}: run the projection without --validate")


def _fill_defaults(args: argparse.Namespace) -> None:
    """The projection arguments not given, at their defaults (`PROJECTION_DEFAULTS`)."""
    from ..scale.methods import DEFAULT_METHODS

    defaults = {**PROJECTION_DEFAULTS, "methods": list(DEFAULT_METHODS)}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _emit(text: str, out: str | None, write) -> int:
    """Print `text`, then `write(out)` where --out is given: the tables reach the terminal even when a file cannot be
    written. A reader that closes the pipe early (`| head`) ends the printing quietly (`cli.reader_gone`), and the
    files are still written."""
    status = 0
    try:
        print(text, flush=True)
    except BrokenPipeError:
        status = reader_gone()
    if out is not None:
        write(out)
    return status


def _validation(calib, measurements) -> str:
    from ..scale.report import calibration_table, validation_summary, validation_table
    from ..scale.validation import validate

    checked = validate(calib, measurements)
    note = [] if "replayed_splits" in measurements else [NO_SPLITS_NOTE]
    return "\n\n".join([
        "## Calibration", calibration_table(calib), "## Predicted against measured (2 x H200, NVLink)", *note,
        validation_summary(checked), validation_table(checked),
    ])  # fmt: skip


def _write_validation(out: str, text: str) -> None:
    from ..utils.atomic import atomic_write_text

    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "plan_cluster_validation.md"), text + "\n")


def default_trace() -> str:
    """The study model's trace (`profile.replay.STUDY_TRACE`): from the working directory, else from the
    source checkout this package runs from; a wheel does not hold it (the error says to give --case)."""
    from ..profile.replay import STUDY_TRACE

    checkout = Path(__file__).resolve().parents[3] / STUDY_TRACE
    if os.path.isfile(STUDY_TRACE) or not checkout.is_file():
        return STUDY_TRACE
    return str(checkout)


def _cases(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """`(model, trace, name)` per --case: the name is the trace's file name, or the path as given where another case
    of the same model has a trace of that file name (each case's table, panel and JSON key must differ); the same
    model and file twice is refused."""
    if args.case is None:
        trace = default_trace()
        if not os.path.isfile(trace):
            raise FileNotFoundError(
                f"the default routing trace {trace!r} is not found (it ships in the repository's docs/, not in the "
                f"wheel): give a per-token trace with --case MODEL=TRACE"
            )
        return [("olmoe-1b-7b", trace, os.path.basename(trace))]
    cases, seen = [], {}
    for entry in args.case:
        model, sep, trace = entry.partition("=")
        if not sep or not model or not trace:
            raise ValueError(f"--case {entry!r} must be MODEL=TRACE")
        key = (model, os.path.realpath(trace))
        if key in seen:
            raise ValueError(f"--case {entry!r} repeats --case {seen[key]!r} (the same model and trace file)")
        seen[key] = entry
        cases.append((model, trace))
    named = [(model, os.path.basename(trace)) for model, trace in cases]
    return [(model, trace, trace if named.count((model, os.path.basename(trace))) > 1 else os.path.basename(trace))
            for model, trace in cases]  # fmt: skip


def _check_distinct(flag: str, values: list) -> None:
    """A value given twice would print its rows twice (and JSON-merge them): refused."""
    repeated = sorted({value for value in values if values.count(value) > 1}, key=values.index)
    if repeated:
        raise ValueError(f"{flag} repeats {', '.join(map(str, repeated))}: give each once")


def _load_cases(args: argparse.Namespace, cluster, methods_given: bool) -> list:
    """`(spec, routing)` per case, every argument and trace checked (loaded, fitted to its model, its layers and
    halves checked) before the first projection, which can take minutes."""
    from ..scale.methods import parse_method
    from ..scale.projection import check_devices
    from ..scale.routing import fit_to_model, load_routing
    from ..scale.specs import model_spec

    methods = [parse_method(name) for name in args.methods]
    for flag, values in (("--devices", args.devices), ("--tokens-per-rank", args.tokens_per_rank), ("--methods", args.methods)):
        _check_distinct(flag, values)
    for count in args.devices:
        check_devices(count, cluster.devices_per_node)
    specs = [(model_spec(model), trace, name) for model, trace, name in _cases(args)]
    if methods_given:
        _refuse_idle_limits(methods, [spec for spec, _, _ in specs], args.devices, cluster.devices_per_node)
    cases = []
    for spec, trace, name in specs:
        routing = fit_to_model(load_routing(trace, name), spec)
        if args.trace_layers is not None:
            routing = routing.select_layers(args.trace_layers)
        routing.check_halves()
        cases.append((spec, routing))
    return cases


def _refuse_idle_limits(methods, specs, devices, devices_per_node) -> None:
    """An N_d / N_n that prunes nothing at every D of every case (`projection.idle_limits`): the user asked for
    pruning the run would not do."""
    from ..scale.projection import ep_group_size, idle_limits

    for method in methods:
        idle = [idle_limits(method, ep_group_size(count, spec.num_experts, devices_per_node), devices_per_node, spec.top_k)
                for spec in specs for count in devices]  # fmt: skip
        for name in ("N_d", "N_n"):
            if idle and all(name in found for found in idle):
                raise ValueError(
                    f"--methods {method.name}: {name} prunes nothing at any --devices (at D={devices[-1]}: "
                    f"{idle[-1][name]}, the most a token reaches); give a smaller {name}"
                )


def _projections(args: argparse.Namespace, calib, cluster, cases) -> tuple[str, list]:
    from ..scale.projection import project
    from ..scale.report import assumptions, detail_table, summary_table

    parts, results = [assumptions(cluster)], []
    for spec, routing in cases:
        rows = project(calib, spec, routing, args.devices, args.methods, cluster, args.tokens_per_rank, progress=not args.no_progress)
        title = f"{spec.name}, routing {routing.source}"
        results.append((title, rows))
        parts.append(f"## {title}")
        for tokens in args.tokens_per_rank:
            parts += [f"MoE layer forward+backward at T = {tokens} tokens per GPU, ms (mean over the model's MoE layers; "
                      f"fastest in bold):", summary_table([r for r in rows if r.tokens == tokens])]  # fmt: skip
        parts.append(detail_table(rows))
    return "\n\n".join(parts), results


def _write(out: str, text: str, results, cluster) -> None:
    import dataclasses

    from ..scale.report import plot_projections
    from ..utils.atomic import atomic_write_json, atomic_write_text

    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "plan_cluster.md"), text + "\n")
    atomic_write_json(os.path.join(out, "plan_cluster.json"),
                      {title: [dataclasses.asdict(row) for row in rows] for title, rows in results})  # fmt: skip
    plot_projections(results, os.path.join(out, "plan_cluster.png"), cluster.devices_per_node)
