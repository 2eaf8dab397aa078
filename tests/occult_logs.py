"""`occult_records()`: the records occult_hf's loggers emit inside it, each exactly once; `RecordList`, the handler
that keeps them (also on transformers' root logger, `test_logging`).

pytest's `caplog` sees a record through the root logger only when every logger on the way propagates, and
transformers' root logger (occult_hf's parent, see `occult_hf.utils.logging`) propagates only where `CI` is set
in the environment (transformers' own rule) or after `enable_propagation()`; a test that adds `caplog.handler`
to `occult_hf` as well then saw each record twice on the CI machine and once here. This handler sits on
`occult_hf` alone, so the count does not depend on the environment.
"""

from __future__ import annotations

import contextlib
import logging


class RecordList(logging.Handler):
    """A handler that keeps every record it gets, in `records`."""

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def occult_records():
    """Yield the list of `LogRecord`s occult_hf logs (at its effective level) until the block ends."""
    from occult_hf.utils.logging import library_root_logger

    root = library_root_logger()
    handler = RecordList()
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
