"""The H200 measurements the cost model is calibrated on, read from the project's benchmark files in docs/.

`read_measurements(docs_dir)` collects, from the files each benchmark wrote (`SOURCES`), the points the
model needs and nothing else:

* ``expert_kernels``: `occult bench experts` on one H200 (session 9): forward and forward+backward ms of the
  local expert computation per (shape, T, implementation), transformers' `grouped_mm` experts with the version
  that ran (5.17 at every T, 5.24 at T = 16384);
* ``ep_layers``: `occult bench ep` on two NVLink H200s: one MoE layer's forward and forward+backward ms, CT,
  the bytes sent and the wire time, per (shape, T, dispatcher, mode), with transformers' EP beside them;
* ``model_blocks``: `occult bench model`'s stock 4-layer models (one H200): what the rest of a decoder layer costs;
* ``whole_models``: `occult bench paper` on two H200s: whole-model prefill and fine-tuning rows, with the placement
  (contiguous or refined), N_d and the trace each row replayed;
* ``shared_expert_ms``: the Qwen1.5 shared experts' GPU time in session 6's profile (docs text, one number);
* ``replayed_splits`` (not `read_measurements`'s: `benchmarks.paper_replay` adds them, planning placements for
  seconds of CPU): how each expert-parallel `bench paper` configuration's pairs split over its two ranks, redone
  from the trace it replayed; a configuration whose trace is absent (the Qwen1.5 trace is third-party data, passed
  as `--routing-dir`) has none.

The package ships the result as `h200_measurements.json` (`load_measurements()`), so the model runs where docs/
is absent; `python -m occult_hf.benchmarks.paper_replay DOCS_DIR --routing-dir ROUTING_DIR` rewrites it after
new measurements land, and tests/test_scale.py checks that the shipped file equals what docs/ holds.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from ..profile.replay import STUDY_TRACE
from ..utils.strict_json import read_json_file

FORMAT = "occult_hf.scale.measurements/1"
SHIPPED = Path(__file__).with_name("h200_measurements.json")

#: the benchmark files read, relative to docs/
EXPERT_KERNEL_FILES = (
    "bench_experts_results/session9_2026-12-01/t517_olmoe_qwen.json",
    "bench_experts_results/session9_2026-12-01/t517_deepseek.json",
    "bench_experts_results/session9_2026-12-01/t524_16384.json",
)
EP_LAYER_FILES = (
    "bench_ep_h200_2gpu.json",
    "bench_ep_results/final_2026-11-30/bench_ep_2xcuda.json",
    "bench_ep_results/session5_2026-12-01/bench_ep_2xcuda.json",
    "bench_ep_results/symm_mem_2026-11-30/bench_ep_2xcuda.json",
)
MODEL_BLOCK_FILE = "bench_ep_results/session6_2026-12-01/bench_model_call2.json"
PAPER_FILES = (
    "paper_results/call1/paper_comparison_2xcuda.json",
    "paper_results/call2/rerun/paper_comparison_2xcuda.json",
    "paper_results/call2/deepseek/paper_comparison_2xcuda.json",
    "paper_results/megablocks_call1/paper_comparison_2xcuda.json",
    "paper_results/megablocks_call2/paper_comparison_2xcuda.json",
)
#: `bench paper`'s batches (docs/paper_comparison.md): 4 x 4096 tokens per rank in prefill, 8 x 1024 over two
#: ranks in fine-tuning
PREFILL_TOKENS, FINETUNE_TOKENS, PAPER_DEVICES = 16384, 4096, 2
#: call 3 wrote no JSON (its tables are in the log): `[  3 s] prefill deepseek-moe-16b stock_1gpu: ran, 252.5 ms`
PAPER_LOG = "paper_results/call3/log.txt"
PROFILE_TEXT = "bench_ep_h200_2gpu.md"
SOURCES = EXPERT_KERNEL_FILES + EP_LAYER_FILES + (MODEL_BLOCK_FILE,) + PAPER_FILES + (PAPER_LOG, PROFILE_TEXT)

#: call 2's DeepSeek baselines ran transformers' per-expert `eager` loop (docs/paper_comparison.md, call 2):
#: superseded by call 3, left out
SUPERSEDED = {("paper_results/call2/deepseek/paper_comparison_2xcuda.json", key)
              for key in ("stock_1gpu", "device_map_auto", "hf_ep_all_to_all", "hf_ep_all_reduce", "fsdp2", "ddp")}  # fmt: skip
_LOG_ROW = re.compile(r"^\[\s*\d+ s\] (prefill|finetune) (\S+) (\S+): ran, ([0-9.]+) ms$")
#: the log's own tables: `| model | setup | routing | tokens | ms | ... | CT | ...` under `### prefill` / `### finetune`
_LOG_SECTION = re.compile(r"^### (prefill|finetune)$")
#: the traces `bench paper` rows name in their routing label, by file name: where each is found
STUDY_TRACE_NAME, QWEN_TRACE_NAME = os.path.basename(STUDY_TRACE), "qwen_trace.npz"
#: N_d of the pruned rows (`occult_nd2` at D = 2 prunes nothing but runs the walk)
PRUNED_KEYS = {"occult_nd1": 1, "occult_nd2": 2, "occult_pruned": 1}
#: the expert-parallel rows whose pairs split over the two ranks (the others run every expert on one GPU)
EP_KEYS = ("occult_per_expert", "occult_contiguous", "occult_placed", "occult_nd2", "occult_nd1", "occult_exact",
           "occult_pruned", "hf_ep_all_to_all")  # fmt: skip
_SHARED_ROW = re.compile(r"^\| shared experts \| - \| - \| ([0-9.]+) \(the same modules\) \| ([0-9.]+) \|$")


def read_measurements(docs_dir: str | os.PathLike) -> dict[str, Any]:
    """The measured points of every file in `SOURCES` under `docs_dir` (see the module docstring)."""
    docs = Path(docs_dir)
    missing = [name for name in SOURCES if not (docs / name).is_file()]
    if missing:
        raise FileNotFoundError(f"measurement files missing under {str(docs)!r}: {', '.join(missing)}")
    return {
        "format": FORMAT,
        "expert_kernels": [row for name in EXPERT_KERNEL_FILES for row in _expert_kernels(docs, name)],
        "ep_layers": [row for name in EP_LAYER_FILES for row in _ep_layers(docs, name)],
        "model_blocks": _model_blocks(docs, MODEL_BLOCK_FILE),
        "whole_models": [row for name in PAPER_FILES for row in _paper_rows(docs, name)] + _paper_log_rows(docs, PAPER_LOG),
        "shared_expert_ms": _shared_expert_ms(docs, PROFILE_TEXT),
    }


def load_measurements(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The measurements: the shipped file by default, else `path` (a docs/ folder, or a file this module wrote),
    checked field by field (`check_measurements`) so that a bad one is refused before any fit, naming the field."""
    path = SHIPPED if path is None else Path(path)
    if path.is_dir():
        return check_measurements(read_measurements(path), f"measurements read from {str(path)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"measurements {str(path)!r}: no such file or docs/ folder")
    data = read_json_file(path, "measurements")
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise ValueError(f"measurements {str(path)!r}: not a {FORMAT} file (its 'format' is {found!r})")
    return check_measurements(data, f"measurements {str(path)!r}")


#: the fields the calibration and validation read, per part: "text", "count" (an integer >= 1), "ms" (a finite
#: number > 0), "number" (finite); a trailing "?" also allows null. "replayed_splits" may be absent.
FIELDS: dict[str, dict[str, str]] = {
    "expert_kernels": {"shape": "text", "tokens": "count", "implementation": "text", "transformers": "text",
                       "fwd_ms": "ms", "fwd_bwd_ms": "ms"},
    "ep_layers": {"source": "text", "when": "text", "shape": "text", "tokens": "count", "routing": "text",
                  "dispatcher": "text", "mode": "text", "ct": "number?", "sent_mb_max": "number?", "wire_ms": "ms?",
                  "fwd_ms": "ms", "fwd_bwd_ms": "ms"},
    "model_blocks": {"source": "text", "shape": "text", "tokens": "count", "layers": "count", "fwd_ms": "ms", "fwd_bwd_ms": "ms"},
    "whole_models": {"source": "text", "experiment": "text", "model": "text", "key": "text", "ms": "ms", "ct": "number?",
                     "placement": "text?", "max_devices_per_token": "count?", "trace": "text?"},
    "shared_expert_ms": {"source": "text", "shape": "text", "tokens": "count", "layers": "count", "ms": "ms"},
    "replayed_splits": {"model": "text", "trace": "text", "tokens": "count", "placement": "text",
                        "max_devices_per_token": "count?", "busiest_share": "number", "ct": "number"},
}  # fmt: skip
_KINDS = {"text": "a string", "count": "an integer >= 1", "ms": "a finite number > 0", "number": "a finite number"}
_SINGLE_PARTS = ("shared_expert_ms",)
_OPTIONAL_PARTS = ("replayed_splits",)


def check_measurements(data: dict[str, Any], label: str) -> dict[str, Any]:
    """Return `data` or raise naming `label` and the first part, row and field that is missing or of the wrong kind
    (`FIELDS`): a null or text time would otherwise fail inside a fit, far from its cause."""
    for part, fields in FIELDS.items():
        if part not in data:
            if part in _OPTIONAL_PARTS:
                continue
            raise ValueError(f"{label}: no {part!r} part (it needs {', '.join(p for p in FIELDS if p not in _OPTIONAL_PARTS)})")
        rows = [data[part]] if part in _SINGLE_PARTS else data[part]
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            kind = "an object" if part in _SINGLE_PARTS else "a list of objects"
            raise ValueError(f"{label}: {part!r} must be {kind}")
        for index, row in enumerate(rows):
            where = part if part in _SINGLE_PARTS else f"{part}[{index}]"
            for name, kind in fields.items():
                if name not in row:
                    raise ValueError(f"{label}: {where} has no {name!r}")
                if not _of_kind(row[name], kind):
                    raise ValueError(f"{label}: {where}.{name} is {row[name]!r}; expected {_KINDS[kind.rstrip('?')]}"
                                     + (" or null" if kind.endswith("?") else ""))  # fmt: skip
    return data


def _of_kind(value: Any, kind: str) -> bool:
    """Whether `value` is of `kind` (`FIELDS`); a bool is no number (JSON's true is not a time)."""
    if value is None:
        return kind.endswith("?")
    kind = kind.rstrip("?")
    if kind == "text":
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "count":
        return isinstance(value, int) and value >= 1
    return math.isfinite(value) and (kind == "number" or value > 0)


def _read(docs: Path, name: str) -> dict:
    return read_json_file(docs / name, f"benchmark file {str(docs / name)!r}", allow_nan=True)


def _finite(value) -> float | None:
    return None if value is None or value != value else float(value)


def _expert_kernels(docs: Path, name: str) -> list[dict]:
    data = _read(docs, name)
    version = re.search(r"transformers (\d+\.\d+)", data["machine"])
    if version is None:
        raise ValueError(f"{name}: its 'machine' line names no transformers version: {data['machine']!r}")
    return [
        {"source": name, "transformers": version.group(1), "shape": row["shape"], "tokens": row["tokens"],
         "implementation": row["implementation"], "fwd_ms": row["fwd_ms"], "fwd_bwd_ms": row["fwd_bwd_ms"]}
        for row in data["measurements"]
        if _finite(row["fwd_ms"]) is not None and _finite(row["fwd_bwd_ms"]) is not None
    ]  # fmt: skip


def _ep_layers(docs: Path, name: str) -> list[dict]:
    data = _read(docs, name)
    when = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", data["header"])
    return [
        {"source": name, "when": when.group(0) if when else "", "shape": row["shape"], "tokens": row["tokens_per_rank"],
         "routing": row["routing"], "dispatcher": row["dispatcher"], "mode": row["mode"], "ct": _finite(row["ct"]),
         "sent_mb_max": _finite(row["sent_mb_max"]), "wire_ms": _finite(row.get("wire_ms")),
         "fwd_ms": row["fwd_ms"], "fwd_bwd_ms": row["fwd_bwd_ms"]}
        for row in data["rows"]
    ]  # fmt: skip


def _model_blocks(docs: Path, name: str) -> list[dict]:
    data = _read(docs, name)
    return [
        {"source": name, "shape": row["shape"], "tokens": row["tokens"], "layers": row["layers"],
         "fwd_ms": row["fwd_ms"], "fwd_bwd_ms": row["fwd_bwd_ms"]}
        for row in data["rows"] if row["implementation"] == "stock"
    ]  # fmt: skip


def _paper_rows(docs: Path, name: str) -> list[dict]:
    data = _read(docs, name)
    return [
        {"source": name, "experiment": row["experiment"], "model": row["model"], "key": row["key"],
         "ms": row["ms"], "ct": _finite(row["ct"]), **_paper_setup(row["key"], row["setup"], row["routing"])}
        for row in data["rows"]
        if _finite(row["ms"]) is not None and (name, row["key"]) not in SUPERSEDED
    ]  # fmt: skip


def _paper_setup(key: str, setup: str, routing: str) -> dict:
    """The row's placement (transformers' EP: its contiguous experts), N_d and replayed trace (file name or None)."""
    named = re.search(r"\b(contiguous|refined)\b", setup)
    trace = re.match(r"trace (\S+)", routing)
    placement = None
    if key == "hf_ep_all_to_all":
        placement = "contiguous"
    elif named is not None and key in EP_KEYS:
        placement = named.group(1)
    return {
        "placement": placement,
        "max_devices_per_token": PRUNED_KEYS.get(key),
        "trace": trace.group(1) if trace else None,
    }  # fmt: skip


def _paper_log_rows(docs: Path, name: str) -> list[dict]:
    """The `[ N s] EXPERIMENT MODEL KEY: ran, MS ms` lines, with the setup, routing and CT of the log's table row of
    the same experiment, model and ms (a row the log printed no table for has none)."""
    lines = (docs / name).read_text(encoding="utf-8").splitlines()
    tables, section = {}, None
    for line in lines:
        header = _LOG_SECTION.match(line.strip())
        section = header.group(1) if header else section
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if section and len(cells) > 7 and re.fullmatch(r"[0-9.]+", cells[4]):
            tables[(section, cells[0], cells[4])] = cells
    rows = []
    for line in lines:
        match = _LOG_ROW.match(line.strip())
        if match:
            experiment, model, key, ms = match.groups()
            cells = tables.get((experiment, model, ms))
            setup, routing, ct = (cells[1], cells[2], _number(cells[7])) if cells else ("", "", None)
            rows.append({"source": name, "experiment": experiment, "model": model, "key": key, "ms": float(ms), "ct": ct,
                         **_paper_setup(key, setup, routing)})  # fmt: skip
    if not rows:
        raise ValueError(f"{name}: no row line of the form '[ N s] prefill MODEL KEY: ran, MS ms'")
    return rows


def _number(text: str) -> float | None:
    return float(text) if re.fullmatch(r"[0-9.]+", text) else None


def paper_tokens(row: dict) -> int:
    """Tokens per rank of a `bench paper` row."""
    return PREFILL_TOKENS if row["experiment"] == "prefill" else FINETUNE_TOKENS


def _shared_expert_ms(docs: Path, name: str) -> dict:
    for line in (docs / name).read_text(encoding="utf-8").splitlines():
        match = _SHARED_ROW.match(line.strip())
        if match:
            return {"source": name, "shape": "qwen1.5-moe-a2.7b", "tokens": 16384, "layers": 4, "ms": float(match.group(2))}
    raise ValueError(f"{name}: no profile row '| shared experts | - | - | MS (the same modules) | MS |'")
