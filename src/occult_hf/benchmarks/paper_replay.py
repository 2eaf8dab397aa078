"""How a `bench paper` row's (token, expert) pairs split over its two ranks, redone on the CPU from the trace it replayed.

`bench paper` drives every router with a routing trace (`paper_routing.TraceReplay`): rank r's T tokens are the
trace's tokens r*T.. (tiled, `benchmarks.ep.trace_logits`), the refined placement is planned on rank 0's first
`paper_routing.PLAN_TOKENS` tokens (`paper_routing.planned_placement`), and N_d pruning keeps each token's best
devices. A row records the mean CT, not how the pairs split; the cost model's layer waits for the busier rank, and a
replayed trace with hot experts (the study model's) or one confined to one device per token (N_d = 1) loads one rank
more than the other. `replayed_split` redoes the replay with the bench's own functions and the library's pruning walk
(`traffic.pruned_routing`: a pruned pair is served on the token's kept device, as the router policy re-selects there)
and returns the busiest device's share of the pairs (mean over MoE layers: a step sums its layers) and the mean CT,
which equals the CT the row recorded when the replay is the bench's (tests/test_scale.py checks it).

`python -m occult_hf.benchmarks.paper_replay DOCS_DIR --routing-dir ../shared/data/routing` rewrites the cost model's
shipped measurements (`occult_hf.scale.measurements`) with these splits added, after new measurements land.

Shape legend (docs/conventions.md): N trace tokens, L trace layers, k experts per token, E experts, T tokens per rank.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from occult_hf.benchmarks.ep import trace_logits
from occult_hf.benchmarks.paper_models import PAPER_MODELS
from occult_hf.benchmarks.paper_routing import PLAN_TOKENS, RoutingRecorder, planned_placement
from occult_hf.placement.placement import contiguous_devices
from occult_hf.benchmarks import QWEN15_TRACE
from occult_hf.profile.replay import STUDY_TRACE, fit_routing, trace_layer
from occult_hf.profile.trace import read_trace_ids
from occult_hf.scale.measurements import QWEN_TRACE_NAME, SHIPPED, STUDY_TRACE_NAME, paper_tokens, read_measurements
from occult_hf.scale.specs import model_spec
from occult_hf.scale.traffic import pruned_routing
from occult_hf.utils.atomic import atomic_write_json

#: the placements `bench paper` runs: the planner its rows name (`--placement-method`, refined in every call) or none
PLACEMENTS = ("contiguous", "refined")
#: the seed `trace_logits` draws the non-trace logits with; they order only the experts a pruned token re-selects on
#: its kept device, never which device serves it, so the split does not depend on it
SEED = 0


@dataclass(frozen=True)
class ReplayedSplit:
    """`busiest_share`: the busiest device's share of a layer's pairs (mean over MoE layers); `ct`: the mean CT."""

    busiest_share: float
    ct: float


def replayed_split(
    trace_path: str | os.PathLike, model: str, tokens: int, placement: str, max_devices_per_token: int | None = None,
    num_devices: int = 2,
) -> ReplayedSplit:
    """The split of `model`'s pairs when `bench paper` replays `trace_path` at `tokens` per rank (module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    spec = model_spec(model)
    trace_NLk = _trace(os.fspath(trace_path), model)
    layers = [trace_layer(index, spec.moe_layers, trace_NLk.shape[1]) for index in range(spec.moe_layers)]
    device_of = _planned(os.fspath(trace_path), model, num_devices) if placement == "refined" else None
    shares, cts = {}, {}
    for layer in set(layers):
        device_E = contiguous_devices(spec.num_experts, num_devices) if device_of is None else device_of[layer]
        pairs_D, reached = np.zeros(num_devices), 0.0
        for rank in range(num_devices):
            ids_Tk, weights_Tk = _routing(trace_NLk[:, layer], spec.num_experts, spec.top_k, tokens, rank)
            device_Tk, _ = pruned_routing(ids_Tk, weights_Tk, device_E, num_devices, num_devices, max_devices_per_token)
            pairs_D += np.bincount(device_Tk.ravel(), minlength=num_devices)
            reached += (device_Tk[:, :, None] == np.arange(num_devices)).any(1).sum(1).mean()
        shares[layer], cts[layer] = pairs_D.max() / pairs_D.sum(), reached / num_devices
    return ReplayedSplit(float(np.mean([shares[l] for l in layers])), float(np.mean([cts[l] for l in layers])))


