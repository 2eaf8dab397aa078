"""The one way the package writes a results table: markdown, through pytablewriter (which lm-eval, the `eval`
extra, already installs; imported on first use)."""

from __future__ import annotations

from typing import Any, Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table of `rows` under `headers` (cells as given: format numbers before)."""
    from pytablewriter import MarkdownTableWriter
    from pytablewriter.typehint import String

    writer = MarkdownTableWriter(
        headers=list(headers), value_matrix=[[str(cell) for cell in row] for row in rows], margin=1,
        type_hints=[String] * len(headers),  # cells stay as the caller formatted them ("1.00" is not "1.0")
    )  # fmt: skip
    return writer.dumps().rstrip("\n")


__all__ = ["markdown_table"]
