"""Routing for `occult bench paper`: every router of every row replays a per-token trace (`TraceReplay`), the routing
a model ran is recorded (`RoutingRecorder`), and the placed rows' placement is planned on it (`planned_placement`).

Shape legend: N trace tokens, L trace layers, T tokens, E routed experts, k experts per token.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from occult_hf.benchmarks.ep import trace_logits
from occult_hf.profile.replay import fit_routing, trace_layer
from occult_hf.profile.trace import read_trace_ids


class TraceReplay:
    """Forward hooks on every MoE router of a model that replace its choice by a routing trace's.

    The hooked router's output `(logits_TE, weights_Tk, ids_Tk)` becomes: logits whose top-k are the
    trace's expert set of each token (`ep.trace_logits`; MoE layer i of M reads trace layer i*L//M of
    `trace_NLk`, rank `window` reads tokens window*T.., tiled), plus zero times the router's own logits (so the router stays in the autograd graph and
    DDP sees its gradient), and the family's own selection and weight rule applied to them
    (`adapter.select`). Stock blocks, occult_hf's blocks (which keep the router instance) and
    transformers' EP all call the router module, so all of them route alike. Logits are cached per
    (layer, T, device, dtype): the replay costs no host work inside a timed call after the first.
    """

    def __init__(self, trace_NLk: np.ndarray, window: int, seed: int) -> None:
        self.trace_NLk = trace_NLk
        self.window = window
        self.seed = seed
        self._cache: dict = {}

    def attach(self, model) -> list:
        from occult_hf.patches import adapter_for

        adapter = adapter_for(model)
        blocks = list(adapter.iter_moe_blocks(model))
        handles = []
        for moe_index, (layer, _, block) in enumerate(blocks):
            router = adapter.router(block)
            trace_Nk = self.trace_NLk[:, trace_layer(moe_index, len(blocks), self.trace_NLk.shape[1])]
            handles.append(router.register_forward_hook(self._hook(adapter, block, layer, trace_Nk)))
        return handles

    def _hook(self, adapter, block, layer: int, trace_Nk: np.ndarray):
        def hook(router, inputs, output):
            own_TE = output[0]
            key = (layer, own_TE.shape[0], own_TE.device, own_TE.dtype, self.window)
            if key not in self._cache:
                replay_TE = trace_logits(trace_Nk, own_TE.shape[1], own_TE.shape[0], self.window, own_TE.device, self.seed + layer)
                self._cache[key] = replay_TE.to(own_TE.dtype)
            logits_TE = self._cache[key] + 0 * own_TE
            allowed_TE = torch.ones_like(logits_TE, dtype=torch.bool)
            weights_Tk, ids_Tk = adapter.select(block, logits_TE, allowed_TE)
            return logits_TE, weights_Tk, ids_Tk

        return hook


class RoutingRecorder:
    """Forward hooks that keep each MoE layer's `[T, k]` expert ids (the router's output, replayed or own)."""

    def __init__(self) -> None:
        self.ids: dict[int, list[torch.Tensor]] = {}

    def attach(self, model) -> list:
        from occult_hf.patches import adapter_for

        adapter = adapter_for(model)
        return [
            adapter.router(block).register_forward_hook(self._hook(layer)) for layer, _, block in adapter.iter_moe_blocks(model)
        ]

    def _hook(self, layer: int):
        def hook(router, inputs, output):
            self.ids.setdefault(layer, []).append(output[2].detach().cpu())

        return hook


def detach(handles) -> None:
    """Remove the forward hooks `handles` (of `TraceReplay.attach` or `RoutingRecorder.attach`)."""
    for handle in handles:
        handle.remove()


def routing_for(name: str, config, traces: dict[str, str]) -> tuple[np.ndarray | None, str]:
    """`(trace ids [N, L, k] or None, routing label)` for model `name`: its trace, fitted to its E and k."""
    from occult_hf.patches import adapter_for

    adapter = adapter_for(config)
    num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
    path = traces.get(name)
    if path is None:
        return None, f"own router (random weights: no co-activation structure; E={num_experts}, k={top_k})"
    ids_NLk, _, meta = read_trace_ids(path)
    try:
        ids_NLk, adapted = fit_routing(ids_NLk, meta, path, num_experts, top_k)
    except ValueError as error:
        raise ValueError(f"--trace {name}={path}: {error}") from error
    layers = "its one layer at every layer" if ids_NLk.shape[1] == 1 else f"its {ids_NLk.shape[1]} layers in depth order"
    source = " (the project's study model, E=64 top-8: docs/quality.md)" if meta.get("format", "").startswith("occult_hf.paper_routing") else ""
    return ids_NLk, f"trace {os.path.basename(path)}{source} replayed ({ids_NLk.shape[0]} real tokens; {layers}{'; ' + adapted if adapted else ''})"


# ----- placement -------------------------------------------------------------------------------
#: tokens per layer the placement is planned on: the first of rank 0's batch. A replayed trace tiles a few
#: thousand real tokens (4,384 of Qwen, 6,144 of the study model), so more would mostly be copies, and the
#: refined planner's time grows with them (about 1 s a layer at 4,096 tokens on one CPU core)
PLAN_TOKENS = 4096


def planned_placement(recorder: RoutingRecorder, config, world: int, method: str):
    """A placement of `method` planned on the first `PLAN_TOKENS` tokens of the routing rank 0 recorded
    (every MoE layer), broadcast."""
    from occult_hf.patches import adapter_for
    from occult_hf.placement import Placement, plan_placement
    from occult_hf.profile import LayerAccumulator, RoutingProfile

    adapter = adapter_for(config)
    num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
    holder = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        layers = {}
        for layer, chunks in sorted(recorder.ids.items()):
            accumulator = LayerAccumulator(num_experts, top_k, sample_size=None)
            accumulator.update(torch.cat(chunks)[:PLAN_TOKENS].to(torch.int64))
            layers[layer] = accumulator.to_layer_routing()
        profile = RoutingProfile(num_experts, top_k, layers, model_type=config.model_type)
        holder = [plan_placement(profile, world, method, progress=False).to_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return Placement.from_dict(holder[0])
