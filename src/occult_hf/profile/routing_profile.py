"""Routing profiles: per-layer co-activation statistics of a real router (docs/design.md §2, §6).

A `RoutingProfile` is made three ways, all through the same `LayerAccumulator` counting:
`RoutingProfile.collect` (forward hooks on a model's own routers over a text file or a dataset),
`RoutingProfile.from_collector` (a `ProfileCollector`: the same hooks around forwards you run
yourself, e.g. training batches) and `RoutingProfile.from_trace` (a recorded `.npz` trace);
`RoutingProfile.merge` sums profiles of disjoint token streams (e.g. the ranks of a job). The
makers (`collect.py`, `trace.py`) return the profile's fields and never import this module, so
the profile package has no import cycle. It is saved as safetensors:

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

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..utils.checks import check_topk_ids
from ..utils.strict_json import parse_json
from .collect import collect_routing
from .stats import LayerRouting, check_layer_counts
from .trace import check_model_type, read_trace

#: metadata key and format tag of profile files
PROFILE_METADATA_KEY = "occult_profile"
PROFILE_FORMAT = "occult_hf.routing_profile/1"


@dataclass
class RoutingProfile:
    """Per-layer `LayerRouting` for one model, keyed by decoder-layer index.

    `meta["source"]` says where the routing came from (a model and data, or a trace file). `path` is the
    file `load` read it from (None otherwise), for errors only: `check_compatible` may run far from the load
    (apply_occult's similarity profile) and must still name the file; not part of the file nor of equality.
    """

    num_experts: int
    top_k: int
    layers: dict[int, LayerRouting]
    model_type: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    path: str | None = field(default=None, compare=False, repr=False)

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
            _check_magnitude(l, r)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def collect(cls, model, data, tokenizer=None, **options) -> "RoutingProfile":
        """Profile a model's routing over text or token ids with forward hooks on its own routers.

        `data`: a path to a text file, a list of strings or of token-id lists, or a `datasets.Dataset`.
        Options (`batch_size`, `max_length`, `sample_size`, `seed`, `max_tokens`, `text_column`,
        `separator`, `progress`, `source`) are documented on `occult_hf.profile.collect.collect_routing`.
        """
        return cls(**collect_routing(model, data, tokenizer=tokenizer, **options))

    @classmethod
    def from_collector(cls, collector, source: str | None = None, **meta: Any) -> "RoutingProfile":
        """The profile a `ProfileCollector` has accumulated so far; `source` and `meta` go into its metadata."""
        return cls(**collector.routing_fields(source, **meta))

    @classmethod
    def from_trace(cls, path: str | os.PathLike, **options) -> "RoutingProfile":
        """A profile from a recorded routing trace (`.npz`); options on `occult_hf.profile.trace.read_trace`."""
        return cls(**read_trace(path, **options))

    @classmethod
    def merge(cls, profiles: "list[RoutingProfile]", seed: int = 0) -> "RoutingProfile":
        """One profile of the union of disjoint token streams: counts and Gram matrices summed, samples resampled.

        The profiles must agree on `num_experts`, `top_k` and layers. A layer's Gram matrix survives only when
        every profile has one; the top-k samples only when every profile has them (`has_samples`), since rows
        of some streams alone would stand for all the tokens. Each layer's sample is `_pooled_sample`'s (drawn
        with `seed`), each stream's rows in proportion to its tokens. The model type is the one the profiles
        name, the meta the first one's with a `source` naming every input's.
        """
        profiles = list(profiles)
        if not profiles:
            raise ValueError("RoutingProfile.merge needs at least one profile")
        first = profiles[0]
        check_same_model(profiles, [str(p.path or p.meta.get("source") or f"profile {i}") for i, p in enumerate(profiles)])
        for other in profiles[1:]:
            if (other.num_experts, other.top_k, sorted(other.layers)) != (first.num_experts, first.top_k, sorted(first.layers)):
                raise ValueError(
                    f"RoutingProfile.merge: profiles disagree: num_experts/top_k/layers "
                    f"{first.num_experts}/{first.top_k}/{sorted(first.layers)} vs "
                    f"{other.num_experts}/{other.top_k}/{sorted(other.layers)}"
                )
        with_samples = all(p.has_samples for p in profiles)
        layers = {}
        for layer in first.layers:
            parts = [p.layer(layer) for p in profiles]
            grams = [r.logit_gram for r in parts]
            layers[layer] = LayerRouting(
                coactivation=sum(r.coactivation for r in parts),
                expert_counts=sum(r.expert_counts for r in parts),
                token_count=sum(r.token_count for r in parts),
                logit_gram=None if any(g is None for g in grams) else sum(grams),
                topk_sample=_pooled_sample(parts, seed) if with_samples else None,
            )
        model_type = next((p.model_type for p in profiles if p.model_type is not None), None)
        return cls(first.num_experts, first.top_k, layers, model_type, {**first.meta, "source": _merged_source(profiles)})

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
        """`[E, E]` float64 cosine similarity of the experts' router-logit columns at `layer` (docs/design.md §2 `S[l]`).

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

    def check_compatible(self, model_or_config, require_all_layers: bool = True, trust_remote_code: bool = False) -> None:
        """Raise a clear error when this profile does not describe `model_or_config`'s MoE layers.

        Compares the model type (when the profile records one: a profile of another model would be planned on as
        if it were this one's routing, which `merge` and similarity pruning refuse too), the routed-expert count,
        top-k and MoE layer set, read through the family adapter (for a config, from a weightless skeleton of the
        model on the meta device).
        `require_all_layers=False` accepts a profile that covers only some of the model's MoE layers.
        `trust_remote_code` is passed to transformers to build that skeleton: only what the caller
        says, never implied by the config's `auto_map` (a checkpoint must not run its code unasked).
        """
        from torch import nn

        from occult_hf.patches.base import adapter_for

        config = getattr(model_or_config, "config", model_or_config)
        adapter = adapter_for(config)
        model_type = getattr(config, "model_type", None)
        num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
        profile = f"routing profile {self.path!r}" if self.path else "routing profile"
        if self.model_type is not None and self.model_type != model_type:
            raise ValueError(
                f"{profile} is of model_type {self.model_type!r} but the model is of model_type {model_type!r}: "
                f"a profile describes the routing of the model it was collected from"
            )
        if num_experts != self.num_experts:
            raise ValueError(
                f"{profile} is for num_experts={self.num_experts} but the model ({model_type}) has "
                f"{num_experts} routed experts per layer"
            )
        if top_k != self.top_k:
            raise ValueError(
                f"{profile} is for top_k={self.top_k} but the model ({model_type}) routes each token to "
                f"top_k={top_k} experts"
            )
        profile_layers = set(self.layers)
        model = model_or_config if isinstance(model_or_config, nn.Module) else _skeleton(config, trust_remote_code)
        model_layers = {index for index, _, _ in adapter.iter_moe_blocks(model)}
        extra = sorted(profile_layers - model_layers)
        if extra:
            raise ValueError(
                f"{profile} has layers {extra} that are not MoE layers of the model ({model_type}); "
                f"profile layers {sorted(profile_layers)}, model MoE layers {sorted(model_layers)}"
            )
        missing = sorted(model_layers - profile_layers)
        if require_all_layers and missing:
            raise ValueError(
                f"{profile} lacks the model's MoE layers {missing}; profile layers {sorted(profile_layers)}, "
                f"model MoE layers {sorted(model_layers)}"
            )

    # ----- files --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as safetensors (format in the module docstring), atomically.

        The file is serialised in memory, read back (header and tensors) through the checks `load` runs, and
        then written through a temporary file and a rename: a profile built in memory may break a rule a file
        is held to (counts alone, a sample at some layers only), and one that `load` would refuse is refused
        here, naming the rule, with the previous file left whole.
        """
        from safetensors.numpy import load as load_bytes
        from safetensors.numpy import save as save_bytes

        from ..utils.atomic import atomic_write_bytes, json_text

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
        header_text = json_text(header, indent=None).strip()
        data = save_bytes(tensors, metadata={PROFILE_METADATA_KEY: header_text})
        atomic_write_bytes(path, data, validate=lambda data: _check_loads_back(path, header_text, load_bytes(data)))

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, trust_remote_code: bool = False) -> "RoutingProfile":
        """Read a profile written by `save`; with `model` (or its config) also `check_compatible`.

        Every error names the file: not a safetensors file (empty, truncated, garbage), no or a bad
        occult header, missing, unexpected, ill-typed or ill-shaped tensors, counts that disagree.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"routing profile {path!r} is not a file")
        from safetensors import SafetensorError

        try:
            profile = cls._read(path)
        except (ValueError, TypeError, KeyError, SafetensorError) as error:
            raise ValueError(f"routing profile {path!r}: {_reader_message(error)}") from None
        profile.path = path
        if model is not None:
            profile.check_compatible(model, trust_remote_code=trust_remote_code)
        return profile

    @classmethod
    def _read(cls, path: str) -> "RoutingProfile":
        from safetensors import SafetensorError, safe_open

        try:
            handle = safe_open(path, "np")
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"not a readable safetensors file ({' '.join(str(error).split())})") from None
        with handle as f:
            return cls._parse((f.metadata() or {}).get(PROFILE_METADATA_KEY), set(f.keys()), f.get_tensor)

    @classmethod
    def _parse(cls, header_text: str | None, names: set[str], get_tensor) -> "RoutingProfile":
        """The profile of a file's header text and its tensors (`names`, read by `get_tensor(name)`), held to every
        rule of a profile file: `load` reads a file through it and `save` checks what it is about to write."""
        num_experts, top_k, layer_list, model_type, meta = _parse_header(header_text)
        expected = {f"layer.{l}.{n}" for l in layer_list for n in _TENSOR_DTYPES}
        unexpected = sorted(names - expected)
        if unexpected:
            raise ValueError(f"holds tensors {unexpected[:5]} of no layer listed in its header {layer_list}")
        layers = {int(l): _parse_layer(l, names, get_tensor, num_experts, top_k) for l in layer_list}
        _check_samples_everywhere(layers)
        return cls(num_experts=num_experts, top_k=top_k, layers=layers, model_type=model_type, meta=dict(meta))


