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
class HostOverlap:
    """A dispatcher's layer time: `max(host_ms, gap_ms + per_krow_ms * krows + device_ms)`.

    The host issues a layer's kernels while the GPU runs them, except at the one synchronisation of the count
    exchange: after it the GPU idles until the host issues the rest (`gap_ms`). A small batch leaves the GPU
    waiting for the host, whose issue time (`host_ms`) is then the layer's; a large one keeps the host ahead, and
    the layer is the gap plus the GPU's work: the dispatcher's per-row work (`per_krow_ms` per 1000 rows) and
    `device_ms`, the rest of the layer's (experts, shared experts, exchange).
    """

    host_ms: float
    gap_ms: float
    per_krow_ms: float

    def __call__(self, krows: float, device_ms: float) -> float:
        return max(self.host_ms, self.gap_ms + self.per_krow_ms * krows + device_ms)


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
    dispatchers: Mapping[str, HostOverlap]  # "<occult|transformers>/<fwd|fwd_bwd>"
    nvlink: Line  # ms per call, ms per MB
    dense_tflops: float
    rest_ms_per_ktoken: Mapping[str, float]  # "<model>/<fwd|fwd_bwd>"
    optimizer_ms_per_bparam: float
    parameters: tuple[Parameter, ...] = field(default=(), compare=False)
