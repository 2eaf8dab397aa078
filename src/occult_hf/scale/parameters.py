"""The cost model's parameter set (`Calibration`), apart from how it is fitted (`calibration`), so that the
formulas (`cost`) and the fitting each read it without importing the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Line:
    """`ms = intercept_ms + slope_ms * x`."""

    intercept_ms: float
    slope_ms: float

    def __call__(self, x: float) -> float:
        return self.intercept_ms + self.slope_ms * x


@dataclass(frozen=True)
class Parameter:
    """One fitted or read parameter, as docs/scale.md lists it."""

    name: str
    value: str
    source: str
    points: int = 1
    max_error: float | None = None  # the fit's largest relative error over its points


@dataclass(frozen=True)
class Calibration:
    """The parameters (module docstring); `parameters` says where each came from."""

    kernels: Mapping[str, Line]  # "<occult|transformers>/<fwd|fwd_bwd>": ms vs GFLOP
    dispatchers: Mapping[str, Line]  # "<occult|transformers>/<fwd|fwd_bwd>": ms vs 1000 rows
    nvlink: Line  # ms per call, ms per MB
    dense_tflops: float
    rest_ms_per_ktoken: Mapping[str, float]  # "<model>/<fwd|fwd_bwd>"
    optimizer_ms_per_bparam: float
    parameters: tuple[Parameter, ...] = field(default=(), compare=False)
