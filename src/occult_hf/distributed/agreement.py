"""The expert-parallel ranks agree on one configuration, and no wait on a peer is unbounded (docs/design.md §3).

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

**Arrival.** Before the first collective of an operation the ranks meet in the job's own key-value
store (`arrive`), which every rank can read without a collective: each rank posts that it arrived
(or that it failed, and why), then polls for the others. A rank that does not arrive within the bound
is named (`EPPeerError: ... ranks [1] did not reach save_pretrained within 30 s`), a rank that posted
a failure is named at once, and a wait that fails leaves no collective half started on the gloo group.
The bound is `OCCULT_SAVE_TIMEOUT_S` where ranks may legitimately arrive minutes apart (`apply_occult`,
while they load weights; a Trainer checkpoint, while rank 0 writes the model) and
`OCCULT_JOIN_TIMEOUT_S` (default 30 s) at the start of a save or gather, where they arrive together
unless one of them does not call it at all (`if rank == 0: model.save_pretrained(...)`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import fields
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from ..utils.checks import check_timeout_s, shown
from ..utils.differences import ABSENT, differing_keys, placement_differences

#: environment variable: seconds a collective save/gather/agreement check waits for the EP peers
SAVE_TIMEOUT_ENV = "OCCULT_SAVE_TIMEOUT_S"
DEFAULT_SAVE_TIMEOUT_S = 300.0
#: environment variable: seconds a collective save or gather waits for every EP rank to join it
JOIN_TIMEOUT_ENV = "OCCULT_JOIN_TIMEOUT_S"
DEFAULT_JOIN_TIMEOUT_S = 30.0
#: the store keys of `arrive`
_ARRIVAL_PREFIX = "occult_hf/arrival"
_COLLECTIVE_ADVICE = (
    "Under expert parallelism apply_occult, apply_replicas, save_pretrained, snapshot_experts and unapply_occult are "
    "collective: call them on every rank, in the same order (EP rank 0 writes; `if rank == 0: "
    "model.save_pretrained(...)` leaves the others out); with HF Trainer import occult_hf before building the "
    "Trainer: it hooks Trainer.save_model. A rank that failed or stopped earlier never arrives"
)
#: the longest pause between two polls of the store while waiting for the ranks to arrive
_POLL_S = 0.2
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
    return _timeout_from_env(SAVE_TIMEOUT_ENV, DEFAULT_SAVE_TIMEOUT_S)


def join_timeout_s() -> float:
    """`$OCCULT_JOIN_TIMEOUT_S` (finite seconds in (0, `MAX_TIMEOUT_S`]), else 30."""
    return _timeout_from_env(JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S)


def _timeout_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else check_timeout_s(raw, name)


def arrive(
    group, operation: str, timeout_s: float, setting: str, payload: Any = None, failed: Exception | None = None,
    advice: str | None = None,
) -> dict[int, Any]:
    """Collective through the job's store: every rank of `group` (None: the world) posts its arrival at
    `operation`, with a JSON-able `payload`; returns `{global rank: payload}` of every rank.

    Raises `EPConfigMismatchError` naming a rank that posted a failure (`announce_failure`), or its arrival at
    another operation, as soon as it is seen, and `EPPeerError` naming the ranks that did not arrive within
    `timeout_s` (`setting` names the bound in the message); a timed-out rank withdraws its arrival, so that a
    later call of every rank meets again; a rank that completes an arrival deletes its note of the one before (every
    rank has read it by then), so the store holds at most two per rank. `failed`: post this rank's own failure and
    return at once without waiting. `advice` replaces the timeout message's advice (that the operation is collective).
    """
    try:
        return _arrive(group, operation, timeout_s, setting, payload, failed, advice)
    except dist.DistStoreError as error:  # the store's host (rank 0 under torchrun) is gone
        raise EPPeerError(
            f"occult_hf: {operation} on rank {dist.get_rank()}: the job's store did not answer ({' '.join(str(error).split())[:200]}); "
            f"the rank that holds it (rank 0 under torchrun) may have died"
        ) from error


def _arrive(group, operation, timeout_s, setting, payload, failed, advice) -> dict[int, Any]:
    store, ranks, me = _store(), dist.get_process_group_ranks(group or dist.group.WORLD), dist.get_rank()
    prefix = f"{_ARRIVAL_PREFIX}/{hashlib.sha1(','.join(map(str, ranks)).encode()).hexdigest()[:12]}"
    number = store.add(f"{prefix}/count/{me}", 1)  # this rank's arrivals so far: the same on every rank
    key = lambda rank: f"{prefix}/{number}/{rank}"  # noqa: E731
    note = {"operation": operation, "payload": payload, "failed": None if failed is None else _failure_text(failed)}
    store.set(key(me), json.dumps(note, default=repr))
    if failed is not None:
        return {}
    arrived = {me: payload}
    deadline, pause = time.monotonic() + timeout_s, 0.005
    while True:
        for rank in ranks:
            if rank not in arrived and store.check([key(rank)]):
                other = json.loads(store.get(key(rank)))
                if other["failed"]:
                    raise EPConfigMismatchError(
                        f"occult_hf: rank {rank} of the expert-parallel group failed at {other['operation']} "
                        f"({other['failed']}); rank {me} stops at {operation} instead of waiting for it"
                    )
                if other["operation"] != operation:  # the collectives that follow would pair up wrongly
                    raise EPConfigMismatchError(
                        f"occult_hf: rank {me} is at {operation} while EP rank {rank} is at {other['operation']}: "
                        f"every rank of the expert-parallel group must call the same collective operations "
                        f"(save_pretrained, unapply_occult, snapshot_experts, generate, ...) in the same order"
                    )
                arrived[rank] = other["payload"]
        missing = [rank for rank in ranks if rank not in arrived]
        if not missing:
            if number > 1:  # every rank has posted this arrival, so each has read the notes of the one before
                store.delete_key(f"{prefix}/{number - 1}/{me}")
            return arrived
        if time.monotonic() > deadline:
            store.add(f"{prefix}/count/{me}", -1)
            store.delete_key(key(me))
            raise EPPeerError(
                f"occult_hf: {operation} on rank {me}: EP ranks {shown(missing)} did not reach it within {timeout_s:g} s "
                f"({setting}). " + (advice or _COLLECTIVE_ADVICE)
            )
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)


def announce_failure(error: Exception, operation: str, group=None) -> None:
    """Tell the ranks of `group` (None: the world), through the store, that this rank failed at `operation`
    before it could reach their next `arrive` (e.g. `from_pretrained`'s early check of `occult_config`): they
    raise at once naming it, instead of waiting for it. A no-op without a process group of several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        arrive(group, operation, 0.0, "", failed=error)


def _store():
    """The job's key-value store (the default process group's, which every rank reaches)."""
    return dist.distributed_c10d._get_default_store()


def _failure_text(error: Exception) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 2000 else text[:2000] + "..."


def bounded(operation: str, layer: int | None, timeout_s: float, start: Callable[[], Any], group=None) -> None:
    """Start the collective (`start()` calls it with `async_op=True`, on `group`) and wait at most `timeout_s` for it.

    The bound is on the wait, not on the group, so that creating the group (every rank arriving at
    `apply_occult`, maybe minutes apart while loading weights) is bounded by the process-group
    timeout only. The backend's timeout or peer-loss error becomes `EPPeerError`, and `group` counts as
    failed (`failed_on`): a collective that did not finish leaves its group unusable.
    """
    try:
        work = start()
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        if isinstance(error, (EPConfigMismatchError, EPPeerError)):
            raise
        if group is not None:
            _failed_groups.append(group)
        raise peer_error(operation + (f" of layer {layer}" if layer is not None else ""), timeout_s, error) from error


#: the process groups a bounded wait failed on in this process
_failed_groups: list = []


def failed_on(group) -> bool:
    """Whether a bounded wait on `group` has failed in this process (the group is not to be used again)."""
    return any(group is failed for failed in _failed_groups)


#: words of the backends' errors for a peer that died or left the group
_LOST_PEER_WORDS = ("closed", "reset", "broken pipe", "connection")


def is_peer_failure(error: RuntimeError) -> bool:
    """Whether `error`, raised by a collective of several ranks, is the backend's timeout or lost peer (not, e.g., a
    shape error), which `peer_error` describes."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(word in text for word in ("timed out", "timeout", *_LOST_PEER_WORDS))


def peer_error(operation: str, timeout_s: float, error: RuntimeError) -> EPPeerError:
    """The `EPPeerError` of a collective of `operation` that the backend ended with `error`: whether a peer died or did
    not join within `timeout_s`, the backend's words, and the rule that collective operations follow."""
    text = " ".join(str(error).split())
    lost = any(word in text.lower() for word in _LOST_PEER_WORDS)
    cause = "an EP peer died or left the group" if lost else (
        f"an EP peer did not join within {timeout_s:g} s ({SAVE_TIMEOUT_ENV})"
    )
    return EPPeerError(f"occult_hf: {operation} failed on rank {_rank()}: {cause} [{text[:300]}]. {_COLLECTIVE_ADVICE}")


# ----- agreement ---------------------------------------------------------------------------------


def effective_setup(
    occult_config, block_paths: list[str], expert_weight: torch.Tensor | None, model_config=None, model=None
) -> dict[str, Any]:
    """The JSON-able facts every EP rank must share, one entry per field compared.

    Every `OccultConfig` field is included as it is (new fields are compared without a change here),
    except the placement (its maps, without the free-form `meta`) and the profile (its content's
    digest: ranks may mount it at different paths). `model_config` (a `PretrainedConfig`, given at
    `apply_occult` only: a save changes the writing rank's copy) is compared as one field, without the
    `_`-private and `RANK_LOCAL_CONFIG_KEYS` keys. `model` (at `apply_occult` only, before anything
    changes) adds the weights: a fingerprint of every replicated tensor (`replicated_weights`) and the
    identity of the checkpoint it was loaded from (`checkpoint`).
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
    if model is not None:
        setup[REPLICATED_WEIGHTS] = replicated_weights(model, block_paths)
        setup["checkpoint"] = checkpoint_identity(model.config)
    return setup


#: the setup field of the replicated tensors' fingerprints: `{name: digest}`
REPLICATED_WEIGHTS = "replicated_weights"
#: elements of a tensor fingerprinted at once (bounds the int64 temporaries: 32 MB)
_CHUNK = 2**22
#: samples of 4 KiB read from each weight file for its identity, at evenly spaced offsets (256 KiB a file)
_FILE_SAMPLES = 64


def replicated_weights(model, block_paths: list[str]) -> dict[str, str]:
    """`{name: digest}` of every parameter and buffer of `model` that every rank holds whole: all but the routed
    experts of the MoE blocks at `block_paths` (rank-local, or not loaded yet), tensors on the meta device and
    shards of a `DTensor`.

    A digest is two wrapping int64 sums of the tensor's bytes, plain and weighted by position, computed where the
    tensor lives (a few passes over the dense weights; one host read per tensor): equal weights give equal digests
    on every rank, and a different checkpoint, a different seed or a permuted row changes them.
    """
    from occult_hf.patches import adapter_for

    adapter = adapter_for(model)
    experts = [adapter.experts_module(model.get_submodule(path)) for path in block_paths]
    local = {id(t) for module in experts for t in [*module.parameters(), *module.buffers()]}
    digests = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in local or tensor.device.type == "meta":
            continue
        whole = _whole_tensor(tensor)
        if whole is not None:
            digests[name] = _tensor_digest(whole)
    return digests


def _whole_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor itself, or a replicated `DTensor`'s local copy; None for a shard (each rank holds another part)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(tensor, DTensor):
        return tensor.to_local() if all(isinstance(p, Replicate) for p in tensor.placements) else None
    return tensor


@torch.no_grad()
def _tensor_digest(tensor: torch.Tensor) -> str:
    """`"<dtype> <shape> <plain sum> <weighted sum>"` of the tensor's bytes read as integers (wrapping int64 sums:
    the same whatever the reduction order)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0 else raw
    plain = weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
        plain = plain + chunk.sum()
        weighted = weighted + (chunk * position).sum()
    sums = torch.stack([plain, weighted]).tolist()
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} {sums[0] & (2**64 - 1):016x}{sums[1] & (2**64 - 1):016x}"


