"""occult_hf's loggers follow transformers' logging, as a transformers user expects.

transformers governs its own loggers (the `transformers.*` names) by `TRANSFORMERS_VERBOSITY` and
`transformers.logging.set_verbosity_*()`, and prints them through its own handler. occult_hf's
loggers are named `occult_hf.*`, outside that tree, so without this module they would fall back to
Python's root logger (WARNING, no handler unless the application configured one) and ignore both.

`get_logger(name)` returns the stdlib logger `name` (under `occult_hf`) after making the library's
root logger `occult_hf` a child of transformers' library root logger. With no level of its own, its
effective level is then transformers' current verbosity, changed by `TRANSFORMERS_VERBOSITY` and by
every later `set_verbosity_*()` call, and its records go through transformers' handler (so
`transformers.logging.disable_default_handler()`, `add_handler()`, `enable_propagation()` and
`enable_explicit_format()` apply to them too).

`OCCULT_VERBOSITY` (`debug`, `info`, `warning`, `error`, `critical`), or `set_verbosity(level)`,
gives occult_hf a level of its own that overrides transformers' for occult_hf's loggers only;
`set_verbosity(None)` follows transformers again.
"""

from __future__ import annotations

import logging
import os

#: the environment variable giving occult_hf's loggers a level of their own
VERBOSITY_ENV = "OCCULT_VERBOSITY"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
LIBRARY_ROOT = "occult_hf"


def _level_from_env() -> int | None:
    value = os.environ.get(VERBOSITY_ENV)
    if not value:
        return None
    if value.lower() not in LEVELS:
        raise ValueError(f"{VERBOSITY_ENV}={value!r} is not a verbosity; use one of {', '.join(LEVELS)}")
    return LEVELS[value.lower()]


def library_root_logger() -> logging.Logger:
    """The `occult_hf` logger, attached under transformers' library root logger (idempotent)."""
    from transformers.utils import logging as hf_logging

    root = logging.getLogger(LIBRARY_ROOT)
    hf_root = hf_logging.get_logger()  # configures transformers' root logger (TRANSFORMERS_VERBOSITY, handler)
    if root.parent is not hf_root:
        root.parent = hf_root
        root.setLevel(_level_from_env() or logging.NOTSET)
    return root


def get_logger(name: str | None = None) -> logging.Logger:
    """The logger `name` (default: the library root), governed as the module docstring says."""
    root = library_root_logger()
    if name is None or name == LIBRARY_ROOT:
        return root
    if not name.startswith(LIBRARY_ROOT + "."):
        raise ValueError(f"get_logger: name {name!r} must be {LIBRARY_ROOT!r} or start with '{LIBRARY_ROOT}.'")
    return logging.getLogger(name)


def set_verbosity(level: int | str | None) -> None:
    """Give occult_hf's loggers their own level (an int, or a name of `LEVELS`); None: follow transformers."""
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"set_verbosity: {level!r} is not a verbosity; use one of {', '.join(LEVELS)} or None")
        level = LEVELS[level.lower()]
    library_root_logger().setLevel(logging.NOTSET if level is None else level)


def get_verbosity() -> int:
    """The level occult_hf's loggers log at now (their own, or transformers')."""
    return library_root_logger().getEffectiveLevel()