@functools.lru_cache(maxsize=None)
def _trace(path: str, model: str) -> np.ndarray:
    """`[N, L, k]` expert ids of the trace, fitted to the model's E and k as `bench paper` fits them."""
    spec = model_spec(model)
    ids_NLk, _, meta = read_trace_ids(path)
    ids_NLk, _ = fit_routing(ids_NLk, meta, path, spec.num_experts, spec.top_k)
    return ids_NLk


def _routing(trace_Nk: np.ndarray, num_experts: int, top_k: int, tokens: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """`([T, k] ids, [T, k] weights)` rank `rank`'s router chooses from the replayed logits."""
    logits_TE = trace_logits(trace_Nk, num_experts, tokens, rank, "cpu", SEED)
    weights_Tk, ids_Tk = torch.topk(logits_TE.softmax(-1), top_k, dim=-1)
    return ids_Tk.numpy(), weights_Tk.numpy()


@functools.lru_cache(maxsize=None)
def _planned(path: str, model: str, num_devices: int) -> dict[int, np.ndarray]:
    """`{trace layer: [E] device}`: `bench paper`'s refined placement, planned on rank 0's first PLAN_TOKENS tokens."""
    spec, trace_NLk = model_spec(model), _trace(path, model)
    recorder = RoutingRecorder()
    for layer in sorted({trace_layer(index, spec.moe_layers, trace_NLk.shape[1]) for index in range(spec.moe_layers)}):
        ids_Tk, _ = _routing(trace_NLk[:, layer], spec.num_experts, spec.top_k, PLAN_TOKENS, 0)
        recorder.ids[layer] = [torch.as_tensor(ids_Tk)]
    placement = planned_placement(recorder, PAPER_MODELS[model].config("full"), num_devices, "refined")
    return {layer: np.asarray(placement.layers[layer], dtype=np.int64) for layer in recorder.ids}


__all__ = ["PLACEMENTS", "ReplayedSplit", "replayed_split"]


def replayed_splits(measurements: dict, docs_dir: str | os.PathLike, routing_dir: str | os.PathLike | None) -> list[dict]:
    """`replayed_split` of every expert-parallel `bench paper` configuration whose trace is found: the study trace in
    docs/ (`STUDY_TRACE`), the Qwen1.5 trace in `routing_dir` (`QWEN15_TRACE`'s file)."""
    paths = {STUDY_TRACE_NAME: Path(docs_dir) / Path(STUDY_TRACE).relative_to("docs")}
    if routing_dir is not None:
        paths[QWEN_TRACE_NAME] = Path(routing_dir) / os.path.basename(QWEN15_TRACE)
    configurations = sorted({
        (row["model"], row["trace"], paper_tokens(row), row["placement"], row["max_devices_per_token"] or 0)
        for row in measurements["whole_models"]
        if row["placement"] is not None and row["trace"] in paths and paths[row["trace"]].is_file()
    })  # fmt: skip
    splits = []
    for model, trace, tokens, placement, limit in configurations:
        split = replayed_split(paths[trace], model, tokens, placement, limit or None)
        splits.append({
            "model": model, "trace": trace, "tokens": tokens, "placement": placement, "max_devices_per_token": limit or None,
            "busiest_share": split.busiest_share, "ct": split.ct,
        })  # fmt: skip
    return splits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Rewrite the cost model's shipped measurements from a docs/ folder.")
    parser.add_argument("docs_dir", help="the repository's docs/ folder")
    parser.add_argument("--routing-dir", default=None, help="the folder of the Qwen1.5 trace (../shared/data/routing)")
    parser.add_argument("--out", default=str(SHIPPED), help="where to write (default: the package's shipped file)")
    args = parser.parse_args(argv)
    measurements = read_measurements(args.docs_dir)
    measurements["replayed_splits"] = replayed_splits(measurements, args.docs_dir, args.routing_dir)
    atomic_write_json(args.out, measurements)
    print(f"wrote {args.out} ({len(measurements['replayed_splits'])} replayed splits)")


if __name__ == "__main__":
    main()