def _reader_message(error: Exception) -> str:
    """What a profile reader's error says: a `KeyError`'s message without the quotes `str` adds."""
    return str(error.args[0] if isinstance(error, KeyError) and error.args else error)


def _check_loads_back(path: str | os.PathLike, header_text: str, tensors: dict[str, np.ndarray]) -> None:
    """Raise, naming the rule, when `RoutingProfile.load` would refuse a file of this header and these tensors
    (what `save` is about to write): a file written and then refused is work lost."""
    try:
        RoutingProfile._parse(header_text, set(tensors), tensors.__getitem__)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(
            f"routing profile {os.fspath(path)!r} not written: RoutingProfile.load would refuse it: {_reader_message(error)}"
        ) from None


def _parse_header(header_text: str | None) -> tuple[int, int, list[int], str | None, dict]:
    """`(num_experts, top_k, layers, model_type, meta)` of a profile file's metadata entry."""
    if header_text is None:
        raise ValueError(
            f"not an occult_hf routing profile: its safetensors metadata lacks the "
            f"{PROFILE_METADATA_KEY!r} entry (make one with `occult profile`)"
        )
    header = parse_json(header_text, f"metadata {PROFILE_METADATA_KEY!r}")
    if not isinstance(header, dict):
        raise ValueError(f"metadata {PROFILE_METADATA_KEY!r} must be a JSON object")
    if header.get("format") != PROFILE_FORMAT:
        raise ValueError(f"profile format {header.get('format')!r}, expected {PROFILE_FORMAT!r}")
    num_experts = _header_int(header, "num_experts", 1)
    top_k = _header_int(header, "top_k", 1)
    layer_list = header.get("layers")
    if not isinstance(layer_list, list) or not layer_list:
        raise ValueError("header 'layers' must be a non-empty list of layer indices")
    for l in layer_list:
        if type(l) is not int or l < 0:
            raise ValueError(f"header 'layers' holds {l!r}; layer indices are integers >= 0")
    if len(set(layer_list)) != len(layer_list):
        raise ValueError(f"header 'layers' repeats a layer: {layer_list}")
    meta = header.get("meta") or {}
    if not isinstance(meta, dict):
        raise ValueError("header 'meta' must be a JSON object")
    model_type = header.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"header 'model_type' must be a string or null, got {model_type!r}")
    if model_type is not None:
        try:
            check_model_type(model_type)
        except ValueError as error:
            raise ValueError(f"header 'model_type': {error}") from None
    return num_experts, top_k, layer_list, model_type, meta


