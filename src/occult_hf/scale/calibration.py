"""The cost model's physical parameters, each fitted or read from the H200 measurements (`measurements`).

| parameter | from |
|---|---|
| expert kernel lines, ours and transformers' (`kernels`): ms = intercept + GFLOP / rate, forward and forward+backward | `bench experts` on one H200: ours, the faster of our two backends per (shape, T) (what `expert_backend="auto"` is tuned to pick); transformers' `grouped_mm` experts, 5.24 at T = 16384 (the version the two-GPU rows ran) and 5.17 below (5.24 was timed at T = 16384 only) |
| NVLink all-to-all (`nvlink`): ms = per call + MB / rate | `bench ep`'s wire times on two H200s (the forward's two row exchanges re-issued back to back) against the bytes sent |
| dense MLP rate (`dense_tflops`) | Qwen1.5's shared experts in session 6's profile (4 layers, 16,384 tokens, one H200) |
| rest of a decoder layer per token (`rest_ms_per_ktoken`) | `bench model`'s stock 4-layer models (session 6, one H200) less their experts (the measured transformers 5.24 point) and shared experts |
| dispatchers (`dispatchers`, `parameters.HostOverlap`): layer ms = max(host, gap + per-row cost x rows + device work), occult_hf's "all_to_all" and transformers' EP | `bench ep`'s session-4 call (docs/bench_ep_h200_2gpu.json, 2026-11-30 20:45 UTC: every mode at T = 128, 4096 and 16384) against the modelled experts, shared experts and exchange (`fit_host_overlap`) |
| optimizer time per parameter (`optimizer_ms_per_bparam`) | the DDP fine-tuning step of `bench paper` (OLMoE, call 1) less its modelled compute and all-reduce |

Every other measured row (the other `bench ep` calls, every other `bench paper` row) is a prediction
(`validation`). Fits minimise the relative error (each point weighted by 1 / its time).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from .cost import FWD, FWD_BWD, Cluster, allreduce_ms, ep_device_ms, expert_gflop, shared_ms, stock_layer_ms, train_step_ms
from .measurements import EP_LAYER_FILES, FINETUNE_TOKENS, PAPER_DEVICES
from .parameters import Calibration, HostOverlap, Line, Parameter
from .specs import model_spec
from .traffic import measured_traffic

#: `bench ep` modes the model knows ("replicated" modes and the "padded" / "symm_mem" dispatchers it does not)
MODELLED_DISPATCHERS = ("all_to_all", "transformers_ep")
OUR_KERNELS = ("triton_rows_io", "grouped_mm_fused")
TRANSFORMERS_KERNEL = "hf_grouped_mm"
#: the transformers version the two-GPU rows ran
TRANSFORMERS_VERSION = "5.24"
DIRECTION_KEYS = {FWD: "fwd_ms", FWD_BWD: "fwd_bwd_ms"}


def fit_line(x: np.ndarray, y: np.ndarray, what: str) -> tuple[Line, float]:
    """`(line, largest relative error)` minimising the relative error; a negative coefficient is an error."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        raise ValueError(f"{what}: a line needs at least 2 measured points, got {len(x)}")
    design = np.stack([np.ones_like(x), x], 1) / y[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    if intercept < 0 or slope <= 0:
        raise ValueError(f"{what}: the fit gives intercept {intercept:.4g} and slope {slope:.4g}; both must be positive")
    line = Line(float(intercept), float(slope))
    return line, float(np.max(np.abs(line(x) / y - 1)))


def calibrate(measurements: Mapping[str, Any]) -> Calibration:
    """Fit every parameter in order (each step uses the ones before it)."""
    params: list[Parameter] = []
    kernels = _fit_kernels(measurements["expert_kernels"], params)
    nvlink = _fit_nvlink(measurements["ep_layers"], params)
    dense = _dense_tflops(measurements["shared_expert_ms"], params)
    partial = Calibration(kernels, {}, nvlink, dense, {}, 0.0)
    rest = _rest_per_token(measurements["model_blocks"], measurements["expert_kernels"], partial, params)
    partial = replace(partial, rest_ms_per_ktoken=rest)
    partial = replace(partial, dispatchers=_fit_dispatchers(measurements["ep_layers"], partial, params))
    optimizer = _optimizer_cost(measurements["whole_models"], partial, params)
    return replace(partial, optimizer_ms_per_bparam=optimizer, parameters=tuple(params))


def _fit_kernels(points: list[dict], params: list[Parameter]) -> dict[str, Line]:
    ours: dict[tuple, dict[str, float]] = {}
    theirs: dict[tuple, dict] = {}
    for point in points:
        key = (point["shape"], point["tokens"])
        if point["implementation"] in OUR_KERNELS:
            best = ours.setdefault(key, {FWD: np.inf, FWD_BWD: np.inf})
            for direction, column in DIRECTION_KEYS.items():
                best[direction] = min(best[direction], point[column])
        elif point["implementation"] == TRANSFORMERS_KERNEL:  # the version the two-GPU rows ran, where it was timed
            if key not in theirs or point["transformers"] == TRANSFORMERS_VERSION:
                theirs[key] = {direction: point[column] for direction, column in DIRECTION_KEYS.items()}
    kernels = {}
    for family, table, source in (
        ("occult", ours, "bench experts (H200): the faster of triton_rows_io and grouped_mm_fused per (shape, T)"),
        ("transformers", theirs, f"bench experts (H200): hf_grouped_mm, transformers {TRANSFORMERS_VERSION} at T = 16384, 5.17 below"),
    ):  # fmt: skip
        for direction in (FWD, FWD_BWD):
            gflop = [expert_gflop(model_spec(shape), tokens * model_spec(shape).top_k, direction) for shape, tokens in table]
            times = np.array([t[direction] for t in table.values()])
            line, error = fit_line(np.array(gflop), times, f"{family} expert kernel {direction}")
            kernels[f"{family}/{direction}"] = line
            params.append(Parameter(
                f"{family} experts, {direction}", f"{line.intercept_ms:.3f} ms + GFLOP / {1 / line.slope_ms:.0f} TFLOP/s",
                source, len(table), error,
            ))  # fmt: skip
    return kernels


def _fit_nvlink(rows: list[dict], params: list[Parameter]) -> Line:
    timed = [row for row in rows if row["wire_ms"] is not None and row["sent_mb_max"] is not None]
    megabytes = np.array([row["sent_mb_max"] for row in timed])
    wire = np.array([row["wire_ms"] for row in timed])
    line, error = fit_line(megabytes, wire, "NVLink wire time")  # intercept: both calls of one forward
    nvlink = Line(line.intercept_ms / 2, line.slope_ms)
    params.append(Parameter(
        "NVLink all-to-all", f"{nvlink.intercept_ms * 1e3:.0f} us per call + MB / {1 / nvlink.slope_ms:.0f} GB/s",
        "bench ep wire times (2 x H200), every call", len(timed), error,
    ))  # fmt: skip
    return nvlink


def _dense_tflops(shared: dict, params: list[Parameter]) -> float:
    spec = model_spec(shared["shape"])
    gflop = shared["layers"] * 2 * 3 * spec.hidden * spec.shared_width * shared["tokens"] / 1e9
    tflops = gflop / shared["ms"]
    source = f"{shared['source']}: session 6 profile, Qwen1.5 shared experts ({shared['ms']} ms for {shared['layers']} layers)"
    params.append(Parameter("dense MLP rate", f"{tflops:.0f} TFLOP/s", source))
    return tflops


def _rest_per_token(blocks: list[dict], points: list[dict], partial: Calibration, params: list[Parameter]) -> dict[str, float]:
    rest = {}
    for block in blocks:
        spec, tokens = model_spec(block["shape"]), block["tokens"]
        kernel = [p for p in points if (p["shape"], p["tokens"], p["implementation"], p["transformers"])
                  == (block["shape"], tokens, TRANSFORMERS_KERNEL, TRANSFORMERS_VERSION)]  # fmt: skip
        if not kernel:
            raise ValueError(
                f"no transformers {TRANSFORMERS_VERSION} expert timing of {block['shape']} at T={tokens} to split {block['source']}"
            )
        for direction, column in DIRECTION_KEYS.items():
            per_layer = block[column] / block["layers"] - kernel[0][column] - shared_ms(partial, spec, tokens, direction)
            rest[f"{spec.name}/{direction}"] = per_layer / tokens * 1e3
        params.append(Parameter(
            f"rest of a layer, {spec.name}",
            f"{rest[f'{spec.name}/{FWD}']:.3f} / {rest[f'{spec.name}/{FWD_BWD}']:.3f} ms per 1000 tokens (fwd / fwd+bwd)",
            f"{block['source']}: stock {block['layers']}-layer model at {tokens} tokens, less its experts and shared experts",
        ))  # fmt: skip
    return rest


def layer_traffic_of(row: dict):
    """The `LayerTraffic` of a measured `bench ep` row (`traffic.measured_traffic`) and its dispatcher family."""
    spec = model_spec(row["shape"])
    if row["dispatcher"] == "transformers_ep":
        return measured_traffic("per_expert", row["tokens"], float(spec.top_k), spec.top_k, spec.hidden), "transformers"
    dispatch = "per_expert" if row["mode"].startswith("per_expert") else "dedup"
    return measured_traffic(dispatch, row["tokens"], row["ct"], spec.top_k, spec.hidden), "occult"


def modelled_ep_row(row: dict) -> bool:
    """Whether the model covers a `bench ep` row (the "all_to_all" dispatcher without replicas, transformers' EP)."""
    return row["dispatcher"] in MODELLED_DISPATCHERS and "replicated" not in row["mode"] and "file" not in row["mode"]


def _fit_dispatchers(rows: list[dict], partial: Calibration, params: list[Parameter]) -> dict[str, HostOverlap]:
    cluster = Cluster()
    dispatchers = {}
    fitted = [row for row in rows if row["source"] == EP_LAYER_FILES[0] and modelled_ep_row(row)]
    for family in ("occult", "transformers"):
        for direction, column in DIRECTION_KEYS.items():
            krows, device, measured = [], [], []
            for row in fitted:
                traffic, row_family = layer_traffic_of(row)
                if row_family == family:
                    krows.append(traffic.rows / 1e3)
                    device.append(ep_device_ms(partial, cluster, model_spec(row["shape"]), traffic, direction, family))
                    measured.append(row[column])
            what = f"{family} dispatcher {direction}"
            line, error = fit_host_overlap(np.array(krows), np.array(device), np.array(measured), what)
            dispatchers[f"{family}/{direction}"] = line
            params.append(Parameter(
                f"{family} dispatcher, {direction}",
                f"max({line.host_ms:.2f} ms, {line.gap_ms:.2f} ms + {line.per_krow_ms * 1e3:.1f} ns per row + work)",
                f"bench ep, {EP_LAYER_FILES[0]} (session 4, 2026-11-30 20:45 UTC): layer times against the modelled "
                f"experts, shared experts and exchange",
                len(krows), error,
            ))  # fmt: skip
    return dispatchers


def fit_host_overlap(krows: np.ndarray, device_ms: np.ndarray, measured: np.ndarray, what: str) -> tuple[HostOverlap, float]:
    """`(HostOverlap, largest relative error)`: `measured ~ max(host, gap + per_krow * krows + device_ms)`, least
    squares on the relative error.

    For a given split of the points into host-bound and device-bound ones the fit is linear (the host time a weighted
    mean of the first, the gap and per-row cost a line through the second); every split that puts the j points of
    least device work on the host (1 <= j <= n - 2) is refined until each point lies on the side the fit puts it,
    and the best is kept. A negative gap or per-row cost is no fit.
    """
    x, device, y = (np.asarray(a, dtype=np.float64) for a in (krows, device_ms, measured))
    if len(y) < 3:
        raise ValueError(f"{what}: the host-overlap fit needs at least 3 measured points, got {len(y)}")
    best: tuple[float, HostOverlap] | None = None
    for bound in range(1, len(y) - 1):
        on_host = np.zeros(len(y), dtype=bool)
        on_host[np.argsort(device)[:bound]] = True
        for _ in range(len(y)):
            line = _fit_split(x, device, y, on_host)
            if line is None:
                break
            split = line.host_ms >= line.gap_ms + line.per_krow_ms * x + device
            if (split == on_host).all() or split.all() or not split.any():
                break
            on_host = split
        if line is None or line.gap_ms < 0 or line.per_krow_ms < 0:
            continue
        predicted = np.array([line(k, d) for k, d in zip(x, device)])
        loss = float(np.sum((predicted / y - 1) ** 2))
        if best is None or loss < best[0]:
            best = (loss, line)
    if best is None:
        raise ValueError(f"{what}: no split of the {len(y)} points gives a gap and a per-row cost >= 0")
    line = best[1]
    return line, float(max(abs(line(k, d) / m - 1) for k, d, m in zip(x, device, y)))


def _fit_split(x: np.ndarray, device: np.ndarray, y: np.ndarray, on_host: np.ndarray) -> HostOverlap | None:
    """The host-overlap line of one split (`fit_host_overlap`), or None when a side has too few points."""
    if not on_host.any() or (~on_host).sum() < 2:
        return None
    host_y = y[on_host]
    host = float(np.sum(1 / host_y) / np.sum(1 / host_y**2))
    gpu_x, gpu_device, gpu_y = x[~on_host], device[~on_host], y[~on_host]
    design = np.stack([np.ones_like(gpu_x), gpu_x], 1) / gpu_y[:, None]
    (gap, per_krow), *_ = np.linalg.lstsq(design, (gpu_y - gpu_device) / gpu_y, rcond=None)
    return HostOverlap(host, float(gap), float(per_krow))


def _optimizer_cost(rows: list[dict], partial: Calibration, params: list[Parameter]) -> float:
    ddp = [row for row in rows if row["experiment"] == "finetune" and row["key"] == "ddp"]
    if not ddp:
        raise ValueError("no DDP fine-tuning row (bench paper) to fit the optimizer's time per parameter")
    costs = []
    for row in ddp:
        spec = model_spec(row["model"])
        layers = [stock_layer_ms(partial, spec, FINETUNE_TOKENS, FWD_BWD)] * spec.moe_layers
        sync = allreduce_ms(partial, Cluster(), spec.params, PAPER_DEVICES, PAPER_DEVICES)
        costs.append((row["ms"] - train_step_ms(partial, spec, layers, FINETUNE_TOKENS, 0.0, sync)) / (spec.params / 1e9))
    cost = float(np.mean(costs))
    if cost <= 0:
        raise ValueError(f"the DDP rows leave {cost:.3g} ms per billion parameters for the optimizer; it must be > 0")
    sources = ", ".join(sorted({f"{row['source']} ({row['model']})" for row in ddp}))
    value = f"{cost:.1f} ms per billion parameters held"
    params.append(Parameter("optimizer (AdamW, bf16)", value, f"bench paper DDP step: {sources}", len(ddp)))
    return cost


__all__ = ["calibrate", "fit_host_overlap", "fit_line", "layer_traffic_of", "modelled_ep_row"]
