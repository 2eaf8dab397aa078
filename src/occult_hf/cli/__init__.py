"""The `occult` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback

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


#: errors that mean "bad input" (a wrong file, setting or model): reported without their type name
INPUT_ERRORS = (ValueError, TypeError, KeyError, OSError)


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; an error ends in one line on stderr and exit code 2 (`--debug`: the traceback).

    The library's errors name the file, setting or rank at fault, so one line is what the user needs;
    `--debug` (accepted anywhere on the command line) re-raises with the full traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("OCCULT_DEBUG", "") not in ("", "0")
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


def check_model_source(name: str) -> None:
    """Fail at once on a local model directory that does not exist, instead of minutes of Hub retries.

    `name` is taken as local when it exists, starts with `/`, `.` or `~`, ends with a separator, or
    is not a valid Hub id (`org/name`); a valid Hub id that is not a directory is left to transformers.
    """
    if os.path.isdir(name):
        return
    if os.path.exists(name):
        raise NotADirectoryError(f"MODEL {name!r} is a file; expected a model directory or a Hub model id")
    local = name.startswith(("/", ".", "~")) or name.endswith(os.sep)
    if not local:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
        except HFValidationError:
            local = True
    if local:
        raise FileNotFoundError(f"MODEL {name!r}: model directory does not exist (and it is not a Hub model id)")


def one_line(error: BaseException) -> str:
    """The error's message on one line; its type name too unless it is an ordinary input error.

    A `KeyError` of a lookup holds the key alone, and a bare `name` tells the user nothing: it reads
    "missing key 'name'"; one raised with a message (a sentence, with spaces) keeps it.
    """
    raw = _key_error_text(error) if isinstance(error, KeyError) else str(error)
    text = " ".join(raw.split()) or repr(error)
    return text if isinstance(error, INPUT_ERRORS) else f"{type(error).__name__}: {text}"


def _key_error_text(error: KeyError) -> str:
    """The message of a `KeyError` raised with one (a string holding a space), else "missing key <key>"."""
    key = error.args[0] if error.args else None
    if isinstance(key, str) and " " in key.strip():
        return key
    return f"missing key {key!r}" if error.args else ""
