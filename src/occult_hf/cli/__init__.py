"""The `occult` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback

from ..utils.errors import debug_requested, one_line
from ..utils.progress import progress_bars_off

#: subcommand modules of this package, in the order `occult --help` lists them
SUBCOMMANDS: tuple[str, ...] = ("demo", "train", "profile", "place", "replan", "report", "eval", "bench", "plan_cluster")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="occult",
        description="Occult expert parallelism for Hugging Face MoE models: profile routing, place experts, "
        "report communication, benchmark and evaluate.",
    )
    parser.add_argument(
        "--debug", action="store_true",
        help="show the full traceback of an error (anywhere on the command line; default: one line)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    _add_no_progress_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; an error ends in one line on stderr and exit code 2 (`--debug`: the traceback).

    The library's errors name the file, setting or rank at fault, so one line is what the user needs;
    `--debug` (accepted anywhere on the command line) re-raises with the full traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or debug_requested()
    no_progress = "--no-progress" in argv  # anywhere, as --debug: `occult --no-progress demo` too
    argv = [arg for arg in argv if arg not in ("--debug", "--no-progress")]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.no_progress = no_progress
    try:
        with progress_bars_off() if args.no_progress else contextlib.nullcontext():
            return int(args.func(args) or 0)
    except SystemExit as error:  # a subcommand's usage error (`raise SystemExit("occult x: ...")`): code 2, as argparse's
        if isinstance(error.code, str):
            parser.exit(2, f"{error.code}\n")
        raise
    except BrokenPipeError:  # the reader went away (`occult report ... | head`): stop quietly, as Unix tools do
        return reader_gone()
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's 128 + SIGINT, not a traceback (outputs are atomic)
        if debug:
            traceback.print_exc()
        parser.exit(EXIT_INTERRUPTED, f"occult {args.command}: interrupted\n")
    except Exception as error:  # noqa: BLE001 - every error becomes one line unless --debug
        if debug:
            traceback.print_exc()
            parser.exit(2)
        parser.exit(2, f"occult {args.command}: error: {one_line(error)} (--debug shows the traceback)\n")


#: the exit status of a command whose reader closed the pipe early (`| head`): a shell's 128 + SIGPIPE, as other tools
EXIT_BROKEN_PIPE = 141
#: the exit status of a command stopped by Ctrl-C: a shell's 128 + SIGINT
EXIT_INTERRUPTED = 130


def reader_gone() -> int:
    """After a `BrokenPipeError` on stdout: point stdout at /dev/null (the interpreter's last flush must not fail
    again) and return `EXIT_BROKEN_PIPE`."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def _add_no_progress_argument(parser: argparse.ArgumentParser) -> None:
    """`--no-progress` in the help of every leaf subcommand below `parser` (one place, so that no subcommand can lack
    it); `main` takes it from anywhere on the command line, as `--debug`, and turns off every progress bar of the
    run."""
    subcommands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for action in subcommands:
        for sub in action.choices.values():
            _add_no_progress_argument(sub)
    if not subcommands:
        parser.add_argument(
            "--no-progress", action="store_true",
            help="draw no progress bars, huggingface_hub's, transformers', datasets' and lm-eval's (anywhere on the "
            "command line; HF_HUB_DISABLE_PROGRESS_BARS=1 turns off all but datasets')",
        )  # fmt: skip


def check_output_dir(path: str, flag: str = "--out") -> None:
    """Fail before a long run when the output directory `path` of `flag` cannot be made or written in: it is an
    existing file, a file stands where one of its parents would be, or its nearest existing parent takes no new file
    (`utils.atomic.probe_directory`)."""
    from ..utils.atomic import nearest_existing, probe_directory

    existing = os.fspath(nearest_existing(os.path.abspath(path)))
    if not os.path.isdir(existing):
        where = "is an existing file" if existing == os.path.abspath(path) else f"lies under the file {existing!r}"
        raise FileExistsError(f"{flag} {path!r} {where}; give a directory (it is created if missing)")

    try:
        probe_directory(existing)
    except OSError:
        raise PermissionError(f"{flag} {path!r}: directory {existing!r} is not writable") from None


def check_output_is_not_an_input(command: str, out: str, inputs: list[tuple[str, str | None]]) -> None:
    """Fail before any work when the output file `out` is one of the command's input files (`inputs`: (what, path)):
    the write would replace the input (a trace or profile overwritten by the result, with exit code 0)."""
    if not os.path.isfile(out):
        return
    for what, path in inputs:
        if path is not None and os.path.isfile(path) and os.path.samefile(out, path):
            raise SystemExit(f"occult {command}: --out {out!r} is the {what} {path!r}; writing there would replace it: give another path")
