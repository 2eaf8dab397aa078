"""Progress bars through huggingface_hub's `tqdm`, so that the Hugging Face switches turn them off.

`HF_HUB_DISABLE_PROGRESS_BARS=1`, `huggingface_hub.utils.disable_progress_bars()` and
`transformers.utils.logging.disable_progress_bar()` (which calls the former) silence every bar
occult_hf draws, as they silence the hub's and transformers' own; `disable_progress_bars("occult_hf")`
of huggingface_hub silences only occult_hf's. Bars that others draw for us (the Trainer's, lm-eval's)
take a switch of their own, which `progress_enabled` sets from the same state. `occult ... --no-progress`
turns every bar off for the command's run (`progress_bars_off`), `datasets`' bars too, and puts the
switches back afterwards, so an in-process `occult_hf.cli.main([...])` leaves its caller's bars as they were.
"""

from __future__ import annotations

import contextlib
import os
import sys

#: the huggingface_hub progress-bar group of occult_hf's bars
PROGRESS_GROUP = "occult_hf"


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs):
    """A `tqdm` bar (huggingface_hub's) in occult_hf's group; off when `enabled` is False or HF's switches say so."""
    from huggingface_hub.utils import tqdm

    return tqdm(iterable, disable=not enabled, name=PROGRESS_GROUP, **kwargs)


def progress_enabled(requested: bool = True) -> bool:
    """`requested`, unless HF's switches turned occult_hf's bars off: for the bars others draw for us."""
    from huggingface_hub.utils import are_progress_bars_disabled

    return requested and not are_progress_bars_disabled(PROGRESS_GROUP)


@contextlib.contextmanager
def progress_bars_off():
    """Every progress bar of this process off inside the block: huggingface_hub's (occult_hf's with them),
    transformers' and `datasets`' (at once, or as soon as it is imported inside the block: its environment
    variable would be read once at import and keep its bars off for the rest of the process). The switches
    that were on are turned on again on the way out."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging

    from .after_import import cancel, when_imported

    hub_was_off = are_progress_bars_disabled()
    datasets = sys.modules.get("datasets")
    datasets_was_on = datasets.is_progress_bar_enabled() if datasets else os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS") is None
    logging.disable_progress_bar()
    when_imported("datasets", lambda module: module.disable_progress_bars())
    try:
        yield
    finally:
        cancel("datasets")
        if not hub_was_off:
            logging.enable_progress_bar()
        if datasets_was_on and "datasets" in sys.modules:
            sys.modules["datasets"].enable_progress_bars()


__all__ = ["PROGRESS_GROUP", "progress_bar", "progress_bars_off", "progress_enabled"]