def _parse_layer(layer: int, names: set[str], get_tensor, num_experts: int, top_k: int) -> LayerRouting:
    """One layer of a profile file: its tensors' dtypes and signs, then their shapes, then the rest of its rules."""
    tensors = {}
    for name, dtype in _TENSOR_DTYPES.items():
        key = f"layer.{layer}.{name}"
        if key not in names:
            continue
        tensor = get_tensor(key)
        if tensor.dtype != dtype:
            raise ValueError(f"tensor {key!r} has dtype {tensor.dtype}, expected {dtype}")
        if name != "logit_gram" and tensor.size and tensor.min() < 0:
            raise ValueError(f"tensor {key!r} holds negative values")
        tensors[name] = tensor
    for required in ("coactivation", "expert_counts", "token_count"):
        if required not in tensors:
            raise ValueError(f"lacks tensor 'layer.{layer}.{required}'")
    _check_tensor_shapes(layer, tensors, num_experts, top_k)
    sample, gram = tensors.get("topk_sample"), tensors.get("logit_gram")
    if sample is not None:  # real top-k sets: ids in [0, E), distinct per row
        check_topk_ids(sample, num_experts, f"tensor 'layer.{layer}.topk_sample'")
    if gram is not None:
        _check_gram(f"tensor 'layer.{layer}.logit_gram'", gram)
    routing = LayerRouting(
        coactivation=tensors["coactivation"],
        expert_counts=tensors["expert_counts"],
        token_count=int(tensors["token_count"]),
        logit_gram=gram,
        topk_sample=sample,
    )
    check_layer_counts(layer, routing, top_k)
    return routing


