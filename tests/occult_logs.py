"""`occult_records()`: the records occult_hf's loggers emit inside it, each exactly once.

pytest's `caplog` sees a record through the root logger only when every logger on the way propagates, and
transformers' root logger (occult_hf's parent, see `occult_hf.utils.logging`) propagates only after some
library calls `enable_propagation()`; a test that adds `caplog.handler` to `occult_hf` as well then sees each
record twice or once, depending on which tests ran before it in the worker. This handler sits on `occult_hf`
alone, so the count does not depend on test order.
"""

from __future__ import annotations

import contextlib
import logging


class _Collect(logging.Handler):
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
    handler = _Collect()
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
