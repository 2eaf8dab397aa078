"""Routing profiles: per-layer co-activation statistics of a real router (DESIGN.md §2, §6).

A `RoutingProfile` is made three ways, all through the same `LayerAccumulator` counting:
`RoutingProfile.collect` (forward hooks on a model's own routers over a text file or a dataset),
`ProfileCollector` (the same hooks around forwards you run yourself, e.g. training batches) and
`RoutingProfile.from_trace` (a recorded `.npz` trace). It is saved as safetensors:

    layer.{l}.coactivation  [E, E] int64   tokens whose top-k holds both i and j (zero diagonal)
    layer.{l}.expert_counts [E]    int64   tokens routed to each expert
    layer.{l}.token_count   []     int64   tokens counted
    layer.{l}.logit_gram    [E, E] float64 sum of logits logits^T (absent for traces)
    layer.{l}.topk_sample   [N, k] int64   uniform sample of per-token expert sets (optional)

with one metadata entry `occult_profile` holding JSON: format, model_type, num_experts, top_k,
layers, source and free-form meta.

Shape legend: E routed experts, k experts per token, N sampled tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: metadata key and format tag of profile files
PROFILE_METADATA_KEY = "occult_profile"
PROFILE_FORMAT = "occult_hf.routing_profile/1"


@dataclass
class LayerRouting:
    """Routing statistics of one MoE layer.

    Attributes:
        coactivation: `[E, E]` int64, tokens whose top-k holds both i and j; symmetric, zero diagonal.
        expert_counts: `[E]` int64, tokens routed to each expert.
        token_count: tokens observed.
        logit_gram: `[E, E]` float64 Gram matrix of the router logits (sum over tokens of l l^T), or None.
        topk_sample: `[N, k]` int64 uniform sample of real per-token expert sets, or None (pair counts only).
    """

    coactivation: np.ndarray
    expert_counts: np.ndarray
    token_count: int
    logit_gram: np.ndarray | None = None
    topk_sample: np.ndarray | None = None


@dataclass
class RoutingProfile:
    """Per-layer `LayerRouting` for one model, keyed by decoder-layer index.

    `meta["source"]` says where the routing came from (a model and data, or a trace file).
    """

    num_experts: int
    top_k: int
    layers: dict[int, LayerRouting]
    model_type: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"RoutingProfile.num_experts must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"RoutingProfile.top_k must be an integer in [1, num_experts={self.num_experts}], got {self.top_k!r}"
            )
        if not self.layers:
            raise ValueError("RoutingProfile.layers is empty: a profile needs at least one MoE layer")
        self.layers = {int(l): r for l, r in sorted(self.layers.items())}
        square = (self.num_experts, self.num_experts)
        for l, r in self.layers.items():
            _check_shape(f"layer {l} coactivation", r.coactivation, square)
            _check_shape(f"layer {l} expert_counts", r.expert_counts, (self.num_experts,))
            if r.logit_gram is not None:
                _check_shape(f"layer {l} logit_gram", r.logit_gram, square)
            if r.topk_sample is not None and (r.topk_sample.ndim != 2 or r.topk_sample.shape[1] != self.top_k):
                raise ValueError(
                    f"RoutingProfile layer {l} topk_sample has shape {r.topk_sample.shape}, expected [N, top_k={self.top_k}]"
                )

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def collect(cls, model, data, tokenizer=None, **options) -> "RoutingProfile":
        """Profile a model's routing over text or token ids with forward hooks on its own routers.

        `data`: a path to a text file, a list of strings or of token-id lists, or a `datasets.Dataset`.
        Options (`batch_size`, `max_length`, `sample_size`, `seed`, `max_tokens`, `text_column`,
        `separator`, `progress`) are documented on `occult_hf.profile_collect.collect_profile`.
        """
        from .profile_collect import collect_profile

        return collect_profile(model, data, tokenizer=tokenizer, **options)

    @classmethod
    def from_trace(cls, path: str | os.PathLike, **options) -> "RoutingProfile":
        """A profile from a recorded routing trace (`.npz`); see `occult_hf.profile_trace.profile_from_trace`."""
        from .profile_trace import profile_from_trace

        return profile_from_trace(path, **options)

    # ----- queries ------------------------------------------------------------------------
    def layer(self, layer: int) -> LayerRouting:
        try:
            return self.layers[int(layer)]
        except KeyError:
            raise KeyError(f"routing profile has no layer {layer}; it covers layers {sorted(self.layers)}") from None

    @property
    def has_samples(self) -> bool:
        """True when every layer holds a per-token top-k sample (exact CT can be measured)."""
        return all(r.topk_sample is not None and len(r.topk_sample) > 0 for r in self.layers.values())

    def similarity(self, layer: int) -> np.ndarray:
        """`[E, E]` float64 cosine similarity of the experts' router-logit columns at `layer` (DESIGN.md §2 `S[l]`).

        From the logit Gram matrix `G`: `S[i, j] = G[i, j] / sqrt(G[i, i] G[j, j])`. An expert whose
        logits were all zero has similarity 0 to every other expert and 1 to itself.
        """
        gram = self.layer(layer).logit_gram
        if gram is None:
            raise ValueError(
                f"routing profile layer {layer} has no router-logit Gram matrix (source: {self.meta.get('source')!r}); "
                f"the similarity table needs a profile collected from a model (`occult profile MODEL ...`), "
                f"not from a trace of expert ids"
            )
        norms_E = np.sqrt(np.clip(np.diagonal(gram), 0.0, None))
        outer_EE = np.outer(norms_E, norms_E)
        similarity = np.divide(gram, outer_EE, out=np.zeros_like(gram), where=outer_EE > 0)
        np.fill_diagonal(similarity, 1.0)
        return similarity

    def check_compatible(self, model_or_config, require_all_layers: bool = True) -> None:
        """Raise a clear error when this profile does not describe `model_or_config`'s MoE layers.

        Compares the routed-expert count, top-k and MoE layer set, read through the family adapter
        (for a config, from a weightless skeleton of the model on the meta device).
        `require_all_layers=False` accepts a profile that covers only some of the model's MoE layers.
        """
        from torch import nn

        from occult_hf.patches.base import adapter_for

        config = getattr(model_or_config, "config", model_or_config)
        adapter = adapter_for(config)
        model_type = getattr(config, "model_type", None)
        num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
        if num_experts != self.num_experts:
            raise ValueError(
                f"routing profile is for num_experts={self.num_experts} but the model ({model_type}) has "
                f"{num_experts} routed experts per layer"
            )
        if top_k != self.top_k:
            raise ValueError(
                f"routing profile is for top_k={self.top_k} but the model ({model_type}) routes each token to "
                f"top_k={top_k} experts"
            )
        profile_layers = set(self.layers)
        model = model_or_config if isinstance(model_or_config, nn.Module) else _skeleton(config)
        model_layers = {index for index, _, _ in adapter.iter_moe_blocks(model)}
        extra = sorted(profile_layers - model_layers)
        if extra:
            raise ValueError(
                f"routing profile has layers {extra} that are not MoE layers of the model ({model_type}); "
                f"profile layers {sorted(profile_layers)}, model MoE layers {sorted(model_layers)}"
            )
        missing = sorted(model_layers - profile_layers)
        if require_all_layers and missing:
            raise ValueError(
                f"routing profile lacks the model's MoE layers {missing}; profile layers {sorted(profile_layers)}, "
                f"model MoE layers {sorted(model_layers)}"
            )

    # ----- files --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as safetensors (format in the module docstring)."""
        from safetensors.numpy import save_file

        tensors: dict[str, np.ndarray] = {}
        for l, r in self.layers.items():
            tensors[f"layer.{l}.coactivation"] = np.ascontiguousarray(r.coactivation, dtype=np.int64)
            tensors[f"layer.{l}.expert_counts"] = np.ascontiguousarray(r.expert_counts, dtype=np.int64)
            tensors[f"layer.{l}.token_count"] = np.array(int(r.token_count), dtype=np.int64)
            if r.logit_gram is not None:
                tensors[f"layer.{l}.logit_gram"] = np.ascontiguousarray(r.logit_gram, dtype=np.float64)
            if r.topk_sample is not None:
                tensors[f"layer.{l}.topk_sample"] = np.ascontiguousarray(r.topk_sample, dtype=np.int64)
        header = {
            "format": PROFILE_FORMAT,
            "model_type": self.model_type,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layers": sorted(self.layers),
            "source": self.meta.get("source"),
            "meta": self.meta,
        }
        save_file(tensors, os.fspath(path), metadata={PROFILE_METADATA_KEY: json.dumps(header)})

    @classmethod
    def load(cls, path: str | os.PathLike, model=None) -> "RoutingProfile":
        """Read a profile written by `save`; with `model` (or its config) also `check_compatible`."""
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"routing profile {path!r} is not a file")
        with safe_open(path, "np") as f:
            header_text = (f.metadata() or {}).get(PROFILE_METADATA_KEY)
            if header_text is None:
                raise ValueError(
                    f"{path!r} is not an occult_hf routing profile: its safetensors metadata lacks the "
                    f"{PROFILE_METADATA_KEY!r} entry (make one with `occult profile`)"
                )
            header = json.loads(header_text)
            if header.get("format") != PROFILE_FORMAT:
                raise ValueError(f"{path!r} has profile format {header.get('format')!r}, expected {PROFILE_FORMAT!r}")
            names = set(f.keys())
            layers = {}
            for l in header["layers"]:
                def get(name: str, l=l):
                    key = f"layer.{l}.{name}"
                    return f.get_tensor(key) if key in names else None

                for required in ("coactivation", "expert_counts", "token_count"):
                    if get(required) is None:
                        raise ValueError(f"routing profile {path!r} lacks tensor 'layer.{l}.{required}'")
                layers[int(l)] = LayerRouting(
                    coactivation=get("coactivation"),
                    expert_counts=get("expert_counts"),
                    token_count=int(get("token_count")),
                    logit_gram=get("logit_gram"),
                    topk_sample=get("topk_sample"),
                )
        profile = cls(
            num_experts=int(header["num_experts"]),
            top_k=int(header["top_k"]),
            layers=layers,
            model_type=header.get("model_type"),
            meta=dict(header.get("meta") or {}),
        )
        if model is not None:
            profile.check_compatible(model)
        return profile


def _skeleton(config):
    """The model of `config` on the meta device (no memory, no weights): its module tree only.

    Remote-code configs (with an `auto_map`) were already loaded with trust_remote_code.
    """
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            config, trust_remote_code=bool(getattr(config, "auto_map", None))
        )


def _check_shape(what: str, array: np.ndarray, expected: tuple[int, ...]) -> None:
    if tuple(np.shape(array)) != expected:
        raise ValueError(f"RoutingProfile {what} has shape {tuple(np.shape(array))}, expected {list(expected)}")


__all__ = ["LayerRouting", "RoutingProfile", "PROFILE_METADATA_KEY", "PROFILE_FORMAT"]
