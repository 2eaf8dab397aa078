"""`occult eval`: run the occult23 suite (or any lm-eval tasks) on an Occult model, or compare two runs.

    occult eval MODEL --placement placement.json --num-devices 8 --output_path runs/pruned
    torchrun --nproc-per-node 8 --no-python occult eval MODEL --num-devices 8 --batch_size 8
    occult eval --headline runs/pruned
    occult eval --compare runs/standard runs/pruned --labels standard pruned

lm-eval's flags keep lm-eval's spellings (`--output_path`, `--batch_size`, `--model_args`,
`--num_fewshot`, `--bootstrap_iters`, `--include_path`, `--log_samples`, `--trust_remote_code`;
the dashed spellings are aliases, as `HfArgumentParser` accepts both), and a run writes lm-eval's output layout:
`<output_path>/<model name>/results_<time>.json` (and `samples_<task>_<time>.jsonl` with
`--log_samples`), then prints lm-eval's `make_table` and, for an occult23 run, the headline rows (the
paper's table, also lm-eval's `make_table`, and their mean). Under torchrun only rank 0 writes.
`--output_path` is checked before the evaluation starts (a folder, made if missing, that a file can be written
in), and a results file lm-eval did not write is an error after the tables.
`--headline RESULTS` prints the headline rows of a finished occult23 run and `--compare A B` two runs
side by side (the headline rows of two occult23 runs, else every metric), each from a
`results_*.json` or an `--output_path` folder (its newest `results_*.json`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from occult_hf.registry import DISPATCH_MODES
from occult_hf.pruning import pruning_policy_names
from ..utils.arguments import torch_dtype_name
from .devices import add_num_devices_argument, resolve_device


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate an Occult model with lm-eval (occult23 suite), or compare two result files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pretrained", nargs="?", help="model directory or hub id (default: the shipped tiny OLMoE; not with --compare / --headline)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="print two runs side by side with deltas (B - A): occult23's headline rows and their average, else every metric; each a results_*.json or an --output_path folder")
    parser.add_argument("--headline", metavar="RESULTS", help="print an occult23 run's headline rows (lm-eval's make_table) and their mean; a results_*.json or an --output_path folder")
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), default=("A", "B"), help="column names for --compare")
    parser.add_argument("--tasks", default="occult23", help="'occult23', 'occult_offline' (no download) or comma-separated lm-eval task names (default: occult23)")
    occult = parser.add_argument_group("Occult settings (either --occult-config or the fields)")
    occult.add_argument("--occult-config", help="an OccultConfig JSON file")
    occult.add_argument("--placement", help="'contiguous' or an occult_placement.json")
    add_num_devices_argument(occult, help="devices in the EP group (logical devices in one process)")
    occult.add_argument("--prune", choices=pruning_policy_names(), help="collaboration pruning mode")
    occult.add_argument("--max-devices-per-token", type=int, help="N_d for pruning")
    occult.add_argument("--profile", help="routing profile (.safetensors), for similarity pruning")
    occult.add_argument("--dispatch", choices=DISPATCH_MODES, help="EP dispatch mode")
    run = parser.add_argument_group("lm-eval settings")
    run.add_argument("--batch_size", "--batch-size", dest="batch_size", default="1", help="an integer, or 'auto' in one process (default: 1)")
    run.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cuda, cuda:0 or cpu (default: auto; one GPU per rank under torchrun)")
    run.add_argument("--dtype", type=torch_dtype_name, help="model dtype, e.g. bfloat16 (default: the model's `dtype` in --model_args, else auto: the checkpoint's)")
    run.add_argument("--limit", type=float, help="documents per task (testing only); < 1 means a fraction")
    run.add_argument("--num_fewshot", "--num-fewshot", dest="num_fewshot", type=int, help="few-shot examples (default: each task's own)")
    run.add_argument("--bootstrap_iters", "--bootstrap-iters", dest="bootstrap_iters", type=int, default=100000, help="bootstrap iterations for stderrs (0: none)")
    run.add_argument("--trust_remote_code", "--trust-remote-code", dest="trust_remote_code", action="store_true", help="allow the checkpoint's own modelling code")
    run.add_argument("--include_path", "--include-path", dest="include_path", help="a folder of extra lm-eval task YAMLs")
    run.add_argument("--model_args", "--model-args", dest="model_args", default="", help="more occult-hf/hf model_args as k=v,k=v")
    run.add_argument("--log_samples", "--log-samples", dest="log_samples", action="store_true", help="also write every document's inputs and outputs")
    run.add_argument(
        "--output_path", dest="output_path", default="occult_eval",
        help="lm-eval's output folder: results go to OUTPUT_PATH/<model name>/results_<time>.json (default: occult_eval)",
    )
    parser.set_defaults(func=main)


def _batch_size(value: str) -> int | str:
    if value.startswith("auto"):
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise SystemExit(f"occult eval: --batch_size must be a positive integer or 'auto', got {value!r}")
    return size


def _model_args(args: argparse.Namespace) -> dict:
    from lm_eval.utils import simple_parse_args_string

    names = ("occult_config", "placement", "num_devices", "prune", "max_devices_per_token", "profile", "dispatch", "dtype")
    flags = {name: getattr(args, name) for name in names} | {"trust_remote_code": args.trust_remote_code or None}
    model_args = {"pretrained": args.pretrained} | {k: v for k, v in flags.items() if v is not None}
    extra = simple_parse_args_string(args.model_args)
    clash = sorted(set(extra) & set(model_args))
    if clash:
        raise SystemExit(f"occult eval: {clash} given both as options and in --model_args; give each once")
    return model_args | extra


def check_output_path(output_path: str) -> None:
    """Fail before the evaluation when `--output_path` cannot take its results: lm-eval logs a failed write
    ("Could not save results aggregated") and carries on, so an hours-long run would end with nothing written."""
    from occult_hf.utils.atomic import probe_directory

    if not output_path:
        raise SystemExit("occult eval: --output_path must not be empty")
    path = Path(output_path)
    folder = path.parent if path.suffix == ".json" else path  # lm-eval writes beside a .json path, else into it
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"occult eval: --output_path {output_path!r} is an existing file; give a folder (it is made if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_directory(folder)
    except OSError as error:
        raise SystemExit(f"occult eval: --output_path {output_path!r}: cannot write there ({error.strerror or error})") from None


def _written_files(tracker, output_path: str, tasks: list[str]) -> list[Path]:
    """The results file, then the samples file of each of `tasks`, that `tracker`'s saves write (lm-eval's layout,
    mirrored here because lm-eval only logs a save that fails)."""
    date_id = getattr(tracker, "date_id", "<time>")  # set by the save itself, unset when it failed early
    path = Path(output_path)
    if path.suffix == ".json":
        folder, results = path.parent, path.with_name(f"{path.stem}_{date_id}.json")
    else:
        folder = path / str(tracker.general_config_tracker.model_name_sanitized)
        results = folder / f"results_{date_id}.json"
    return [results, *(folder / f"samples_{task}_{date_id}.jsonl" for task in tasks)]


def _evaluate(args: argparse.Namespace) -> int:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 writes
        check_output_path(args.output_path)
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import make_table

    from occult_hf.eval import make_task_manager, parse_task_list

    tracker = EvaluationTracker(output_path=args.output_path)
    results = lm_eval.simple_evaluate(
        model="occult-hf",
        model_args=_model_args(args),
        tasks=parse_task_list(args.tasks),
        batch_size=_batch_size(args.batch_size),
        device=str(resolve_device(args.device)),
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        bootstrap_iters=args.bootstrap_iters,
        log_samples=args.log_samples,
        task_manager=make_task_manager(args.include_path),
        evaluation_tracker=tracker,
    )
    if results is None:  # ranks other than 0 under torchrun
        return 0
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    sample_tasks = list(results["configs"]) if args.log_samples and samples else []
    for task_name in sample_tasks:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    from occult_hf.eval.report import has_suite, markdown_table

    if has_suite(results):  # the paper's table: only an occult23 run has one
        print("Headline rows (occult eval --headline):\n" + markdown_table(results))
    written = _written_files(tracker, args.output_path, sample_tasks)
    missing = [os.fspath(path) for path in written if not path.is_file()]
    if missing:  # the tables above are the run's only record then
        raise SystemExit(f"occult eval: lm-eval could not write {missing[0]!r} (--output_path {args.output_path!r}; its "
                         f"warning above says why): the tables above are this run's only results")  # fmt: skip
    print(f"wrote {os.fspath(written[0])}" + (f" and {len(written) - 1} samples file(s)" if len(written) > 1 else ""))
    return 0


def main(args: argparse.Namespace) -> int:
    import occult_hf.eval  # noqa: F401  (first: without the eval extra, its ImportError says what to install)

    if args.compare or args.headline:
        if args.pretrained or (args.compare and args.headline):
            raise SystemExit("occult eval: give one of a model to evaluate, --compare A B or --headline RESULTS")
        from occult_hf.eval.report import compare_table, load_results, markdown_table

        if args.headline:
            print(markdown_table(load_results(args.headline)))
        else:
            path_a, path_b = args.compare
            print(compare_table(load_results(path_a), load_results(path_b), labels=tuple(args.labels)))
        return 0
    if args.pretrained:
        return _evaluate(args)
    from importlib import resources

    from occult_hf.training import tiny_checkpoint_path

    with resources.as_file(tiny_checkpoint_path()) as path:  # no model given: the shipped tiny OLMoE
        print(f"occult eval: no model given, evaluating the shipped tiny OLMoE ({path})")
        args.pretrained = str(path)
        return _evaluate(args)
