"""Routing profiles from recorded trace files (`.npz` with per-token expert ids, as routing traces are published).

Two kinds of file are understood:

* **Per-token expert ids**: `topk_ids` `[T, k]` (one MoE layer) or `[T, Z, k]` (layers 0..Z-1), or
  arrays named `<part>_experts` `[T, Z, k]` (e.g. Mixtral's `prefill_experts` and
  `decode_experts`, concatenated in file order: every token the model routed). An optional `[T]`
  row mask drops whole tokens: `is_warmup_dummy` (True = drop), or `valid` / `mask` / `row_mask`
  (True = keep). A negative id marks a missing entry: the (token, layer) row holding it is left
  out of that layer only (the token still counts at the layers where its row is complete), and
  `meta["dropped_rows"]` says how many rows each layer lost. Such a profile holds every kept
  token's top-k set as its sample (exact CT) and no router-logit Gram matrix.
* **Pair counts**: `coact` `[Z, E, E]` and `freq` `[Z, E]`, optional `layer_valid` `[Z]` and a
  JSON `meta` string with `top_k` and `n_tokens`. It gives a profile without samples (pairwise
  cut and load can be measured, exact CT cannot).

Shape legend (docs/conventions.md): T tokens, Z layers, E routed experts, k experts per token.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..utils.strict_json import parse_json
from .stats import LayerAccumulator, LayerRouting, check_layer_counts, whole_counts

#: row-mask keys: name -> True when the mask marks rows to keep (False: rows to drop)
ROW_MASK_KEYS = {"is_warmup_dummy": False, "valid": True, "mask": True, "row_mask": True}

#: an `E` read off the largest id (no --num-experts, no `n_experts` in the file) is taken up to this many experts,
#: and past it only when most of the ids below it occur: a stray large id (9999 among ids < 10) would otherwise
#: make an E x E profile of it (800 MB per layer) that no model has
MAX_INFERRED_EXPERTS = 1024

#: the most bytes of co-activation counts (E x E int64 per layer) a trace is turned into: 4096 experts over 64
#: layers, far past any model (DeepSeek-V3: 256 experts over 58 layers, 30 MB)
MAX_COUNT_BYTES = 2**33

#: how an `.npz` archive (a zip file) and a single `.npy` array begin; numpy reads any other file as a pickle
_NPZ_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")

_EXPECTED_KEYS = (
    "'topk_ids' [T, k] or [T, Z, k] (optional [T] row mask: "
    + ", ".join(repr(k) for k in ROW_MASK_KEYS)
    + "), arrays named '<part>_experts' [T, Z, k], or pair counts 'coact' [Z, E, E] with 'freq' [Z, E]"
)


def read_trace(
    path: str | os.PathLike,
    *,
    key: str | list[str] | None = None,
    layer: int | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    model_type: str | None = None,
    sample_size: int | None = None,
    seed: int = 0,
) -> dict:
    """The `RoutingProfile` fields of a trace file (`RoutingProfile.from_trace` calls this).

    Args:
        path: the `.npz` file.
        key: the id array(s) to read (default: `topk_ids`, else every `*_experts` array).
        layer: decoder-layer index of a single-layer `[T, k]` trace (default 0; an error for pair counts).
        num_experts: `E`; default: the meta JSON's `n_experts`, else the largest id + 1 (recorded
            in `meta["num_experts_inferred"]`: an expert never chosen in the trace would be missed; an
            implausible one is an error, `_inferred_num_experts`). Counts past `MAX_COUNT_BYTES` are refused.
        top_k: `k` of a pair-count file without a meta JSON (id traces take it from their shape).
        model_type: recorded in the profile (traces do not say which transformers class made them).
        sample_size: keep a uniform sample of this many tokens per layer (default None: all; an error for
            pair counts, which hold no tokens).
        seed: seed of that sample.
    """
    path = os.fspath(path)
    if model_type is not None:
        check_model_type(model_type)
    arrays, file_meta = _open(path, layer)
    source = {"source": f"trace:{os.path.basename(path)}"}
    if _holds_pair_counts(arrays, key):
        for name, value in (("layer", layer), ("sample_size", sample_size)):
            if value is not None:
                raise ValueError(
                    f"trace file {path!r} holds pair counts ('coact', 'freq'), not per-token expert ids: {name}={value!r} "
                    f"does not apply to it"
                )
        return _from_pair_counts(arrays, file_meta, num_experts, top_k, model_type, source, path)
    keys, ids_TZk, layers, keep_T = _ids_and_mask(arrays, key, layer, path)
    usable_Z = (keep_T[:, None] & (ids_TZk >= 0).all(axis=2)).sum(axis=0)
    if ids_TZk.shape[0] == 0 or not usable_Z.all():
        empty = [layers[i] for i in np.flatnonzero(usable_Z == 0).tolist()] or layers
        raise ValueError(
            f"trace file {path!r} has no usable token at layers {empty}: every row is masked out or holds a negative "
            f"(missing) expert id, so a profile of it would be empty"
        )
    if num_experts is None and "n_experts" in file_meta:
        num_experts = file_meta["n_experts"]
        if type(num_experts) is not int or num_experts < 1:
            raise ValueError(f"trace file {path!r}: meta 'n_experts' must be an integer >= 1, got {num_experts!r}")
    inferred = num_experts is None
    if inferred:
        num_experts = _inferred_num_experts(ids_TZk, path)
    _check_count_bytes(num_experts, len(layers), path)
    _check_ids(ids_TZk, num_experts, path)
    k = ids_TZk.shape[2]
    result_layers, dropped = {}, {}
    for position, layer_index in enumerate(layers):
        rows_Tk = ids_TZk[:, position, :]
        complete_T = (rows_Tk >= 0).all(axis=1)
        dropped[str(layer_index)] = int((keep_T & ~complete_T).sum())
        accumulator = LayerAccumulator(num_experts, k, sample_size=sample_size, seed=seed)
        accumulator.update(torch.from_numpy(rows_Tk[keep_T & complete_T].astype(np.int64)))
        result_layers[layer_index] = accumulator.to_layer_routing()
    meta = {
        **source,
        "trace_keys": keys,
        "tokens_in_file": int(ids_TZk.shape[0]),
        "tokens_masked_out": int((~keep_T).sum()),
        "dropped_rows": dropped,
        "num_experts_inferred": inferred,
    }
    return dict(num_experts=num_experts, top_k=k, layers=result_layers, model_type=model_type, meta=meta)


def is_pair_count_trace(path: str | os.PathLike, key: str | list[str] | None = None) -> bool:
    """Whether `read_trace(path, key=key)` reads the file as pair counts (a profile without tokens, so without
    layer choice or sample), from the archive's names alone; False for a file that is no `.npz` archive (reading
    it is the error)."""
    import zipfile

    try:
        with zipfile.ZipFile(os.fspath(path)) as archive:
            names = {name.removesuffix(".npy") for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile):
        return False
    return _holds_pair_counts(names, key)


def read_trace_ids(
    path: str | os.PathLike, *, key: str | list[str] | None = None, layer: int | None = None
) -> tuple[np.ndarray, list[int], dict]:
    """`(ids [T, Z, k] int64, layer indices, the file's meta)` of a per-token trace, token by token (for
    replaying routing): the arrays `read_trace` reads (`key`, `layer` as there), its row mask applied."""
    path = os.fspath(path)
    arrays, file_meta = _open(path, layer)
    _, ids_TZk, layers, keep_T = _ids_and_mask(arrays, key, layer, path)
    return ids_TZk[keep_T], layers, file_meta


def read_trace_weights(path: str | os.PathLike, *, layer: int | None = None) -> np.ndarray | None:
    """`[T, Z, k]` float32 routing weights of the tokens `read_trace_ids` returns (a file's `topk_weights`, its row
    mask applied), or None when the file has none."""
    path = os.fspath(path)
    arrays, _ = _open(path, layer)
    if "topk_weights" not in arrays:
        return None
    _, ids_TZk, _, keep_T = _ids_and_mask(arrays, None, layer, path)
    weights = np.asarray(arrays["topk_weights"], dtype=np.float32).reshape(ids_TZk.shape)
    return weights[keep_T]


def _holds_pair_counts(names, key) -> bool:
    """Whether a file of arrays `names` is read as pair counts: unless `key` names id arrays to read instead."""
    return key is None and "coact" in names and "freq" in names


def _inferred_num_experts(ids_TZk: np.ndarray, path: str) -> int:
    """`E` as the largest id + 1, refused when implausible: past `MAX_INFERRED_EXPERTS` with most ids below it
    never chosen (a real model's trace chooses most of its experts)."""
    num_experts = int(ids_TZk.max()) + 1
    if num_experts > MAX_INFERRED_EXPERTS:
        distinct = len(np.unique(ids_TZk[ids_TZk >= 0]))
        if 2 * distinct < num_experts:
            raise ValueError(
                f"trace file {path!r}: its largest expert id is {num_experts - 1} but only {distinct} distinct ids occur, "
                f"so E = largest id + 1 = {num_experts} is not a plausible expert count; pass --num-experts "
                f"(num_experts=) or put n_experts in the file's meta"
            )
    return num_experts


def _check_count_bytes(num_experts: int, num_layers: int, path: str) -> None:
    """Refuse before allocating a profile whose E x E co-activation counts would pass `MAX_COUNT_BYTES`."""
    count_bytes = 8 * num_experts * num_experts * num_layers
    if count_bytes > MAX_COUNT_BYTES:
        raise ValueError(
            f"trace file {path!r}: a profile of E={num_experts} experts over {num_layers} "
            f"layer{'s' * (num_layers != 1)} needs {count_bytes / 2**30:.3g} GiB of co-activation counts (E x E int64 per layer), past the "
            f"{MAX_COUNT_BYTES / 2**30:g} GiB limit; check num_experts (--num-experts, the meta's n_experts)"
        )


def check_model_type(model_type) -> None:
    """A model type a profile records must be one occult_hf serves (the error lists them): the profile is
    checked against models of that type, and a misspelt one would match none. The profile loader applies it
    to a file's header too."""
    from types import SimpleNamespace

    from occult_hf.patches import adapter_for

    if not isinstance(model_type, str):
        raise TypeError(f"model_type must be a string, got {type(model_type).__name__}")
    adapter_for(SimpleNamespace(model_type=model_type))


def _open(path: str, layer: int | None) -> tuple[dict[str, np.ndarray], dict]:
    """The file's arrays and meta JSON, after checking that it exists and that `layer` is an index."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"trace file {path!r} is not a file")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0):
        raise ValueError(f"trace file {path!r}: layer={layer!r} must be a decoder-layer index (an integer >= 0)")
    arrays = _load_arrays(path)
    return arrays, _file_meta(arrays, path)


def _ids_and_mask(arrays, key, layer: int | None, path: str) -> tuple[list[str], np.ndarray, list[int], np.ndarray]:
    """`(keys, ids [T, Z, k], layer indices, keep [T])` of the chosen id arrays."""
    keys = _id_keys(arrays, key, path)
    ids_TZk, layers = _stack_ids(arrays, keys, layer, path)
    return keys, ids_TZk, layers, _row_mask(arrays, ids_TZk.shape[0], path)


def _load_arrays(path: str) -> dict[str, np.ndarray]:
    """Every array of an `.npz`; a corrupt, truncated or pickled file is a `ValueError` naming it."""
    import zipfile
    import zlib

    _check_npz_signature(path)
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array, not an .npz archive of named arrays")
        with npz:
            return {name: npz[name] for name in npz.files}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError) as error:
        raise ValueError(f"trace file {path!r} is not a readable .npz archive ({' '.join(str(error).split())})") from None


def _check_npz_signature(path: str) -> None:
    """Refuse a file that does not begin as an `.npz` archive, saying what it is: numpy would read it as a pickle
    and answer with advice on `allow_pickle=`, naming neither the file nor what was expected. A safetensors file
    there is most likely a routing profile given where its trace belongs."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head.startswith(_NPZ_SIGNATURES):
        return
    if len(head) == 9 and head[8:] == b"{":  # safetensors: an 8-byte header length, then the JSON header
        raise ValueError(
            f"trace file {path!r} is a safetensors file (a routing profile?), not a per-token trace: a routing profile "
            f"(.safetensors) holds counts, not each token's experts; give the .npz trace, holding {_EXPECTED_KEYS}"
        )
    raise ValueError(f"trace file {path!r} is not an .npz archive (it does not begin as a zip file); expected {_EXPECTED_KEYS}")


def _file_meta(arrays: dict[str, np.ndarray], path: str) -> dict:
    if "meta" not in arrays:
        return {}
    meta = parse_json(str(arrays["meta"]), f"trace file {path!r}: its 'meta' array")
    if not isinstance(meta, dict):
        raise ValueError(f"trace file {path!r}: its 'meta' array must hold a JSON object")
    return meta


def _id_keys(arrays: dict[str, np.ndarray], key, path: str) -> list[str]:
    if key is not None:
        keys = [key] if isinstance(key, str) else list(key)
        unknown = [k for k in keys if k not in arrays]
        if unknown:
            raise KeyError(f"trace file {path!r} has no array {unknown}; its arrays are {sorted(arrays)}")
        return keys
    if "topk_ids" in arrays:
        return ["topk_ids"]
    parts = [name for name in arrays if name.endswith("_experts")]
    if parts:
        return parts
    names = sorted(arrays)
    shown = names if len(names) <= 8 else names[:8] + [f"... {len(names) - 8} more"]
    raise ValueError(f"trace file {path!r} has arrays {shown}; expected {_EXPECTED_KEYS}")


def _stack_ids(arrays, keys: list[str], layer: int | None, path: str) -> tuple[np.ndarray, list[int]]:
    """`[T, Z, k]` ids of the chosen arrays (concatenated over tokens) and their layer indices."""
    shapes = {k: arrays[k].shape for k in keys}
    for name, shape in shapes.items():
        if arrays[name].dtype.kind not in "iu" or len(shape) not in (2, 3):
            raise ValueError(
                f"trace array {name!r} in {path!r} must be integer [T, k] or [T, Z, k], "
                f"got {arrays[name].dtype} {list(shape)}"
            )
        if 0 in shape[1:]:
            missing = "expert per token (k = 0)" if shape[-1] == 0 else "layer (Z = 0)"
            raise ValueError(f"trace array {name!r} in {path!r} has shape {list(shape)}: it holds no {missing}")
    if len({shape[1:] for shape in shapes.values()}) != 1:
        raise ValueError(f"trace arrays {keys} in {path!r} disagree on their [Z, k] shape: {shapes}")
    ids = np.concatenate([arrays[k] for k in keys]).astype(np.int64)
    if ids.ndim == 2:
        return ids[:, None, :], [0 if layer is None else int(layer)]
    if layer is not None:
        raise ValueError(
            f"layer={layer} applies to single-layer [T, k] traces; {keys} in {path!r} hold {ids.shape[1]} layers"
        )
    return ids, list(range(ids.shape[1]))


def _row_mask(arrays, num_rows: int, path: str) -> np.ndarray:
    """`[T]` bool, True for rows to keep."""
    present = [name for name in ROW_MASK_KEYS if name in arrays]
    if len(present) > 1:
        raise ValueError(f"trace file {path!r} has several row masks {present}; keep one")
    if not present:
        return np.ones(num_rows, dtype=bool)
    name = present[0]
    mask = np.asarray(arrays[name]).astype(bool)
    if mask.shape != (num_rows,):
        raise ValueError(f"row mask {name!r} in {path!r} has shape {list(mask.shape)}, expected [T={num_rows}]")
    return mask if ROW_MASK_KEYS[name] else ~mask


def _check_ids(ids_TZk: np.ndarray, num_experts: int, path: str) -> None:
    if ids_TZk.max() >= num_experts:
        raise ValueError(f"trace {path!r} holds expert id {int(ids_TZk.max())} but num_experts={num_experts}")
    if ids_TZk.shape[2] > num_experts:
        raise ValueError(f"trace {path!r} has top_k={ids_TZk.shape[2]} > num_experts={num_experts}")
    sorted_ids = np.sort(ids_TZk, axis=2)
    repeated = ((sorted_ids[..., 1:] == sorted_ids[..., :-1]) & (sorted_ids[..., 1:] >= 0)).any(axis=2)
    if repeated.any():
        token, layer_position = np.argwhere(repeated)[0]
        raise ValueError(
            f"trace {path!r} repeats an expert within one token's top-k ({int(repeated.sum())} rows; first: "
            f"token {int(token)}, layer position {int(layer_position)}: {ids_TZk[token, layer_position].tolist()})"
        )


def _from_pair_counts(arrays, file_meta, num_experts, top_k, model_type, source, path: str) -> dict:
    """The profile fields of a pair-count file. Its valid layers' counts are held to a profile file's rules
    (`whole_counts`, `check_layer_counts`), so that what `from_trace` returns is what `load` would accept: a bad count
    fails here, naming the file, not in a planner or at `save`."""
    where = f"pair-count trace {path!r}"
    coact_ZEE, freq_ZE = arrays["coact"], arrays["freq"]
    if coact_ZEE.ndim != 3 or freq_ZE.shape != coact_ZEE.shape[:2] or coact_ZEE.shape[1] != coact_ZEE.shape[2]:
        raise ValueError(
            f"{where} needs 'coact' [Z, E, E] and 'freq' [Z, E], got {list(coact_ZEE.shape)} and "
            f"{list(freq_ZE.shape)}"
        )
    file_experts = coact_ZEE.shape[1]
    if num_experts is not None and num_experts != file_experts:
        raise ValueError(f"{where}: num_experts={num_experts} given but the pair counts are for E={file_experts}")
    if top_k is None:
        if "top_k" not in file_meta:
            raise ValueError(f"{where} has no 'top_k' in its meta JSON; pass top_k=")
        top_k = file_meta["top_k"]
        if type(top_k) is not int or not 1 <= top_k <= file_experts:
            raise ValueError(f"{where}: meta 'top_k' must be an integer in [1, {file_experts}], got {top_k!r}")
    valid_Z = arrays["layer_valid"].astype(bool) if "layer_valid" in arrays else np.ones(len(freq_ZE), dtype=bool)
    layers = {}
    for l in np.flatnonzero(valid_Z):
        coact = whole_counts(f"{where}: 'coact' of layer {l}", coact_ZEE[l])
        freq = whole_counts(f"{where}: 'freq' of layer {l}", freq_ZE[l])
        if freq.sum() % top_k:
            raise ValueError(f"{where}: 'freq' of layer {l} sums to {int(freq.sum())}, not a multiple of top_k={top_k}")
        if not freq.any():
            raise ValueError(f"{where}: layer {l} counts no tokens ('freq' is all zero); mark it False in 'layer_valid'")
        layers[int(l)] = _checked_layer(where, int(l), LayerRouting(coact, freq, int(freq.sum()) // top_k), top_k)
    if not layers:
        raise ValueError(f"{where}: no layer is valid ('layer_valid' is all False)")
    meta = {**source, "file_meta": file_meta, "invalid_layers_skipped": np.flatnonzero(~valid_Z).tolist()}
    return dict(num_experts=file_experts, top_k=top_k, layers=layers, model_type=model_type, meta=meta)


def _checked_layer(where: str, layer: int, routing: LayerRouting, top_k: int) -> LayerRouting:
    """`routing` after the profile loader's count rules (`check_layer_counts`), their error naming the file."""
    try:
        check_layer_counts(layer, routing, top_k)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return routing


__all__ = ["read_trace", "read_trace_ids", "is_pair_count_trace", "ROW_MASK_KEYS"]
