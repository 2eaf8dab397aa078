"""`occult eval`: run the occult23 suite (or any lm-eval tasks) on an Occult model, or compare two runs.

    occult eval MODEL --placement placement.json --num-devices 8 --output_path runs/pruned
    torchrun --nproc-per-node 8 --no-python occult eval MODEL --num-devices 8 --batch_size 8
    occult eval --headline runs/pruned
    occult eval --compare runs/standard runs/pruned --labels standard pruned

lm-eval's flags keep lm-eval's spellings (`--output_path`, `--batch_size`, `--model_args`,
`--num_fewshot`, `--bootstrap_iters`, `--include_path`, `--log_samples`, `--trust_remote_code`) and
Occult's flags theirs (`--num-devices`, `--max-devices-per-token`, `--occult-config`); every flag takes
both spellings, with underscores or dashes, as `HfArgumentParser` does. A run writes lm-eval's output layout:
`<output_path>/<model name>/results_<time>.json` (and `samples_<task>_<time>.jsonl` with
`--log_samples`), then prints lm-eval's `make_table` and, for an occult23 run, the headline rows (the
paper's table, also lm-eval's `make_table`, in the suite's order, and their mean). Under torchrun only rank 0 writes.
Before the model loads, every rank checks what it can (the task names, `--limit` against the world size (a
fraction under EP: against each task's document count), the model directory) and rank 0 checks `--output_path`
(a folder, made if missing, that a file can be written in); under expert parallelism the ranks then agree, so a
check that fails on one rank stops every rank at once, naming it. A results or samples file lm-eval did not
write, or wrote only in part (a full disk), is an error after the tables.
`--headline RESULTS` prints the headline rows of a finished occult23 run and `--compare A B` two runs
side by side (the headline rows of two occult23 runs, else every metric), each from a
`results_*.json` or an `--output_path` folder (its newest `results_*.json`, named on stderr; a folder holding
several checkpoints' runs is refused); both warn on stderr where the
numbers are not comparable (a `--limit` run, or two runs with different `--limit`, documents or n-shot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

from occult_hf.registry import DISPATCH_MODES
from occult_hf.pruning import pruning_policy_names
from ..utils.arguments import non_negative_int, torch_dtype_name
from .devices import add_num_devices_argument, resolve_device
from .eval_checks import check_before_loading, no_documents_message

#: the options that read finished runs; every other option configures an evaluation
_RESULTS_OPTIONS = frozenset({"help", "compare", "headline", "labels"})


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
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), help="column names for --compare (default: A B)")
    parser.add_argument("--tasks", default="occult23", help="'occult23', 'occult_offline' (no download) or comma-separated lm-eval task names (default: occult23)")
    occult = parser.add_argument_group("Occult settings (either --occult-config or the fields)")
    occult.add_argument("--occult-config", "--occult_config", dest="occult_config", help="an OccultConfig JSON file")
    occult.add_argument("--placement", help="'contiguous' or an occult_placement.json")
    add_num_devices_argument(occult, help="devices in the EP group (logical devices in one process)")
    occult.add_argument("--prune", choices=pruning_policy_names(), help="collaboration pruning mode")
    occult.add_argument("--max-devices-per-token", "--max_devices_per_token", dest="max_devices_per_token", type=int, help="N_d for pruning")
    occult.add_argument("--profile", help="routing profile (.safetensors), for similarity pruning")
    occult.add_argument("--dispatch", choices=DISPATCH_MODES, help="EP dispatch mode")
    run = parser.add_argument_group("lm-eval settings")
    run.add_argument("--batch_size", "--batch-size", dest="batch_size", type=batch_size_setting,
                     help="a positive integer, 'auto' or 'auto:N' (N >= 1; auto only in one process) (default: batch_size in --model_args, else 1)")
    run.add_argument("--device", help="auto (CUDA when available, else CPU), cuda, cuda:0 or cpu (default: device in --model_args, else auto; one GPU per rank under torchrun)")
    run.add_argument("--dtype", type=torch_dtype_name, help="model dtype, e.g. bfloat16 (default: the model's `dtype` in --model_args, else auto: the checkpoint's)")
    run.add_argument("--limit", type=limit_setting,
                     help="documents per task (testing only): a positive integer, or a fraction of each task in (0, 1); under EP at least one per rank of every task")
    run.add_argument("--num_fewshot", "--num-fewshot", dest="num_fewshot", type=non_negative_int, help="few-shot examples (default: each task's own)")
    run.add_argument("--bootstrap_iters", "--bootstrap-iters", dest="bootstrap_iters", type=non_negative_int, default=100000, help="bootstrap iterations for stderrs (0: none)")
    run.add_argument("--trust_remote_code", "--trust-remote-code", dest="trust_remote_code", action="store_true", help="allow the checkpoint's own modelling code")
    run.add_argument("--include_path", "--include-path", dest="include_path", help="a folder of extra lm-eval task YAMLs")
    run.add_argument("--model_args", "--model-args", dest="model_args", default="", help="more occult-hf/hf model_args as k=v,k=v")
    run.add_argument("--log_samples", "--log-samples", dest="log_samples", action="store_true", help="also write every document's inputs and outputs")
    run.add_argument(
        "--output_path", "--output-path", dest="output_path", default="occult_eval",
        help="lm-eval's output folder, made if missing: results go to OUTPUT_PATH/<model name>/results_<time>.json; a path "
        "ending in .json names the results file instead (lm-eval's rule): DIR/NAME.json writes DIR/NAME_<time>.json "
        "(default: occult_eval)",
    )  # fmt: skip
    parser.set_defaults(func=main, run_options=_run_options(parser))


def _run_options(parser: argparse.ArgumentParser) -> dict[str, tuple[str, object]]:
    """`{dest: (flag, default)}` of every option that configures an evaluation, which `--compare` and `--headline`
    would ignore."""
    return {action.dest: (action.option_strings[0], action.default) for action in parser._actions
            if action.option_strings and action.dest not in _RESULTS_OPTIONS}  # fmt: skip


def batch_size_setting(text: str) -> int | str:
    """`--batch_size` (and `batch_size=` in `--model_args`): a positive integer, `auto`, or `auto:N` (lm-eval picks the
    size again N times), checked at parse time: lm-eval takes anything starting with "auto" (`autox` ran as `auto`)
    and divides by N (`auto:0`)."""
    count = text.removeprefix("auto:")
    if text == "auto" or (count != text and count.isdigit() and int(count) >= 1):
        return text
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'auto' or 'auto:N' (N >= 1), got {text!r}")
    return size


def limit_setting(text: str) -> int | float:
    """`--limit`: documents per task, a positive integer, or a fraction of each task's documents in (0, 1) (lm-eval
    reads a value below 1 as a fraction), checked at parse time: lm-eval truncates 1.5 to 1 without a word and fails
    on -1, nan or inf with errors that do not name the flag, after the model loaded."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if 0 < value < 1:
        return value
    if math.isfinite(value) and value >= 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(f"expected a positive integer or a fraction in (0, 1), got {text!r}")


