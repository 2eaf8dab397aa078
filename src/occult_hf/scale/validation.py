"""The model's predictions of the measured two-GPU rows, row by row (`bench ep` layers and `bench paper` models).

Each row is predicted from its shape, its T and its recorded CT (`traffic.measured_traffic`) through the same
equations as the projections (`cost`); a `bench paper` row whose trace was replayed takes the busiest rank's share
of the pairs that replay gives (`measurements.replayed_splits`), the others an even split. Rows of the calibration
(`calibration`'s fitting sets: the session-4 `bench ep` call, the DDP fine-tuning step) are marked, so the rest can
be read as predictions. Each row names its configuration (`Checked.configuration`: what `spread` compares across
calls).

What the model does not cover, and so leaves out: `bench ep`'s "padded" and "symm_mem" dispatchers and replicated
experts; `bench paper`'s `hf_ep_all_reduce`, `hf_ep_occult` and MegaBlocks rows.

Prediction of a `bench paper` row (T per rank as the bench ran it: 16,384 in prefill, 4,096 in fine-tuning):

| key | model |
|---|---|
| `stock_1gpu`, `device_map_auto` | one GPU: `prefill_ms` with `stock_layer_ms` (device_map runs the GPUs one after the other) |
| `occult_per_expert`, `occult_contiguous`, `occult_placed`, `occult_nd2`, `occult_nd1` | `ep_layer_ms` (occult_hf) at the row's CT |
| `hf_ep_all_to_all` | `ep_layer_ms` with transformers' dispatcher and kernels, one row per (token, expert) |
| `ddp` | stock layers, the optimizer over every parameter, an all-reduce of every gradient |
| `fsdp2` | stock layers, the optimizer over 1/D of the parameters, every decoder layer's and the root's parameters gathered |
| `occult_exact`, `occult_pruned` | EP layers at the row's CT, the optimizer over the rank's parameters, an all-reduce of the replicated ones |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .calibration import layer_traffic_of, modelled_ep_row
from .cost import FWD, FWD_BWD, Cluster, allreduce_ms, ep_layer_ms, gathered_ms, prefill_ms, stock_layer_ms, train_step_ms
from .measurements import EP_LAYER_FILES, FINETUNE_TOKENS, PAPER_DEVICES, PREFILL_TOKENS, paper_tokens
from .parameters import Calibration
from .specs import ModelSpec, model_spec
from .traffic import measured_traffic

PREFILL_EP_KEYS = {"occult_per_expert": "per_expert", "occult_contiguous": "dedup", "occult_placed": "dedup",
                   "occult_nd2": "dedup", "occult_nd1": "dedup"}  # fmt: skip
ONE_GPU_KEYS = ("stock_1gpu", "device_map_auto")


@dataclass(frozen=True)
class Checked:
    """One measured row against its prediction."""

    table: str  # "bench ep fwd", "bench ep fwd+bwd", "bench paper prefill", "bench paper fine-tuning"
    source: str
    label: str
    measured_ms: float
    predicted_ms: float
    calibration: bool  # the row was part of a fit
    configuration: tuple = ()  # what was measured, apart from the call: rows of other calls with the same one repeat it
    work: tuple = ()  # what the model computes it from: rows of one call with the same shape, T and work are the same work

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted_ms / self.measured_ms - 1


def validate(calib: Calibration, measurements: Mapping[str, Any]) -> list[Checked]:
    """Every modelled measured row with its prediction (module docstring)."""
    splits = {(s["model"], s["trace"], s["tokens"], s["placement"], s["max_devices_per_token"]): s["busiest_share"]
              for s in measurements.get("replayed_splits", [])}  # fmt: skip
    return _ep_rows(calib, measurements["ep_layers"]) + _paper_rows(calib, measurements["whole_models"], splits)


def _ep_rows(calib: Calibration, rows: list[dict]) -> list[Checked]:
    checked = []
    cluster = Cluster()
    for row in rows:
        if not modelled_ep_row(row):
            continue
        traffic, family = layer_traffic_of(row)
        spec = model_spec(row["shape"])
        label = f"{row['shape']} T={row['tokens']} {row['routing']}: {row['dispatcher']} {row['mode']}"
        if family == "occult":
            label += f" (CT {row['ct']:.2f})"
        configuration = (row["shape"], row["tokens"], row["routing"], row["dispatcher"], row["mode"])
        for direction, column, name in ((FWD, "fwd_ms", "fwd"), (FWD_BWD, "fwd_bwd_ms", "fwd+bwd")):
            predicted = ep_layer_ms(calib, cluster, spec, traffic, direction, family)
            host_bound = predicted == calib.dispatchers[f"{family}/{direction}"].host_ms
            work = (family, "host-bound") if host_bound else (family, traffic.dispatch, round(traffic.ct, 2))
            checked.append(Checked(f"bench ep {name}", f"{row['source']} ({row['when']})", label, row[column], predicted,
                                   row["source"] == EP_LAYER_FILES[0], configuration, work))  # fmt: skip
    return checked


def _paper_rows(calib: Calibration, rows: list[dict], splits: Mapping[tuple, float]) -> list[Checked]:
    recorded_ct = {(r["experiment"], r["model"], r["key"], r["placement"]): r["ct"] for r in rows if r["ct"] is not None}
    checked = []
    for row in rows:
        spec = model_spec(row["model"])
        configuration = (row["experiment"], row["model"], row["key"], row["placement"])
        ct = row["ct"] if row["ct"] is not None else recorded_ct.get(configuration)
        share = splits.get((row["model"], row["trace"], paper_tokens(row), row["placement"], row["max_devices_per_token"]))
        predicted = (_prefill(calib, spec, row["key"], ct, share) if row["experiment"] == "prefill"
                     else _finetune(calib, spec, row["key"], ct, share))  # fmt: skip
        if predicted is None:
            continue
        table = "bench paper prefill" if row["experiment"] == "prefill" else "bench paper fine-tuning"
        label = f"{row['model']} {row['key']}" + (f" (CT {ct:.2f})" if ct is not None else "")
        kind = "one GPU" if row["key"] in ONE_GPU_KEYS else PREFILL_EP_KEYS.get(row["key"], row["key"])
        work = (kind, None if ct is None else round(ct, 2), None if share is None else round(share, 3))
        checked.append(Checked(table, row["source"], label, row["ms"], predicted, row["key"] == "ddp", configuration, work))
    return checked


def _prefill(calib: Calibration, spec: ModelSpec, key: str, ct: float | None, share: float | None) -> float | None:
    cluster, tokens = Cluster(), PREFILL_TOKENS
    if key in ONE_GPU_KEYS:
        layer = stock_layer_ms(calib, spec, tokens, FWD)
    elif key in PREFILL_EP_KEYS:
        traffic = measured_traffic(PREFILL_EP_KEYS[key], tokens, ct, spec.top_k, spec.hidden, PAPER_DEVICES, share)
        layer = ep_layer_ms(calib, cluster, spec, traffic, FWD)
    elif key == "hf_ep_all_to_all":
        traffic = measured_traffic("per_expert", tokens, float(spec.top_k), spec.top_k, spec.hidden, PAPER_DEVICES, share)
        layer = ep_layer_ms(calib, cluster, spec, traffic, FWD, "transformers")
    else:
        return None
    return prefill_ms(calib, spec, [layer] * spec.moe_layers, tokens)


def _finetune(calib: Calibration, spec: ModelSpec, key: str, ct: float | None, share: float | None) -> float | None:
    cluster, tokens, devices = Cluster(), FINETUNE_TOKENS, PAPER_DEVICES
    if key == "ddp":
        layer, held = stock_layer_ms(calib, spec, tokens, FWD_BWD), spec.params
        sync = allreduce_ms(calib, cluster, spec.params, devices, devices)
    elif key == "fsdp2":
        layer, held = stock_layer_ms(calib, spec, tokens, FWD_BWD), spec.params / devices
        sync = gathered_ms(calib, cluster, spec.params, devices, FWD_BWD)  # every decoder layer's, then the root's
    elif key in ("occult_exact", "occult_pruned"):
        traffic = measured_traffic("dedup", tokens, ct, spec.top_k, spec.hidden, devices, share)
        layer = ep_layer_ms(calib, cluster, spec, traffic, FWD_BWD)
        held = spec.other_params + spec.routed_params / devices
        sync = allreduce_ms(calib, cluster, spec.other_params, devices, devices)
    else:
        return None
    return train_step_ms(calib, spec, [layer] * spec.moe_layers, tokens, held, sync)


__all__ = ["Checked", "validate"]
