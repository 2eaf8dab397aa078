"""The expert-parallel ranks agree on one configuration, and no wait on a peer is unbounded (DESIGN.md §3).

**Agreement.** Ranks that run different placements, dispatch modes or pruning settings do not fail
on their own: they exchange rows that the receiver reads with another plan and return wrong
logits, a save gathers experts to the wrong slots, and mismatched split sizes can abort inside the
backend. So at `apply_occult` and again before every collective save/gather, each rank hashes its
*effective* setup (every `OccultConfig` field with the placement resolved, the routing profile's
content instead of its path, the experts' dtype and device type, the MoE layer paths and, at
`apply_occult`, the model's config) field by
field, and the group all-gathers one fixed-size vector of digests. Equal everywhere: done (one
small collective). Otherwise every rank gathers a short summary of each field and raises
`EPConfigMismatchError` naming the fields that differ and each rank's value.

Shape legend (docs/conventions.md): D ranks; local to this file: F the digest vector's fields
(`MAX_FIELDS`: the field names' digest, then one per field).

**Bounded waits.** These checks and the save/gather collectives run on occult_hf's own gloo group
(through CPU, whatever the model's device) and every wait on them is bounded by
`OCCULT_SAVE_TIMEOUT_S` (default 300 s), not by the job's process-group timeout (30 min for gloo
by default; under NCCL the watchdog, `TORCH_NCCL_ASYNC_ERROR_HANDLING`, tears the process down
instead of raising). A peer that never joins, or died, becomes `EPPeerError` naming the operation and the
layer. See docs/failure.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from ..utils.checks import check_timeout_s

#: environment variable: seconds a collective save/gather/agreement check waits for the EP peers
SAVE_TIMEOUT_ENV = "OCCULT_SAVE_TIMEOUT_S"
DEFAULT_SAVE_TIMEOUT_S = 300.0
#: fields in the digest vector (fixed, so that ranks of different versions still compare sizes equal)
MAX_FIELDS = 48
#: the setup entry that carries a rank's own failure (`fail_together`), None on a rank that has a setup
FAILED = "failed_before_check"
#: model-config keys that may differ between ranks: paths, the running library, per-call output switches, and
#: what `save_pretrained` sets on the writing rank only (`architectures`, `dtype`); the dtype that runs is
#: compared from the experts' weights. Every other key (sizes, k, routing rules) shapes what the ranks compute
#: together: a rank with another `hidden_size` aborts the exchange, another `intermediate_size` or `norm_topk_prob`
#: gives silently different logits
RANK_LOCAL_CONFIG_KEYS = frozenset({
    "architectures", "dtype", "torch_dtype", "transformers_version", "occult_config", "use_cache",
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",
})


class EPConfigMismatchError(RuntimeError):
    """The ranks of an expert-parallel group run different configurations."""


class EPPeerError(RuntimeError):
    """An expert-parallel peer did not take part in a collective in time (stalled, diverged or dead)."""


def save_timeout_s() -> float:
    """`$OCCULT_SAVE_TIMEOUT_S` (finite seconds in (0, `MAX_TIMEOUT_S`]), else 300."""
    raw = os.environ.get(SAVE_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_SAVE_TIMEOUT_S
    return check_timeout_s(raw, SAVE_TIMEOUT_ENV)


def bounded(operation: str, layer: int | None, timeout_s: float, start: Callable[[], Any]) -> None:
    """Start the collective (`start()` calls it with `async_op=True`) and wait at most `timeout_s` for it.

    The bound is on the wait, not on the group, so that creating the group (every rank arriving at
    `apply_occult`, maybe minutes apart while loading weights) is bounded by the process-group
    timeout only. The backend's timeout or peer-loss error becomes `EPPeerError`.
    """
    try:
        work = start()
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        if isinstance(error, (EPConfigMismatchError, EPPeerError)):
            raise
        where = f" of layer {layer}" if layer is not None else ""
        text = " ".join(str(error).split())
        lost = any(word in text.lower() for word in ("closed", "reset", "broken pipe", "connection"))
        cause = "an EP peer died or left the group" if lost else (
            f"an EP peer did not join within {timeout_s:g} s ({SAVE_TIMEOUT_ENV})"
        )
        raise EPPeerError(
            f"occult_hf: {operation}{where} failed on rank {_rank()}: {cause} [{text[:300]}]. Under expert parallelism "
            f"apply_occult, save_pretrained, snapshot_experts and unapply_occult are collective: call them on every "
            f"rank, in the same order; with HF Trainer (which saves on rank 0 only) import occult_hf before "
            f"building the Trainer: it hooks Trainer.save_model"
        ) from error


# ----- agreement ---------------------------------------------------------------------------------


def effective_setup(
    occult_config, block_paths: list[str], expert_weight: torch.Tensor | None, model_config=None
) -> dict[str, Any]:
    """The JSON-able facts every EP rank must share, one entry per field compared.

    Every `OccultConfig` field is included as it is (new fields are compared without a change here),
    except the placement (its maps, without the free-form `meta`) and the profile (its content's
    digest: ranks may mount it at different paths). `model_config` (a `PretrainedConfig`, given at
    `apply_occult` only: a save changes the writing rank's copy) is compared as one field, without the
    `_`-private and `RANK_LOCAL_CONFIG_KEYS` keys.
    """
    setup: dict[str, Any] = {}
    for f in fields(occult_config):
        value = getattr(occult_config, f.name)
        if f.name == "placement" and hasattr(value, "to_dict"):
            value = {k: v for k, v in value.to_dict().items() if k != "meta"}
        elif f.name == "profile" and value is not None:
            value = _file_digest(value)
        setup[f.name] = value
    setup["moe_layers"] = list(block_paths)
    if expert_weight is not None:
        setup["dtype"] = str(expert_weight.dtype)
        setup["device_type"] = expert_weight.device.type
    if model_config is not None:
        setup["model_config"] = {
            k: v for k, v in model_config.to_dict().items() if not k.startswith("_") and k not in RANK_LOCAL_CONFIG_KEYS
        }
    return setup


def check_agreement(
    setup: dict[str, Any], group, operation: str, timeout_s: float, failed: Exception | None = None
) -> None:
    """Collective: raise `EPConfigMismatchError` on every rank of `group` unless all hold the same `setup`.

    `failed`: this rank's own checks raised it before it had a setup (use `fail_together`); every other
    rank then raises an error naming this rank and its error.
    """
    setup = {**setup, FAILED: None if failed is None else f"{type(failed).__name__}: {failed}"}
    names = sorted(setup)
    if len(names) + 1 > MAX_FIELDS:
        raise ValueError(f"check_agreement compares at most {MAX_FIELDS - 1} fields, got {len(names)}")
    digests_F = torch.zeros(MAX_FIELDS, dtype=torch.int64)
    digests_F[0] = _digest(names)
    for i, name in enumerate(names):
        digests_F[i + 1] = _digest(setup[name])
    world = dist.get_world_size(group)
    table = [torch.empty_like(digests_F) for _ in range(world)]
    bounded(f"the configuration check at {operation}", None, timeout_s, lambda: dist.all_gather(table, digests_F, group=group, async_op=True))
    rows_DF = torch.stack(table)
    if bool((rows_DF == rows_DF[0]).all()):
        return
    summaries: list[Any] = [None] * world  # every rank saw the same table: all of them are here
    dist.all_gather_object(summaries, {name: _summary(setup[name], name) for name in names}, group=group)
    if failed is not None:
        raise failed
    raise EPConfigMismatchError(_mismatch_message(summaries, operation))


def fail_together(error: Exception, group, operation: str, timeout_s: float) -> NoReturn:
    """Collective: this rank's own checks at `operation` raised `error`; raise it here after telling the ranks of
    `group`, which reach `check_agreement` with their setups and raise an error naming this rank, instead of
    waiting for it until the process group's timeout (30 min by default). If every rank failed alike, each raises
    its own error."""
    check_agreement({}, group, operation, timeout_s, failed=error)
    raise error


def _mismatch_message(summaries: list[dict[str, Any]], operation: str) -> str:
    failed = [(r, s[FAILED]) for r, s in enumerate(summaries) if s.get(FAILED)]
    if failed:
        return (
            "; ".join(f"occult_hf: rank {r} of the expert-parallel group failed at {operation} ({text})" for r, text in failed)
            + f"; rank {_rank()} stops here instead of waiting for it"
        )
    names = sorted(set().union(*summaries))
    parts = []
    for name in names:
        values = [s.get(name, "<absent: another occult_hf version?>") for s in summaries]
        if all(v == values[0] for v in values):
            continue
        if name == "placement" and all(isinstance(v, dict) for v in values):
            parts.append(f"placement ({_placement_difference(values)})")
            continue
        if name == "model_config" and all(isinstance(v, dict) for v in values):
            parts.append(f"the model config ({_config_difference(values)})")
            continue
        shown = ", ".join(f"rank {r} {v!r}" if not isinstance(v, dict) else f"rank {r} {v}" for r, v in enumerate(values))
        parts.append(f"{name} ({shown})")
    return (
        f"occult_hf: the expert-parallel ranks disagree at {operation} on {'; '.join(parts)}. Every rank of the EP "
        f"group must use the same OccultConfig, placement file, routing profile, model config and dtype; "
        f"rank {_rank()} stops here instead of computing a wrong model"
    )


def _placement_difference(values: list[dict[str, Any]]) -> str:
    first = values[0]
    notes = []
    for key in ("num_experts", "num_devices"):
        seen = [v.get(key) for v in values]
        if any(s != seen[0] for s in seen):
            notes.append(f"{key} " + ", ".join(f"rank {r} {s}" for r, s in enumerate(seen)))
    layers = sorted({l for v in values for l in v.get("layers", {}) if v["layers"].get(l) != first["layers"].get(l)}, key=int)
    if layers:
        notes.append(f"expert -> device maps differ at layers [{', '.join(layers)}]")
    if not notes:
        notes.append("replicas or slots differ")
    return "; ".join(notes)


_ABSENT = "<absent>"


def _config_difference(values: list[dict[str, Any]]) -> str:
    keys = sorted({k for v in values for k in v if any(w.get(k, _ABSENT) != values[0].get(k, _ABSENT) for w in values)})
    return "; ".join(f"{k}: " + ", ".join(f"rank {r} {v.get(k, _ABSENT)!r}" for r, v in enumerate(values)) for k in keys)


def _summary(value: Any, name: str = "") -> Any:
    """What the error shows of a field: short values as they are, a placement per layer, the model config's
    keys with their short values (else digests), else a digest."""
    if isinstance(value, dict) and "layers" in value:  # the placement
        return {
            "num_experts": value.get("num_experts"),
            "num_devices": value.get("num_devices"),
            "layers": {str(l): f"{_digest(d):016x}" for l, d in value["layers"].items()},
            "rest": f"{_digest({k: v for k, v in value.items() if k != 'layers'}):016x}",
        }
    if name == FAILED and value is not None:
        return value[:2000]
    if name == "model_config":
        return {k: _summary(v) for k, v in value.items()}
    text = _canonical(value)
    return value if len(text) <= 80 else f"<sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}>"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def _digest(value: Any) -> int:
    """63 bits of the SHA-256 of the value's canonical JSON (a non-negative int64)."""
    return int.from_bytes(hashlib.sha256(_canonical(value).encode()).digest()[:8], "big") >> 1


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as error:
        return f"<unreadable: {type(error).__name__}>"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = [
    "EPConfigMismatchError",
    "EPPeerError",
    "SAVE_TIMEOUT_ENV",
    "DEFAULT_SAVE_TIMEOUT_S",
    "save_timeout_s",
    "bounded",
    "effective_setup",
    "check_agreement",
    "fail_together",
]