#: how far a logit Gram matrix may be from symmetric, relative to the Cauchy-Schwarz bound sqrt(G[i, i] G[j, j]) of
#: its entries (which also bounds the sum of |l_i l_j| that rounding is relative to): the float64 matmul of
#: `LayerAccumulator.update` may sum G[i, j] and G[j, i] in different orders (BLAS / cuBLAS blocking), and chunks,
#: forwards and merged ranks add their rounding, about eps = 1.1e-16 of the bound per addition; 1e-6 allows ~10^10
#: such additions, yet moves a cosine similarity by at most 1e-6
GRAM_SYMMETRY_TOLERANCE = 1e-6


def _check_gram(name: str, gram_EE: np.ndarray) -> None:
    """A logit Gram matrix `sum over tokens of l l^T` as its makers make it: finite, a non-negative diagonal (sums of
    squares: exact in floating point, since rounding a sum of non-negative terms never makes it negative) and
    symmetric up to `GRAM_SYMMETRY_TOLERANCE`. Any other turns `similarity` (a cosine) into numbers far outside
    [-1, 1] or silently zeroes an expert's row, and similarity pruning would act on them."""
    if not np.isfinite(gram_EE).all():
        raise ValueError(f"{name} holds non-finite values")
    diagonal_E = np.diagonal(gram_EE)
    if (diagonal_E < 0).any():
        expert = int(np.flatnonzero(diagonal_E < 0)[0])
        raise ValueError(
            f"{name} has a negative diagonal entry ([{expert}, {expert}] = {diagonal_E[expert]:.6g}); the diagonal of a "
            f"Gram matrix holds sums of squared logits"
        )
    norms_E = np.sqrt(diagonal_E)
    asymmetric_EE = np.abs(gram_EE - gram_EE.T) > GRAM_SYMMETRY_TOLERANCE * np.outer(norms_E, norms_E)
    if asymmetric_EE.any():
        i, j = (int(v) for v in np.argwhere(asymmetric_EE)[0])
        raise ValueError(
            f"{name} is not symmetric ([{i}, {j}] = {gram_EE[i, j]:.6g} but [{j}, {i}] = {gram_EE[j, i]:.6g}, past "
            f"rounding: a relative tolerance of {GRAM_SYMMETRY_TOLERANCE:g}); a Gram matrix sum of l l^T is symmetric"
        )


