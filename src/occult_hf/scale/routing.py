"""The routing a projection replays: a per-token trace fitted to the model, split into a planning and a held-out half.

`load_routing` reads a trace file through the project's reader (`profile.trace`: its row mask applied, its weights
where it has them). `fit_to_model` adapts it to the model's E and k:

* the same E and k: as recorded;
* the same E, a larger k in a score-ordered file: each token's first k (`profile.replay.fit_routing`, as
  the paper bench replays the study trace for DeepSeek-MoE-16B);
* E a multiple m of the trace's, the same k: `synthetic.split_experts` (each expert split into m; how DeepSeek-V3's
  256-expert routing is made from the study model's 64).

Placements are planned on one half of the tokens and every figure is measured on the other (`Routing.halves`):
alternate windows of 128 tokens, so that both halves hold every part of the trace (the study trace's three text
domains, one after the other in the file; the Qwen trace's prompts and then its decoding) and a plan never scores
the tokens it was planned on. (Split into first and second half instead, the halves differ in kind: a plan made
on two domains and measured on the third balances worse held out: docs/scale.md, "The model".)

Shape legend (docs/conventions.md): N tokens, k experts per token, E experts; local to this file: L trace layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from ..profile.replay import fit_routing
from ..placement.validation import profile_from_sample
from ..profile.trace import read_trace_ids, read_trace_weights
from .specs import ModelSpec
from .synthetic import split_experts

#: tokens per window of the planning / held-out split (`Routing.halves`)
HALF_WINDOW = 128


@dataclass(frozen=True)
class Routing:
    """Per-token routing of `L` layers: ids `[N, L, k]` int64 and, where recorded, their weights (float32, same shape)."""

    source: str
    ids_NLk: np.ndarray
    weights_NLk: np.ndarray | None
    num_experts: int
    score_ordered: bool = False  # each row in its router's score order (what orders pruning without weights)
    experts_inferred: bool = False  # E is the largest id + 1 (the file records no n_experts)

    @property
    def top_k(self) -> int:
        return self.ids_NLk.shape[2]

    @property
    def layers(self) -> int:
        return self.ids_NLk.shape[1]

    def _select(self, index, what: str) -> "Routing":
        """The ids (and weights) `index` selects, `what` added to the source."""
        weights = None if self.weights_NLk is None else self.weights_NLk[index]
        return replace(self, source=f"{self.source}, {what}", ids_NLk=self.ids_NLk[index], weights_NLk=weights)

    def select_layers(self, layers: list[int]) -> "Routing":
        """Only the trace layers `layers` (in that order)."""
        bad = [layer for layer in layers if not 0 <= layer < self.layers]
        if bad or not layers:
            raise ValueError(f"trace layers {layers} of {self.source!r}: each must lie in [0, {self.layers}) and at least one is needed")
        return self._select((slice(None), layers), f"layers {layers}")

    def check_halves(self, window: int = HALF_WINDOW) -> None:
        """Raise unless the routing holds two `window`-token windows (`halves`): checked before any projection runs."""
        if self.ids_NLk.shape[0] < 2 * window:
            raise ValueError(f"routing {self.source!r} has {self.ids_NLk.shape[0]} token(s): fewer than two {window}-token windows")

    def halves(self, window: int = HALF_WINDOW) -> tuple["Routing", "Routing"]:
        """(the tokens of the even `window`-token windows, to plan on; those of the odd ones, held out)."""
        self.check_halves(window)
        odd_N = (np.arange(self.ids_NLk.shape[0]) // window) % 2 == 1
        return self._select(~odd_N, "planning half"), self._select(odd_N, "held-out half")

    def profile(self, layer: int):
        """A `RoutingProfile` of one layer's tokens (as its sample) for the planners."""
        return profile_from_sample({0: self.ids_NLk[:, layer]}, self.num_experts, f"{self.source}, layer {layer}")

    def weights(self, layer: int) -> np.ndarray | None:
        return None if self.weights_NLk is None else self.weights_NLk[:, layer]


def load_routing(path: str | os.PathLike, name: str | None = None) -> Routing:
    """A per-token trace file as `Routing` (E: its meta's `n_experts`, else its largest id + 1), called `name` in
    titles and errors (default: the file's name)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"routing trace {path!r} is a directory; give a per-token trace file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"routing trace {path!r} not found")
    ids_NLk, _, meta = read_trace_ids(path)
    if not ids_NLk.size:
        raise ValueError(f"routing trace {path!r} holds no routed token (ids of shape {list(ids_NLk.shape)})")
    if (ids_NLk < 0).any():
        raise ValueError(f"routing trace {path!r} has missing (negative) expert ids; the cost model needs complete rows")
    inferred = "n_experts" not in meta
    num_experts = int(ids_NLk.max() + 1 if inferred else meta["n_experts"])
    return Routing(os.path.basename(path) if name is None else name, ids_NLk, read_trace_weights(path), num_experts,
                   bool(meta.get("score_ordered")), inferred)  # fmt: skip


def fit_to_model(routing: Routing, spec: ModelSpec, seed: int = 0) -> Routing:
    """`routing` adapted to the model's E and k (module docstring); anything else is an error that says why."""
    if routing.num_experts == spec.num_experts:
        meta = {"score_ordered": routing.score_ordered}
        ids, how = fit_routing(routing.ids_NLk, meta, routing.source, spec.num_experts, spec.top_k)
        if not how:
            return routing
        weights = None if routing.weights_NLk is None else routing.weights_NLk[:, :, : spec.top_k]
        return replace(routing, source=f"{routing.source} ({how})", ids_NLk=np.ascontiguousarray(ids), weights_NLk=weights)
    factor, rest = divmod(spec.num_experts, routing.num_experts)
    if rest or factor < 2 or routing.top_k != spec.top_k:
        inferred = " (the trace's E is its largest expert id + 1: its file records no n_experts)" if routing.experts_inferred else ""
        raise ValueError(
            f"routing {routing.source!r} (E={routing.num_experts}, k={routing.top_k}) does not fit {spec.name} "
            f"(E={spec.num_experts}, k={spec.top_k}): the model's E must equal the trace's, or be a multiple of it with the same k{inferred}"
        )
    ids = split_experts(routing.ids_NLk, routing.num_experts, factor, seed=seed)
    source = f"{routing.source}, each expert split into {factor} (synthetic, scale.synthetic)"
    return Routing(source, ids, routing.weights_NLk, spec.num_experts, routing.score_ordered)


__all__ = ["Routing", "fit_to_model", "load_routing"]
