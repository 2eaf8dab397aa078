"""The one way the package writes a table, to a file or the terminal: GitHub markdown through tabulate (a
dependency of the package; lm-eval's sacrebleu needs it too), imported on first use."""

from __future__ import annotations

from typing import Any, Sequence

_ALIGNMENTS = {"l": "left", "r": "right", "c": "center"}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table of `rows` under `headers`; cells stay as the caller formatted them.

    `align`: one letter per column, `l`, `r` or `c` (numbers read best `r`); the separator row then carries
    markdown's alignment colons. None: every column left, no colons."""
    from tabulate import tabulate

    cells = [[str(cell) for cell in row] for row in rows]
    wrong = [index for index, row in enumerate(cells) if len(row) != len(headers)]
    if wrong:  # tabulate would drop extra cells, or (in the first row) shift every header one column over
        raise ValueError(f"markdown_table: rows {wrong[:8]} have {len(cells[wrong[0]])} cells, not one per each of the {len(headers)} columns")
    if align is None:
        return tabulate(cells, headers=list(headers), tablefmt="github", disable_numparse=True)
    if len(align) != len(headers) or set(align) - set(_ALIGNMENTS):
        raise ValueError(f"align {align!r} must give one of l, r, c for each of the {len(headers)} columns")
    colalign = [_ALIGNMENTS[letter] for letter in align]
    return tabulate(cells, headers=list(headers), tablefmt="pipe", disable_numparse=True, colalign=colalign)


def number_cell(value: float | None, digits: int = 2) -> str:
    """`value` with `digits` decimals, "-" for a figure that is missing (None)."""
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_rows(table: str) -> list[list[str]]:
    """The body rows of a markdown table (`markdown_table`'s or lm-eval's), each as its stripped cells."""
    lines = [line.strip() for line in table.splitlines() if line.strip().startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


__all__ = ["markdown_rows", "markdown_table", "number_cell"]