def _check_tensor_shapes(layer: int, tensors: dict[str, np.ndarray], num_experts: int, top_k: int) -> None:
    """Each tensor of a profile file's layer has the shape its header's E and k give it, checked before any rule
    over its values: numpy would report a count rule over a misshapen tensor as a broadcast error, naming neither
    the tensor nor the rule."""
    square = (f"[E, E] = [{num_experts}, {num_experts}]", (num_experts, num_experts))
    shapes = {
        "coactivation": square,
        "expert_counts": (f"[E] = [{num_experts}]", (num_experts,)),
        "token_count": ("[] (a scalar)", ()),
        "logit_gram": square,
    }
    for name, tensor in tensors.items():
        if name == "topk_sample":
            expected, fits = f"[N, k] = [N, {top_k}]", tensor.ndim == 2 and tensor.shape[1] == top_k
        else:
            expected, shape = shapes[name]
            fits = tensor.shape == shape
        if not fits:
            raise ValueError(
                f"tensor 'layer.{layer}.{name}' has shape {list(tensor.shape)}, expected {expected} "
                f"(num_experts={num_experts}, top_k={top_k} in the header)"
            )


#: the tensors of one profile layer and their dtypes
_TENSOR_DTYPES = {
    "coactivation": np.dtype(np.int64),
    "expert_counts": np.dtype(np.int64),
    "token_count": np.dtype(np.int64),
    "logit_gram": np.dtype(np.float64),
    "topk_sample": np.dtype(np.int64),
}


def _check_samples_everywhere(layers: dict[int, LayerRouting]) -> None:
    """Every layer of a profile file holds top-k sample rows, or none does (sample_size=0, pair counts): a profile's
    makers sample every layer alike, and one layer without rows would turn exact CT off for all of them."""
    with_rows = [l for l, r in layers.items() if r.topk_sample is not None and len(r.topk_sample)]
    without = [l for l in layers if l not in with_rows]
    if with_rows and without:
        raise ValueError(
            f"layers {_listed(without)} hold no top-k sample rows but layers {_listed(with_rows)} do; a profile samples "
            f"every layer or none"
        )