def _model_args(args: argparse.Namespace) -> dict:
    """The run's `occult-hf` model_args: the Occult flags, `--dtype`, `--batch_size`, `--device` and
    `--trust_remote_code` that were given, and `--model_args`; a setting given both ways is an error naming it."""
    from lm_eval.utils import simple_parse_args_string

    names = ("occult_config", "placement", "num_devices", "prune", "max_devices_per_token", "profile", "dispatch", "dtype",
             "batch_size", "device")  # fmt: skip
    flags = {name: getattr(args, name) for name in names} | {"trust_remote_code": args.trust_remote_code or None}
    model_args = {"pretrained": args.pretrained} | {k: v for k, v in flags.items() if v is not None}
    extra = simple_parse_args_string(args.model_args)
    clash = sorted(set(extra) & set(model_args))
    if clash:
        raise SystemExit(f"occult eval: {clash} given both as options and in --model_args; give each once")
    return model_args | extra


def _batch_size_and_device(model_args: dict) -> tuple[int | str, str]:
    """Take `batch_size` and `device` out of `model_args`: lm-eval hands them to the model beside the model_args, and
    the model takes each once. The batch size from `--model_args` gets `--batch_size`'s check."""
    try:
        batch_size = batch_size_setting(str(model_args.pop("batch_size", 1)))
    except argparse.ArgumentTypeError as error:
        raise SystemExit(f"occult eval: --model_args batch_size: {error}") from None
    return batch_size, resolve_device(model_args.pop("device", None))


