"""`occult eval`: run the occult23 suite (or any lm-eval tasks) on an Occult model, or compare two runs.

    occult eval MODEL --placement placement.json --num-devices 8 --output-dir runs/pruned
    torchrun --nproc-per-node 8 --no-python occult eval MODEL --num-devices 8 --batch-size 8
    occult eval --compare runs/standard/results.json runs/pruned/results.json --labels standard pruned

A run writes `results.json` (lm-eval's result dict) and `results.md` (the headline table) into
`--output-dir` and prints the table; under torchrun only rank 0 writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from occult_hf.config import DISPATCH_MODES, PRUNE_MODES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate an Occult model with lm-eval (occult23 suite), or compare two result files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pretrained", nargs="?", help="model directory or hub id (not with --compare)")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two runs side by side with per-task deltas (B - A) and the average")
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), default=("A", "B"), help="column names for --compare")
    parser.add_argument("--tasks", default="occult23", help="'occult23' or comma-separated lm-eval task names (default: occult23)")
    occult = parser.add_argument_group("Occult settings (either --occult-config or the fields)")
    occult.add_argument("--occult-config", help="an OccultConfig JSON file")
    occult.add_argument("--placement", help="'contiguous' or an occult_placement.json")
    occult.add_argument("--num-devices", type=int, help="devices in the EP group (logical devices in one process)")
    occult.add_argument("--prune", choices=PRUNE_MODES, help="collaboration pruning mode")
    occult.add_argument("--max-devices-per-token", type=int, help="N_d for pruning")
    occult.add_argument("--profile", help="routing profile (.safetensors), for similarity pruning")
    occult.add_argument("--dispatch", choices=DISPATCH_MODES, help="EP dispatch mode")
    run = parser.add_argument_group("lm-eval settings")
    run.add_argument("--batch-size", default="1", help="an integer, or 'auto' in one process (default: 1)")
    run.add_argument("--device", default=None, help="e.g. cuda, cuda:0, cpu (default: cuda, one GPU per rank under torchrun)")
    run.add_argument("--dtype", default="auto", help="model dtype, e.g. bfloat16 (default: the checkpoint's)")
    run.add_argument("--limit", type=float, default=None, help="documents per task (testing only); < 1 means a fraction")
    run.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    run.add_argument("--bootstrap-iters", type=int, default=100000, help="bootstrap iterations for stderrs (0: none)")
    run.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")
    run.add_argument("--include-path", help="a folder of extra lm-eval task YAMLs")
    run.add_argument("--model-args", default="", help="more occult-hf/hf model_args as k=v,k=v")
    run.add_argument("--log-samples", action="store_true", help="also write every document's inputs and outputs")
    run.add_argument("--output-dir", default="occult_eval", help="where results.json and results.md go (default: occult_eval)")
    parser.set_defaults(func=main)


def _batch_size(value: str) -> int | str:
    if value.startswith("auto"):
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise SystemExit(f"occult eval: --batch-size must be a positive integer or 'auto', got {value!r}")
    return size


def _model_args(args: argparse.Namespace) -> dict:
    from lm_eval.utils import simple_parse_args_string

    flags = {
        "occult_config": args.occult_config,
        "placement": args.placement,
        "num_devices": args.num_devices,
        "prune": args.prune,
        "max_devices_per_token": args.max_devices_per_token,
        "profile": args.profile,
        "dispatch": args.dispatch,
        "dtype": args.dtype,
        "trust_remote_code": args.trust_remote_code or None,
    }
    model_args = {"pretrained": args.pretrained} | {k: v for k, v in flags.items() if v is not None}
    extra = simple_parse_args_string(args.model_args)
    clash = sorted(set(extra) & set(model_args))
    if clash:
        raise SystemExit(f"occult eval: {clash} given both as options and in --model-args; give each once")
    return model_args | extra


def _evaluate(args: argparse.Namespace) -> int:
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from occult_hf.eval import make_task_manager, markdown_table, parse_task_list

    results = lm_eval.simple_evaluate(
        model="occult-hf",
        model_args=_model_args(args),
        tasks=parse_task_list(args.tasks),
        batch_size=_batch_size(args.batch_size),
        device=args.device,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        bootstrap_iters=args.bootstrap_iters,
        log_samples=args.log_samples,
        task_manager=make_task_manager(args.include_path),
    )
    if results is None:  # ranks other than 0 under torchrun
        return 0
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None)
    for name, payload in (("results.json", results), ("samples.json", samples)):
        if payload is not None:
            text = json.dumps(payload, indent=2, default=handle_non_serializable, ensure_ascii=False)
            (output_dir / name).write_text(text + "\n")
    table = markdown_table(results)
    (output_dir / "results.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {output_dir / 'results.json'} and {output_dir / 'results.md'}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.compare:
        if args.pretrained:
            raise SystemExit("occult eval: give a model to evaluate or --compare A.json B.json, not both")
        from occult_hf.eval.report import compare_table, load_results

        path_a, path_b = args.compare
        print(compare_table(load_results(path_a), load_results(path_b), labels=tuple(args.labels)))
        return 0
    if not args.pretrained:
        raise SystemExit("occult eval: give a model directory or hub id, or --compare A.json B.json")
    return _evaluate(args)
