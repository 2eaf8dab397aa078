"""The one way the package writes a results table: GitHub markdown through tabulate (installed with the `eval`
extra's lm-eval, through sacrebleu; imported on first use)."""

from __future__ import annotations

from typing import Any, Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table of `rows` under `headers`; cells stay as the caller formatted them."""
    from tabulate import tabulate

    return tabulate([[str(cell) for cell in row] for row in rows], headers=list(headers), tablefmt="github", disable_numparse=True)


__all__ = ["markdown_table"]