@contextlib.contextmanager
def _lm_eval_bars(enabled: bool):
    """lm-eval draws bars that have no switch of its own: one per task in `Task.build_requests` (the `tqdm` its task
    module imported) and one per bootstrapped metric (`api.metrics.bootstrap_stderr` imports `tqdm.tqdm` when it
    runs). With `enabled` False (HF's progress switches, which `--no-progress` turns off) both are drawn disabled
    inside the block, and as before after it."""
    import tqdm

    import lm_eval.api.task as task_module

    if enabled:
        yield
        return

    class Disabled(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    drawn = task_module.tqdm, tqdm.tqdm
    task_module.tqdm = tqdm.tqdm = Disabled
    try:
        yield
    finally:
        task_module.tqdm, tqdm.tqdm = drawn


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


def _unwritten(results: Path, samples: dict[Path, int]) -> tuple[Path, str] | None:
    """The first of the run's files that lm-eval did not write whole, and why: `results` and the samples files with
    their sample counts. lm-eval logs a failed write and carries on, and a write that fails part-way (a full disk)
    leaves a file cut short that would pass for the run's record."""
    if not results.is_file():
        return results, "missing"
    try:
        json.loads(results.read_text(encoding="utf-8"))
    except ValueError:  # a cut-short JSON text: any proper prefix of lm-eval's object fails to parse
        return results, "cut short: not valid JSON"
    for path, count in samples.items():
        if not path.is_file():
            return path, "missing"
        lines = _line_count(path)
        if lines != count:
            return path, f"cut short: {lines} of the {count} samples"
    return None


def _line_count(path: Path) -> int:
    """Newlines in `path`, read in blocks: a samples file holds one JSON line per document and may be gigabytes."""
    with path.open("rb") as file:
        return sum(block.count(b"\n") for block in iter(lambda: file.read(1 << 20), b""))


def _evaluate(args: argparse.Namespace) -> int:
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import make_table

    from occult_hf.eval.model import ep_world
    from occult_hf.utils.progress import progress_enabled

    model_args = _model_args(args)
    batch_size, device = _batch_size_and_device(model_args)
    rank, world_size = ep_world(device)  # under EP the group forms first, so that a failed check reaches every rank
    names, task_manager = check_before_loading(args, rank, world_size)
    tracker = EvaluationTracker(output_path=args.output_path)
    try:
        with _lm_eval_bars(progress_enabled()):
            results = lm_eval.simple_evaluate(
                model="occult-hf",
                model_args=model_args,
                tasks=names,
                batch_size=batch_size,
                device=device,
                limit=args.limit,
                num_fewshot=args.num_fewshot,
                bootstrap_iters=args.bootstrap_iters,
                log_samples=args.log_samples,
                task_manager=task_manager,
                evaluation_tracker=tracker,
            )
    except ValueError as error:
        if "did not find any docs" not in str(error):
            raise
        raise SystemExit(no_documents_message(args.limit, rank, world_size)) from error
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
    from occult_hf.eval.report import has_suite, markdown_table, partial_run_warnings

    if has_suite(results):  # the paper's table: only an occult23 run has one
        print("Headline rows (occult eval --headline):\n" + markdown_table(results))
        _warn(partial_run_warnings(results, "this run"))
    written = _written_files(tracker, args.output_path, sample_tasks)
    unwritten = _unwritten(written[0], dict(zip(written[1:], (len(samples[task]) for task in sample_tasks))))
    if unwritten:  # the tables above are the run's only record then
        path, why = unwritten
        raise SystemExit(f"occult eval: lm-eval could not write {os.fspath(path)!r} whole ({why}; --output_path "
                         f"{args.output_path!r}; its warning above says why): the tables above are this run's only "
                         f"results; make room there (or fix its permissions), delete any part-written file and run "
                         f"again")  # fmt: skip
    print(f"wrote {os.fspath(written[0])}" + (f" and {len(written) - 1} samples file(s)" if len(written) > 1 else ""))
    return 0


def _warn(lines: list[str]) -> None:
    """Print `lines` as warnings on stderr, so that the tables on stdout stay what a pipe reads."""
    for line in lines:
        print(f"occult eval: warning: {line}", file=sys.stderr)


def _report(args: argparse.Namespace) -> int:
    """`--headline` or `--compare`: tables of finished runs, and on stderr why their numbers may not compare."""
    if args.compare and args.headline:
        raise SystemExit("occult eval: give one of a model to evaluate, --compare A B or --headline RESULTS")
    if args.pretrained:
        extra = "--compare takes two runs, A and B" if args.compare else "--headline takes one run"
        raise SystemExit(f"occult eval: {extra}, and {args.pretrained!r} was given as well (a glob that matched "
                         f"several results files? give the --output_path folders: each one's newest results_*.json is read)")  # fmt: skip
    given = [flag for dest, (flag, default) in args.run_options.items() if getattr(args, dest) != default]
    if given:
        raise SystemExit(f"occult eval: --compare and --headline read finished runs and take no evaluation options, got "
                         f"{', '.join(given)}")  # fmt: skip
    from occult_hf.eval.report import (
        compare_table, comparison_warnings, load_results, markdown_table, partial_run_warnings, results_file,
    )  # fmt: skip

    for path in [args.headline] if args.headline else args.compare:  # a folder: which of its runs is read
        if os.path.isdir(path):
            newest = os.fspath(results_file(path))
            print(f"occult eval: {path}: reading {newest}, its newest results file", file=sys.stderr)
    if args.headline:
        results = load_results(args.headline)
        print(markdown_table(results))
        _warn(partial_run_warnings(results, args.headline))
    else:
        a, b = (load_results(path) for path in args.compare)
        labels = tuple(args.labels or ("A", "B"))
        print(compare_table(a, b, labels=labels))
        _warn(comparison_warnings(a, b, labels))
    return 0


def main(args: argparse.Namespace) -> int:
    import occult_hf.eval  # noqa: F401  (first: without the eval extra, its ImportError says what to install)

    if args.labels and not args.compare:
        raise SystemExit("occult eval: --labels names the two columns of --compare")
    if args.compare or args.headline:
        return _report(args)
    if args.pretrained:
        return _evaluate(args)
    from importlib import resources

    from occult_hf.training import tiny_checkpoint_path

    with resources.as_file(tiny_checkpoint_path()) as path:  # no model given: the shipped tiny OLMoE
        print(f"occult eval: no model given, evaluating the shipped tiny OLMoE ({path})")
        args.pretrained = str(path)
        return _evaluate(args)
