"""One line for an error, as every command of occult_hf prints it (`occult`, `python -m occult_hf.hf.finetune`): the
library's errors name the file, setting or rank at fault, so the line is what the user needs."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

#: the environment variable that asks every command for the full traceback instead of the one line
DEBUG_ENV = "OCCULT_DEBUG"

#: errors that mean "bad input" (a wrong file, setting or model): reported without their type name
INPUT_ERRORS = (ValueError, TypeError, KeyError, OSError)


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


def debug_requested() -> bool:
    """Whether `$OCCULT_DEBUG` asks for tracebacks (set, and not "0")."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_command(name: str, main: Callable[[], int | None]) -> int:
    """`main()` as a command named `name` (`python -m ...`): its status, or, when it raises, one line on stderr
    (`one_line`) and status 2; `$OCCULT_DEBUG` prints the traceback instead. `SystemExit` and `KeyboardInterrupt`
    pass through (argparse's usage errors, a command's own exit status, Ctrl-C)."""
    try:
        return main() or 0
    except Exception as error:  # noqa: BLE001 - every error becomes one line unless OCCULT_DEBUG
        if debug_requested():
            traceback.print_exc()
        else:
            print(f"{name}: error: {one_line(error)} ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
        return 2


__all__ = ["DEBUG_ENV", "INPUT_ERRORS", "debug_requested", "one_line", "run_command"]
