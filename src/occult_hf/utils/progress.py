"""Progress bars through huggingface_hub's `tqdm`, so that the Hugging Face switches turn them off.

`HF_HUB_DISABLE_PROGRESS_BARS=1`, `huggingface_hub.utils.disable_progress_bars()` and
`transformers.utils.logging.disable_progress_bar()` (which calls the former) silence every bar
occult_hf draws, as they silence the hub's and transformers' own; `disable_progress_bars("occult_hf")`
of huggingface_hub silences only occult_hf's. Bars that others draw for us (the Trainer's, lm-eval's)
take a switch of their own, which `progress_enabled` sets from the same state. `occult ... --no-progress`
calls `disable_progress_bars` below, which turns off `datasets`' bars too.
"""

from __future__ import annotations

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


def disable_progress_bars() -> None:
    """Turn off every progress bar of this process: huggingface_hub's (occult_hf's with them), transformers'
    and `datasets`' (through its environment variable when it is not imported yet)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"


__all__ = ["PROGRESS_GROUP", "disable_progress_bars", "progress_bar", "progress_enabled"]