def checkpoint_identity(model_config) -> str | None:
    """What a model was loaded from, the same for equal checkpoints wherever they are mounted: a Hub checkpoint's
    repository and commit; a local directory's weight files' names, sizes, safetensors headers and 64 samples of
    4 KiB of each file (256 KiB read a file). Each rank reads only its own experts, so no rank could compare the
    others'; two checkpoints of different training runs or steps differ in nearly every byte, which the samples
    see, while an edit confined to a few tensors may fall between them (the replicated weights, routers included,
    are compared in full). None for a model not loaded from files."""
    source = getattr(model_config, "_name_or_path", "") or ""
    if not source:
        return None
    if not os.path.isdir(source):
        commit = getattr(model_config, "_commit_hash", None)
        return f"{source}@{commit}" if commit else None
    names = sorted(n for n in os.listdir(source) if n.endswith((".safetensors", ".safetensors.index.json", ".bin")))
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        path = os.path.join(source, name)
        size = os.path.getsize(path)
        digest.update(f"{name} {size}\n".encode())
        with open(path, "rb") as f:
            for offset in sorted({size * i // _FILE_SAMPLES for i in range(_FILE_SAMPLES)} | {0}):
                f.seek(offset)
                digest.update(f.read(4096))
            if name.endswith(".safetensors") and size >= 8:  # the header: every tensor's name, dtype and offsets
                f.seek(0)
                digest.update(f.read(min(int.from_bytes(f.read(8), "little"), 2**26)))
    return f"sha256:{digest.hexdigest()[:24]}"


def check_agreement(
    setup: dict[str, Any], group, operation: str, timeout_s: float, failed: Exception | None = None
) -> None:
    """Collective: raise `EPConfigMismatchError` on every rank of `group` unless all hold the same `setup`.

    `failed`: this rank's own checks raised it before it had a setup (use `fail_together`); every other
    rank then raises an error naming this rank and its error.
    """
    setup = {**setup, FAILED: None if failed is None else _failure_text(failed)}
    names = sorted(setup)
    if len(names) + 1 > MAX_FIELDS:
        raise ValueError(f"check_agreement compares at most {MAX_FIELDS - 1} fields, got {len(names)}")
    digests_F = torch.zeros(MAX_FIELDS, dtype=torch.int64)
    digests_F[0] = _digest(names)
    for i, name in enumerate(names):
        digests_F[i + 1] = _digest(setup[name])
    world = dist.get_world_size(group)
    table = [torch.empty_like(digests_F) for _ in range(world)]
    start = lambda: dist.all_gather(table, digests_F, group=group, async_op=True)  # noqa: E731
    bounded(f"the configuration check at {operation}", None, timeout_s, start, group)
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
        dicts = all(isinstance(v, dict) for v in values)
        if name == "placement" and dicts:
            parts.append(f"placement ({placement_differences({f'rank {r}': v for r, v in enumerate(values)})})")
        elif name == "model_config" and dicts:
            parts.append(f"the model config ({_config_difference(values)})")
        elif name == REPLICATED_WEIGHTS and dicts:
            parts.append(f"the replicated weights (they differ in {shown(differing_keys(values))}: the ranks loaded different weights)")
        else:
            by_rank = ", ".join(f"rank {r} {v!r}" if not isinstance(v, dict) else f"rank {r} {v}" for r, v in enumerate(values))
            parts.append(f"{name} ({by_rank})")
    return (
        f"occult_hf: the expert-parallel ranks disagree at {operation} on {'; '.join(parts)}. Every rank of the EP "
        f"group must use the same OccultConfig, placement file, routing profile, model config, dtype and checkpoint "
        f"(weights a rank initialises itself need the same seed on every rank); "
        f"rank {_rank()} stops here instead of computing a wrong model"
    )


def _config_difference(values: list[dict[str, Any]]) -> str:
    keys = differing_keys(values)
    return "; ".join(f"{k}: " + ", ".join(f"rank {r} {v.get(k, ABSENT)!r}" for r, v in enumerate(values)) for k in keys)


def _summary(value: Any, name: str = "") -> Any:
    """What the error shows of a field: short values as they are, a placement per layer and field, the model config's
    keys with their short values (else digests), else a digest."""
    if isinstance(value, dict) and "layers" in value:  # the placement
        return {
            "num_experts": value.get("num_experts"),
            "num_devices": value.get("num_devices"),
            "layers": {str(l): f"{_digest(d):016x}" for l, d in value["layers"].items()},
            **{k: f"{_digest(v):016x}" for k, v in value.items() if k not in ("num_experts", "num_devices", "layers")},
        }  # the other fields (replicas, slots_per_device, pin_slack, ...) one digest each: the error names them
    if name == FAILED and value is not None:
        return value[:2000]
    if name == "model_config":
        return {k: _summary(v) for k, v in value.items()}
    if name == REPLICATED_WEIGHTS:
        return dict(value)  # per tensor: the error names those that differ
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
    "JOIN_TIMEOUT_ENV",
    "DEFAULT_JOIN_TIMEOUT_S",
    "join_timeout_s",
    "arrive",
    "announce_failure",
    "bounded",
    "failed_on",
    "is_peer_failure",
    "peer_error",
    "effective_setup",
    "replicated_weights",
    "checkpoint_identity",
    "check_agreement",
    "fail_together",
]
