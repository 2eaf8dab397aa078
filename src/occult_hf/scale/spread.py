"""How far the measurements move by themselves: what the validation's rows can be held to.

A model cannot predict one measurement closer than repeated measurements of the same work agree with each other.
For every validated row (`validation.Checked`) this collects the other measurements of the same work:

* **repeats**: the same configuration (`Checked.configuration`: shape, T, routing, dispatcher and mode of a `bench ep`
  layer; experiment, model, row and placement of a `bench paper` row) measured in another call;
* **same work**: rows of the same call and table, shape and T (or experiment and model) that the model computes from
  the same inputs (`Checked.work`): every mode of a layer the model finds host-bound (at T = 128: the host's issue
  time, whatever the mode), the same dispatch at the same CT (`dedup+contiguous` and `dedup+refined` of a random
  router), the same CT and replayed split (`occult_placed` and `occult_nd2`, which prunes nothing at D = 2), one GPU's
  stock model and `device_map="auto"` (the same layers, on the GPUs in turn).

`Spread.spread` is the largest over the smallest of the row's and those measurements, less one. A row whose error is
over the tolerance is as close as its measurements allow when another measurement of the same work lies within the
tolerance of the prediction (`Spread.nearest_error`): the prediction is then within the tolerance of the range the
measurements of that work span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .validation import Checked


@dataclass(frozen=True)
class Spread:
    """The other measurements of one row's work: `(where, ms)` pairs, repeats first."""

    measured_ms: float
    predicted_ms: float
    repeats: tuple[tuple[str, float], ...]
    same_work: tuple[tuple[str, float], ...]

    @property
    def others(self) -> tuple[tuple[str, float], ...]:
        return self.repeats + self.same_work

    @property
    def spread(self) -> float | None:
        """max / min - 1 over the row's measurement and the others (None without others)."""
        if not self.others:
            return None
        values = [self.measured_ms, *(ms for _, ms in self.others)]
        return max(values) / min(values) - 1

    @property
    def nearest_error(self) -> float | None:
        """The prediction's error against the closest other measurement (None without others)."""
        if not self.others:
            return None
        return min((self.predicted_ms / ms - 1 for _, ms in self.others), key=abs)


def spreads(checked: Sequence[Checked]) -> list[Spread]:
    """The `Spread` of every row of `checked`, in order (module docstring)."""
    result = []
    for row in checked:
        repeats = tuple(
            (other.source, other.measured_ms) for other in checked
            if other.table == row.table and other.configuration == row.configuration and other.source != row.source
        )  # fmt: skip
        same_work = tuple(
            (f"{_name(other)}, same call", other.measured_ms) for other in checked
            if other.table == row.table and other.source == row.source and other.configuration != row.configuration
            and other.configuration[:2] == row.configuration[:2] and other.work == row.work
        )  # fmt: skip
        result.append(Spread(row.measured_ms, row.predicted_ms, repeats, same_work))
    return result


def _name(row: Checked) -> str:
    """A `bench ep` row's mode, a `bench paper` row's key."""
    return row.configuration[2] if row.table.startswith("bench paper") else row.configuration[-1]


__all__ = ["Spread", "spreads"]