def _listed(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"{str(values[:8])[:-1]}, ... ({len(values)} in all)]"


#: the largest sum of one layer's counts: every int64 statistic over them (the pairwise cut sums a subset) stays exact
MAX_COUNT_SUM = 2**62


def _check_magnitude(layer: int, routing: LayerRouting) -> None:
    """No int64 statistic of the layer can overflow: its co-activation and its expert counts each sum (in
    magnitude) to at most `MAX_COUNT_SUM`. A profile file is held to more (`check_layer_counts`); a profile built in
    memory may hold counts alone, but not counts whose cut would wrap around to a wrong number."""
    for name, counts in (("coactivation", routing.coactivation), ("expert_counts", routing.expert_counts)):
        total = float(np.abs(np.asarray(counts, dtype=np.float64)).sum())
        if total > MAX_COUNT_SUM:
            raise ValueError(
                f"RoutingProfile layer {layer} {name} sums to {total:.3g}, past 2^62: statistics over it (the pairwise "
                f"cut) would overflow int64"
            )


def check_same_model(profiles: "list[RoutingProfile]", names: list[str]) -> None:
    """Raise when profiles to be pooled or merged come from models of different types (each named by `names`):
    their co-activation would be summed as if one model had routed every token."""
    types = {name: p.model_type for name, p in zip(names, profiles) if p.model_type is not None}
    if len(set(types.values())) > 1:
        raise ValueError(
            "routing profiles of different models cannot be pooled: "
            + ", ".join(f"{name} is of model_type {model_type!r}" for name, model_type in list(types.items())[:8])
        )


def _pooled_sample(parts: list[LayerRouting], seed: int) -> np.ndarray | None:
    """A uniform sample of the union of disjoint token streams, from each stream's own uniform sample.

    A stream gives rows in proportion to the tokens it counted (not to the rows it kept): its share of the sample is
    its share of the tokens, as in a sample of the union, rounded at random (`_apportioned`) so that every token of
    every stream is drawn with the same probability. The size is the largest such sample the streams' rows allow
    (no share past its stream's rows), at most all of them: the streams of a job's ranks, equal in tokens and rows,
    keep every row. The shares and each stream's rows (without replacement, kept in stream order) are drawn by a
    generator seeded with `seed`, so layers whose streams agree in tokens and rows keep the same tokens. None when
    no stream counted a token: rows of no tokens have no weight.
    """
    tokens = [int(r.token_count) for r in parts]
    rows = [len(r.topk_sample) for r in parts]
    total = sum(tokens)
    if total == 0:
        return None
    size = min([sum(rows)] + [n * total // t for n, t in zip(rows, tokens) if t])
    generator = np.random.default_rng(seed)
    picked = [
        r.topk_sample[np.sort(generator.choice(n, share, replace=False))]
        for r, n, share in zip(parts, rows, _apportioned(size, tokens, generator))
    ]
    return np.concatenate(picked)


def _apportioned(size: int, weights: list[int], generator: np.random.Generator) -> list[int]:
    """`size` split into integers in proportion to `weights`, each the floor or the ceiling of its exact share, the
    ceiling with probability the share's fraction: each share is its exact one in expectation, so a stream whose share
    is a fraction of a row is drawn as often as its tokens say. A rule fixed in advance (largest remainders, ties to
    the earlier) would round up the same streams at every seed and leave the others' tokens out of every sample.

    Systematic sampling over the fractions in a random order of the streams, in exact integer arithmetic: the
    fractions, laid end to end, span as many rows as are left over; points one row apart from a random start pick
    exactly that many streams, each with probability its fraction (every fraction is below one row).
    """
    total = sum(weights)
    shares = [size * w // total for w in weights]
    if sum(shares) == size:  # whole shares (a job's ranks): nothing to round, and the generator left as it was
        return shares
    start = int(generator.integers(total))  # in units of 1/total of a row
    end = 0
    for i in generator.permutation(len(weights)).tolist():
        begin, end = end, end + size * weights[i] % total
        shares[i] += _points_below(end, start, total) - _points_below(begin, start, total)
    return shares


def _points_below(x: int, start: int, step: int) -> int:
    """How many of the points `start + j * step` (j = 0, 1, ...) lie below `x`."""
    return max(0, -((start - x) // step))


def _merged_source(profiles: "list[RoutingProfile]") -> str | None:
    """The `source` of a merge: its inputs' distinct sources in order, or their one source (a job's ranks share it)."""
    sources = list(dict.fromkeys(str(p.meta["source"]) for p in profiles if p.meta.get("source") is not None))
    if len(sources) <= 1:
        return sources[0] if sources else None
    return "merged: " + ", ".join(sources)


def _header_int(header: dict, key: str, minimum: int) -> int:
    value = header.get(key)
    if type(value) is not int or value < minimum:
        raise ValueError(f"header {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _skeleton(config, trust_remote_code: bool = False):
    """The model of `config` on the meta device (no memory, no weights): its module tree only.

    `trust_remote_code` is only what the caller passed: a config's `auto_map` names code that would
    run on import, so it never switches remote code on by itself.
    """
    import torch
    import transformers

    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if trust_remote_code or not getattr(config, "auto_map", None):
            raise
        raise ValueError(
            f"checking a routing profile against a {getattr(config, 'model_type', None)!r} config needs the model's "
            f"remote code (its auto_map), which occult_hf does not run unasked: pass the loaded model instead of its "
            f"config, or trust_remote_code=True ({' '.join(str(error).split())[:200]})"
        ) from None


def _check_shape(what: str, array: np.ndarray, expected: tuple[int, ...]) -> None:
    if tuple(np.shape(array)) != expected:
        raise ValueError(f"RoutingProfile {what} has shape {tuple(np.shape(array))}, expected {list(expected)}")


__all__ = ["LayerRouting", "RoutingProfile", "PROFILE_METADATA_KEY", "PROFILE_FORMAT", "check_same_model"]
