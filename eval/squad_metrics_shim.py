"""A stand-in for `transformers.data.metrics.squad_metrics`, a module transformers 5 does not have.

lm-eval 0.4.13's CoQA task (`lm_eval/tasks/coqa/utils.py`) does
`import transformers.data.metrics.squad_metrics as squad_metrics` and calls `compute_exact` and
`compute_f1`. Without that module the task's YAML cannot resolve its `!function` entries, so CoQA
(one of the `occult23` columns) would not load at all.

This module implements those SQuAD-v2 answer metrics (the official evaluation script's rules:
lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace; F1 over the bag of
normalised tokens, with an empty answer scoring 1 only against an empty answer) and
`install_squad_metrics_shim()` makes it importable under the old name. The install is scoped:
it adds a finder at the *end* of `sys.meta_path` that answers only for the two missing module
names, so it never shadows a real module of those names, and nothing inside transformers' own
modules is reassigned.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.machinery
import re
import string
import sys
import types

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)

#: the module names this shim answers for, and what each one is
SHIM_PACKAGE = "transformers.data.metrics"
SHIM_MODULE = "transformers.data.metrics.squad_metrics"


def normalize_answer(text: str) -> str:
    """Lower-case, remove punctuation, remove articles, collapse whitespace (SQuAD rules, in that order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def get_tokens(text: str) -> list[str]:
    """The normalised tokens of an answer; an empty answer has none."""
    return normalize_answer(text).split() if text else []


def compute_exact(a_gold: str, a_pred: str) -> int:
    """1 if the two answers are equal after normalisation, else 0."""
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    """Harmonic mean of token precision and recall over the normalised bags of tokens.

    When either answer is empty (a "no answer"), the score is 1 if both are empty, else 0.
    """
    gold_tokens, pred_tokens = get_tokens(a_gold), get_tokens(a_pred)
    if not gold_tokens or not pred_tokens:
        return int(gold_tokens == pred_tokens)
    num_same = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if num_same == 0:
        return 0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


class _SquadMetricsFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `SHIM_PACKAGE` (an empty package) and `SHIM_MODULE` (this module's metrics), nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == SHIM_PACKAGE:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname == SHIM_MODULE:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        if module.__name__ == SHIM_PACKAGE:
            module.__path__ = []
            module.__doc__ = "occult_hf stand-in package for the removed transformers.data.metrics"
            return
        for name in ("normalize_answer", "get_tokens", "compute_exact", "compute_f1"):
            setattr(module, name, globals()[name])
        module.__doc__ = __doc__


def install_squad_metrics_shim() -> None:
    """Make `import transformers.data.metrics.squad_metrics` work, for lm-eval's CoQA task (idempotent).

    The finder goes last on `sys.meta_path`: it is consulted only when no other finder provides that
    name, so it never shadows a real module.
    """
    if not any(isinstance(finder, _SquadMetricsFinder) for finder in sys.meta_path):
        sys.meta_path.append(_SquadMetricsFinder())


__all__ = ["normalize_answer", "get_tokens", "compute_exact", "compute_f1", "install_squad_metrics_shim"]
