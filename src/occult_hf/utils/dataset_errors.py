"""A data file that `datasets` cannot read, as one error that names it.

`datasets` wraps what its parsers raise (pyarrow's JSON errors, a `UnicodeDecodeError`, a gzip error) in a
`DatasetGenerationError` that names no file, and reads an empty JSON Lines file into a bare `StopIteration`;
`occult profile --dataset` and `occult train`'s corpora both read files through it. Its JSON builder also logs the
parser's error before raising it; that log is dropped during the read, so the one error names the file.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, TypeVar

Loaded = TypeVar("Loaded")


def parsed(load: Callable[[], Loaded], name: str, also: tuple[type[BaseException], ...] = ()) -> Loaded:
    """`load()`; what `datasets` (and `also`) raise on data it cannot parse is a `ValueError` naming `name` and the
    parser's own error, found down the chain of `DatasetGenerationError`s."""
    import pyarrow
    from datasets.exceptions import DatasetGenerationError

    try:
        with _errors_not_logged_by_datasets():
            return load()
    except (DatasetGenerationError, pyarrow.ArrowException, StopIteration, *also) as error:
        cause = error
        while isinstance(cause, DatasetGenerationError) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__
        reason = "it holds no records" if isinstance(cause, StopIteration) else f"{type(cause).__name__}: {cause}"
        raise ValueError(f"{name} cannot be read ({' '.join(reason.split())[:300]})") from error


@contextlib.contextmanager
def _errors_not_logged_by_datasets() -> Iterator[None]:
    """Drop records of level ERROR and above at the handlers of `datasets`' logger (its warnings still show): what
    it logs as an error while reading is raised too, and `parsed` reports that once."""
    handlers = list(logging.getLogger("datasets").handlers)
    below_error = lambda record: record.levelno < logging.ERROR  # noqa: E731
    for handler in handlers:
        handler.addFilter(below_error)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(below_error)


__all__ = ["parsed"]
