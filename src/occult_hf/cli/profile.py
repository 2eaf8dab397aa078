"""`occult profile`: record a routing profile from a model over text, or import a trace file."""

from __future__ import annotations

import argparse
import os

from ..profile import DEFAULT_SAMPLE_SIZE
from ..utils.arguments import non_negative_int, positive_int, separator, torch_dtype_name
from .devices import resolve_device

#: options that apply to some sources only (`text`, `dataset`, `trace`): dest -> (flag, sources, default). Their
#: parser default is None, so that one given where it cannot apply is an error instead of being ignored
_SOURCE_OPTIONS = {
    "separator": ("--separator", {"text"}, "\n"),
    "dataset_config": ("--dataset-config", {"dataset"}, None),
    "split": ("--split", {"dataset"}, "train"),
    "column": ("--text-column", {"dataset"}, "text"),
    "batch_size": ("--batch-size", {"text", "dataset"}, 8),
    "max_length": ("--max-length", {"text", "dataset"}, 512),
    "max_tokens": ("--max-tokens", {"text", "dataset"}, None),
    "device": ("--device", {"text", "dataset"}, "auto"),
    "dtype": ("--dtype", {"text", "dataset"}, "auto"),
    "trust_remote_code": ("--trust-remote-code", {"text", "dataset"}, False),
    "trace_key": ("--trace-key", {"trace"}, None),
    "layer": ("--layer", {"trace"}, None),
    "num_experts": ("--num-experts", {"trace"}, None),
    "model_type": ("--model-type", {"trace"}, None),
}
_SOURCE_FLAGS = {"text": "--text", "dataset": "--dataset", "trace": "--from-trace"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="record a routing profile (model + text or dataset, or --from-trace)",
        description="Record per-layer routing statistics (co-activation, expert counts, router-logit Gram "
        "matrix, a uniform sample of per-token top-k sets) through forward hooks on the model's own routers, "
        "or import a recorded trace (.npz). Writes a .safetensors profile.",
    )
    parser.add_argument("model", nargs="?", help="model id or local directory (transformers from_pretrained)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="plain text file, one document per line (see --separator)")
    source.add_argument(
        "--dataset",
        help="a local .txt/.json/.jsonl/.csv/.parquet file, a directory saved with save_to_disk, a local dataset "
        "directory or a hub dataset name (read with datasets.load_dataset; see --text-column, --dataset-config)",
    )
    source.add_argument("--from-trace", metavar="TRACE", help="routing trace .npz (topk_ids [T,k] or pair counts)")
    parser.add_argument("--out", required=True, help="output profile path (.safetensors)")
    group = parser.add_argument_group("text and dataset options")
    group.add_argument(
        "--separator", type=separator,
        help="document separator in --text, backslash escapes decoded ('\\x1e': the ASCII record separator; default: newline)",
    )
    group.add_argument("--dataset-config", help="dataset configuration name (hub or local dataset directory)")
    group.add_argument("--split", help="dataset split (default: train)")
    group.add_argument(
        "--text-column", dest="column", help="dataset column with text or token ids (default: text)",
    )
    group.add_argument("--batch-size", type=positive_int, help="sequences per forward (default: 8)")
    group.add_argument("--max-length", type=positive_int, help="tokens per window; longer documents are split (default: 512)")
    group.add_argument("--max-tokens", type=positive_int, help="stop after this many tokens")
    group.add_argument("--device", help="auto (CUDA when available, else CPU), cpu or cuda[:N] (default: auto)")
    group.add_argument("--dtype", type=torch_dtype_name, help="torch dtype for the model weights, e.g. bfloat16 (default: auto)")
    group.add_argument("--trust-remote-code", action="store_true", default=None, help="allow the checkpoint's own modelling code (not needed for DeepSeek-MoE: occult_hf has it natively)")
    trace = parser.add_argument_group("trace options")
    trace.add_argument("--trace-key", action="append", help="id array(s) to read (default: topk_ids or *_experts)")
    trace.add_argument("--layer", type=non_negative_int, help="decoder-layer index of a single-layer id trace (default 0)")
    trace.add_argument("--num-experts", type=positive_int, help="E (default: from the file or largest id + 1)")
    trace.add_argument("--model-type", help="model_type to record in the profile")
    parser.add_argument(
        "--sample-size", type=non_negative_int,
        help=f"tokens kept per layer in the top-k sample (default: {DEFAULT_SAMPLE_SIZE} for models, all for traces)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the token sample")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..hf.text_data import load_text_dataset
    from ..profile import RoutingProfile
    from ..utils.atomic import check_writable_dir
    from ..utils.checks import check_model_source
    from . import check_output_is_not_an_input

    check_writable_dir(args.out, "--out")  # before the run, not after it
    check_output_is_not_an_input("profile", args.out, [("--text", args.text), ("--dataset", args.dataset), ("--from-trace", args.from_trace)])
    if args.model:
        check_model_source(args.model)
    source = _source(args)
    if source == "trace" and args.model:
        raise SystemExit("occult profile: give MODEL or --from-trace, not both")
    if source != "trace" and not args.model:
        raise SystemExit("occult profile: MODEL is required with --text or --dataset")
    _check_options(args, source)
    if source == "trace":
        profile = RoutingProfile.from_trace(
            args.from_trace,
            key=args.trace_key,
            layer=args.layer,
            num_experts=args.num_experts,
            model_type=args.model_type,
            sample_size=args.sample_size,
            seed=args.seed,
        )
    else:
        # the settings and the data first: loading a model takes minutes
        text = _check_plain_text(args.text) if source == "text" else None
        import torch

        dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
        device = resolve_device(args.device)
        data = text if source == "text" else load_text_dataset(args.dataset, config=args.dataset_config, split=args.split, text_column=args.column)
        model, tokenizer = _load_model(args, dtype, device)
        profile = RoutingProfile.collect(
            model,
            data,
            tokenizer,
            batch_size=args.batch_size,
            max_length=args.max_length,
            sample_size=DEFAULT_SAMPLE_SIZE if args.sample_size is None else args.sample_size,
            seed=args.seed,
            max_tokens=args.max_tokens,
            text_column=args.column,
            separator=args.separator,
            source=f"{args.model} on {args.text or args.dataset}",
        )
    profile.save(args.out)
    print(describe_profile(profile))
    print(f"wrote {args.out}")
    return 0


def _source(args: argparse.Namespace) -> str:
    """What the profile is made of: `text`, `dataset` or `trace` (argparse lets exactly one be given)."""
    return "text" if args.text is not None else "dataset" if args.dataset is not None else "trace"


def _check_options(args: argparse.Namespace, source: str) -> None:
    """Refuse an option given where it cannot apply (it would be ignored), then fill in the defaults of the others."""
    from ..profile.trace import is_pair_count_trace

    for dest, (flag, sources, default) in _SOURCE_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif source not in sources:
            applies = " and ".join(_SOURCE_FLAGS[s] for s in _SOURCE_FLAGS if s in sources)
            raise SystemExit(f"occult profile: {flag} does not apply with {_SOURCE_FLAGS[source]} (only with {applies})")
    if source == "trace" and is_pair_count_trace(args.from_trace, args.trace_key):
        for flag, value in (("--layer", args.layer), ("--sample-size", args.sample_size)):
            if value is not None:
                raise SystemExit(
                    f"occult profile: {flag} does not apply to {args.from_trace!r}, a pair-count trace ('coact', 'freq'): "
                    f"it holds no single-layer ids and no tokens to sample"
                )


def describe_profile(profile) -> str:
    """One paragraph: what the profile holds."""
    layers = sorted(profile.layers)
    tokens = sorted({r.token_count for r in profile.layers.values()})
    samples = [0 if r.topk_sample is None else len(r.topk_sample) for r in profile.layers.values()]
    token_text = str(tokens[0]) if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
    return (
        f"routing profile: {profile.meta.get('source')} | model_type {profile.model_type} | E={profile.num_experts} "
        f"k={profile.top_k} | {len(layers)} MoE layers {_ranges(layers)} | tokens per layer {token_text} | "
        f"top-k sample {min(samples)}-{max(samples)} tokens per layer"
        + ("" if profile.has_samples else " (pair counts only: exact CT cannot be measured)")
    )


def _ranges(values: list[int]) -> str:
    """`[0-3, 5]` for [0, 1, 2, 3, 5]."""
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return "[" + ", ".join(parts) + "]"


def _load_model(args: argparse.Namespace, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return model.to(device), tokenizer


def _check_plain_text(path: str) -> str:
    """`--text` reads raw lines: a structured file there would be profiled as raw JSON/CSV text, and bytes that are
    not UTF-8 would stop the run after the model loaded."""
    from ..hf.text_data import data_file_builder
    from ..utils.text_files import check_utf8

    if os.path.isdir(path):
        raise IsADirectoryError(f"--text {path!r} is a directory; give a plain text file")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"--text {path!r} is not a regular file (a pipe or a device?); give a plain text file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--text {path!r} does not exist")
    builder = data_file_builder(path)
    if builder not in (None, "text"):
        raise ValueError(
            f"--text {path!r} is a {builder} file, which --text would read as raw lines; "
            f"use --dataset {path} --text-column COLUMN"
        )
    check_utf8(path, f"--text {path!r}")
    return path
