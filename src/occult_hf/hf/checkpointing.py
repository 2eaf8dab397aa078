"""Saving a model with occult_hf applied, and gathering its experts from the EP ranks.

- `save_pretrained(model, save_directory, ...)` (bound on the model instance by `apply_occult`)
  writes a vanilla checkpoint (all experts, in original order, gathered from the EP ranks) plus
  `occult_placement.json`, with `occult_config` on the config.
- `snapshot_experts(model)` gathers the experts ahead of a rank-0-only save.
- `gather_full_experts` (save, `unapply_occult`) and the EP configuration check
  (`check_model_ranks_agree`) run on a gloo group of the EP ranks made by `new_save_group`.

Saving under EP is collective: `save_pretrained` gathers the experts to EP rank 0, which writes, and every rank
returns once the files are in place. HF
Trainer calls `save_pretrained` on rank 0 only; `occult_hf.hf.trainer` (installed with `install()`)
hooks the Trainer's `save_model`, which every rank runs, to gather a snapshot of the experts first,
and rank 0's `save_pretrained` writes from that snapshot while it is current. A save
that needs a gather the other ranks never join fails after `OCCULT_SAVE_TIMEOUT_S` seconds (default
300) with an error that says so, instead of hanging; before it gathers, and at `apply_occult`, the ranks
check that they agree on the whole EP configuration (`occult_hf.distributed.agreement`).

A save never tears: every file is first written into a staging directory inside `save_directory` (a
failure there leaves the previous checkpoint untouched), then published (`publish_staged`) so that the
directory loads the previous weights or the new ones whenever the process stops, never a mix: new shards under
names no old file has, one file (the index, or a single `model.safetensors`) as the commit point, old
shards removed after it, `config.json` last.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from .blocks import place_full_experts
from .state import BLOCKS, OccultState, state_of
from ..distributed.agreement import (
    JOIN_TIMEOUT_ENV,
    SAVE_TIMEOUT_ENV,
    arrive,
    check_agreement,
    effective_setup,
    failed_on,
    join_timeout_s,
    save_timeout_s,
)
from ..distributed.collectives import gather_rows
from ..moe import OccultMoE
from ..placement import PLACEMENT_FILENAME
from ..pruning import pruners_of
from ..utils.checks import shown
from ..utils.atomic import atomic_write_json, atomic_write_text
from ..utils.strict_json import parse_json, read_json_file
from .model_card import CARD_FILENAME, PRUNING_CONFIG_KEY, card_with_pruning, pruning_description, strip_pruning_section

# ----- the EP ranks agree, and the group for gathers ------------------------------------------------


def new_save_group(ep_group, operation: str = "apply_occult"):
    """A gloo group of the ranks of the process group `ep_group`, for the agreement check and the expert gathers
    (CPU tensors); collective (`operation` names it in errors).

    The ranks first meet in the job's store (`agreement.arrive`), bounded by `OCCULT_SAVE_TIMEOUT_S`: they may
    reach `apply_occult` minutes apart (loading weights), and one that failed before it (`from_pretrained`'s
    early check announces it) or never comes is named instead of holding the others until the process
    group's timeout. Each later wait on the group is bounded the same way (`agreement.bounded`).

    One group serves every model of the same ranks: a process group is freed only when all its ranks destroy it
    together, so a group per model would keep its sockets and threads for good (5 descriptors and 3 threads a
    conversion at 2 ranks). The ranks reuse it where each holds the same one, by the generation they announce at the
    meeting, and make a new one where some rank does not, or a wait on it failed (`agreement.failed_on`).
    """
    ranks = tuple(dist.get_process_group_ranks(ep_group))
    generation, group = _SAVE_GROUPS.get(ranks, (0, None))
    usable = group is not None and not failed_on(group)
    held = list(arrive(ep_group, operation, save_timeout_s(), SAVE_TIMEOUT_ENV, payload=generation if usable else None).values())
    if usable and all(other == generation for other in held):
        return group
    group = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
    _SAVE_GROUPS[ranks] = (max(other or 0 for other in held) + 1, group)
    return group


#: `{EP ranks: (generation, gloo group)}` of `new_save_group`
_SAVE_GROUPS: dict[tuple[int, ...], tuple[int, object]] = {}


def check_model_ranks_agree(model: nn.Module, state: OccultState, operation: str) -> None:
    """Collective (EP only), the first step of every save or gather: the pruners' limits in force are put on the
    config (`record_running_limits`, on every rank alike: the Trainer's rank-0-only save must not record them on one
    rank), every rank joins within `OCCULT_JOIN_TIMEOUT_S` (else an error naming the ranks that did not), then every
    rank holds the same effective EP setup, else an error on every rank."""
    record_running_limits(model, state)
    if not state.ep.is_distributed:
        return
    arrive(state.ep.group, operation, join_timeout_s(), JOIN_TIMEOUT_ENV)
    expert_weight = model.get_submodule(state.block_paths[0]).local_experts.gate_up_proj
    setup = effective_setup(state.occult_config, state.block_paths, expert_weight)
    check_agreement(setup, state.agreement_group, operation, state.save_timeout_s)


@torch.no_grad()
def gather_full_experts(module: OccultMoE, state: OccultState, to_all: bool):
    """The layer's full `(gate_up [E, 2I, H], down [E, H, I])` in original expert order.

    One process: the local weights themselves. EP: a gloo gather to EP rank 0 (`to_all=False`; other
    ranks get None) or an all-gather (`to_all=True`), through CPU, padded to the largest capacity.
    """
    experts = module.local_experts
    if not state.ep.is_distributed:
        return experts.gate_up_proj.detach(), experts.down_proj.detach()
    placement, layer = state.placement, module.layer_idx
    gathered = []
    for weight_L in (experts.gate_up_proj, experts.down_proj):
        parts = gather_rows(
            weight_L.detach().cpu(), 0, placement.capacities(layer), state.agreement_group, to_all,
            what=f"gathering the experts (save_pretrained/unapply_occult) of layer {layer}", timeout_s=state.save_timeout_s,
        )
        if parts is not None:  # None: gathered to EP rank 0, not this rank
            full = torch.empty((placement.num_experts, *weight_L.shape[1:]), dtype=weight_L.dtype)
            for device, part in enumerate(parts):
                full[placement.experts_on(layer, device)] = part
            gathered.append(full)
    return tuple(gathered) if gathered else None


# ----- saving -----------------------------------------------------------------------------------


def save_pretrained(model, save_directory, *args, **kwargs):
    """`save_pretrained` of a replaced model: a vanilla checkpoint plus `occult_placement.json`.

    Under EP every rank must call it unless `snapshot_experts(model)` ran since the last weight
    update (what the Trainer hook in `hf.trainer` does); EP rank 0 writes.
    """
    state = state_of(model, BLOCKS)
    if kwargs.get("state_dict") is not None:
        raise ValueError(
            "save_pretrained(state_dict=...) is not supported on an occult_hf model: its state dict holds each "
            "rank's local experts; call save_pretrained without state_dict to write the vanilla checkpoint"
        )
    kwargs.pop("state_dict", None)
    is_main_process = kwargs.pop("is_main_process", True)
    from_snapshot = _snapshot_is_current(model, state)
    every_rank_saves = state.ep.is_distributed and not from_snapshot
    full_experts = state.snapshot if from_snapshot else _gather_for_save(model, state)
    if full_experts is None or not is_main_process:
        if every_rank_saves:
            _written(state, save_directory)
        return None
    try:
        result = _write(model, state, full_experts, save_directory, args, kwargs)
    except Exception as error:
        if every_rank_saves:  # the other ranks stop waiting for the files at once, naming the error
            arrive(state.agreement_group, _WRITTEN, 0.0, SAVE_TIMEOUT_ENV, failed=error)
        raise
    if every_rank_saves:
        _written(state, save_directory)
    return result


#: the arrival that ends a save every rank made: EP rank 0 reaches it once the files are in place
_WRITTEN = "save_pretrained's files"


def _written(state: OccultState, save_directory) -> None:
    """Every rank of a save they all made returns once EP rank 0 has written the files (or did not write them,
    `is_main_process=False`): a rank that loads the directory right after its own call then finds it whole. Bounded
    by `OCCULT_SAVE_TIMEOUT_S` (rank 0 may take minutes to write a large model); rank 0's failure is named at once."""
    arrive(state.agreement_group, _WRITTEN, state.save_timeout_s, SAVE_TIMEOUT_ENV, os.fspath(save_directory),
           advice=f"EP rank 0 did not finish writing {os.fspath(save_directory)!r} in time")  # fmt: skip


def _write(model, state: OccultState, full_experts, save_directory, args, kwargs):
    """EP rank 0's part of `save_pretrained`: the vanilla checkpoint and occult_hf's files, staged then published."""
    state_dict = _vanilla_state_dict(model, state, full_experts)
    if os.path.isfile(save_directory):
        raise FileExistsError(f"save_pretrained: {os.fspath(save_directory)!r} is a file, expected a directory")
    os.makedirs(save_directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=save_directory)
    try:
        try:
            state.placement.save(os.path.join(staging, PLACEMENT_FILENAME))
            result = type(model).save_pretrained(model, staging, *args, state_dict=state_dict, **kwargs)
            add_pruning_files(state, staging, os.fspath(save_directory))
        except (OSError, SafetensorError) as error:  # a full disk: safetensors names no file, an OSError a staged one
            raise OSError(
                f"save_pretrained {os.fspath(save_directory)!r}: writing the checkpoint failed, and the files already "
                f"there are unchanged ({' '.join(str(error).split())[:300]})"
            ) from error
        publish_staged(staging, os.fspath(save_directory))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


#: the similarity-pruning profile's name inside a checkpoint
PROFILE_FILENAME = "occult_profile.safetensors"


def record_running_limits(model, state: OccultState) -> None:
    """Put the `N_d` / `N_n` the pruners run at on the state and `model.config`, so that a save describes the model
    as it runs: `OccultCallback`'s schedule (and a user's `pruner.max_devices_per_token = n`) changes the pruners,
    not the config they were built from."""
    limits = {(p.max_devices_per_token, p.max_nodes_per_token) for p in pruners_of(model).values()}
    if not limits:
        return
    if len(limits) > 1:
        raise ValueError(
            f"save_pretrained: the pruned layers run different limits (N_d, N_n) {sorted(limits, key=str)}, which one "
            "OccultConfig cannot describe; set the same max_devices_per_token / max_nodes_per_token on every pruner"
        )
    ((max_devices, max_nodes),) = limits
    config = state.occult_config
    if (config.max_devices_per_token, config.max_nodes_per_token) != (max_devices, max_nodes):
        state.occult_config = replace(config, max_devices_per_token=max_devices, max_nodes_per_token=max_nodes)
        model.config.occult_config = state.occult_config.to_dict()


def add_pruning_files(state: OccultState, staging: str, target: str) -> None:
    """What a pruned model's save adds to the files transformers wrote in `staging` (bound for `target`; the same
    directory where a save writes in place): its similarity profile (`_bundle_profile`), and the pruning description
    in `config.json` and the model card (`_describe_pruning`)."""
    _bundle_profile(state.pruning_profile, staging)
    _describe_pruning(state.occult_config, staging, target)


def _bundle_profile(profile, staging: str) -> None:
    """A similarity-pruned model's routing profile (the one its pruners were built from, kept in memory: its file
    may be gone) goes into the checkpoint, and its staged config names it there: a relative path in a
    checkpoint's config names a file of the checkpoint, so the save is whole wherever it is loaded."""
    config_file = os.path.join(staging, "config.json")
    if profile is None or not os.path.isfile(config_file):
        return
    profile.save(os.path.join(staging, PROFILE_FILENAME))
    saved = read_json_file(config_file, "the staged config")
    saved["occult_config"] = {**saved["occult_config"], "profile": PROFILE_FILENAME}
    atomic_write_json(config_file, saved, indent=2, sort_keys=True)


def _describe_pruning(config, staging: str, target: str) -> None:
    """A pruned model's staged `config.json` and model card say so (`hf.model_card`); an exact model's card loses a
    pruning section an earlier save of the directory left (its config lost the loaded description at
    `hf.state.attach_state`)."""
    description = pruning_description(config)
    config_file = os.path.join(staging, "config.json")
    if description is not None and os.path.isfile(config_file):
        saved = read_json_file(config_file, "the staged config")
        atomic_write_json(config_file, {**saved, PRUNING_CONFIG_KEY: description}, indent=2, sort_keys=True)
    describe_in_card(config, staging, target)


def describe_in_card(config, staging: str, target: str) -> None:
    """The model card of `target` (written to `staging`) with a pruned model's section (`hf.model_card`), or without
    an older one for an exact model: a save's card, and the card a Trainer writes over a saved model's."""
    card = os.path.join(target, CARD_FILENAME)
    existing = Path(card).read_text(encoding="utf-8") if os.path.isfile(card) else None
    if config.prune is not None:
        atomic_write_text(os.path.join(staging, CARD_FILENAME), card_with_pruning(config, existing))
    elif existing is not None and strip_pruning_section(existing) != existing:
        atomic_write_text(os.path.join(staging, CARD_FILENAME), strip_pruning_section(existing))


#: the prefix of the staging folders occult_hf's saves write into inside the save's directory (this module's, and
#: `native_ep`'s `.occult_save-native`); one that a killed save left stays there
STAGING_PREFIX = ".occult_save-"

#: in a checkpoint directory while `publish_staged` replaces an earlier save's files by a new one's
#: (`check_publish_finished`)
PUBLISHING_FILENAME = "occult_publishing.json"

#: weight files of a checkpoint: model.safetensors, shards (under transformers' names or the fresh names
#: `publish_staged` gives them, `model-<8 hex>-00001-of-00003.safetensors`) and their index, of any variant
#: (`save_pretrained(variant="fp16")`: `model.fp16.safetensors`, `model.fp16-00001-of-00003.safetensors`,
#: `model.safetensors.index.fp16.json`)
_WEIGHT_FILE = re.compile(
    r"(?:model|pytorch_model)(?:\.(?P<variant>[^.-]+))?(?:-[0-9a-f]{8})?(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)"
    r"|(?:model\.safetensors|pytorch_model\.bin)\.index(?:\.(?P<index_variant>[^.]+))?\.json"
)
#: the rank shards of transformers' `save_pretrained(distributed_checkpoint=True)`, which its loader prefers to every
#: other weight file of the directory (`transformers.distributed.checkpoint.is_sharded_checkpoint`): torch DCP's name
#: of rank R + 1's file F of the N each rank writes
RANK_SHARD = re.compile(r"shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors")


def weight_files(directory: str) -> list[str]:
    """Every file of `directory` that transformers' loaders may read as weights: model files, shards and indexes of
    any variant, and a distributed checkpoint's rank shards (none where the directory does not exist)."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if _WEIGHT_FILE.fullmatch(n) or RANK_SHARD.fullmatch(n))


def replaced_weight_files(current: list[str], earlier: list[str]) -> list[str]:
    """The names of `earlier` (a directory's or a Hub repository's files) that a save whose weight files are `current`
    replaces: beside rank shards every other weight file (transformers reads every `.safetensors` file of such a
    directory as one checkpoint); else rank shards (loaded before anything else), and the weight files of the
    variants `current` holds that it does not name (an old single file loads before a new index). Another variant's
    files stay."""
    current_set = set(current)
    beside_rank_shards = any(RANK_SHARD.fullmatch(n) for n in current_set)
    variants = {_variant_of(n) for n in current_set if _WEIGHT_FILE.fullmatch(n)}

    def replaced(name: str) -> bool:
        if name in current_set or not (_WEIGHT_FILE.fullmatch(name) or RANK_SHARD.fullmatch(name)):
            return False
        return beside_rank_shards or RANK_SHARD.fullmatch(name) is not None or _variant_of(name) in variants

    return sorted(filter(replaced, earlier))


def _variant_of(weight_file: str) -> str | None:
    """The variant of a `_WEIGHT_FILE` name ("fp16"), None for the plain weights."""
    match = _WEIGHT_FILE.fullmatch(weight_file)
    return match["variant"] or match["index_variant"]


def _loaded_first(variant: str | None) -> tuple[str, ...]:
    """The files that decide which weights of `variant` a directory loads, in transformers' order of preference."""
    tag = f".{variant}" if variant else ""
    return (f"model{tag}.safetensors", f"model.safetensors.index{tag}.json", f"pytorch_model{tag}.bin",
            f"pytorch_model.bin.index{tag}.json")  # fmt: skip


def publish_staged(staging: str, target: str) -> None:
    """Move a complete save from `staging` into `target` so that `target` loads the old save or the new one, never a
    mix, whenever the process stops.

    1. New shards go in under names no file in `target` has (the old index still names the old shards),
       and the staged index is rewritten to name them.
    2. The other files (`occult_placement.json` first).
    3. The commit: the one file that decides what loads (`_loaded_first`: a single `model.safetensors`, else
       the index) is renamed over the old one, and an old file that would still be preferred to it is removed
       (a distributed checkpoint's rank shards among them).
    4. `config.json` (which holds the placement inline).
    5. The old weight files of the save's variant no longer named by the new save are removed (another variant's
       stay: a directory may hold the plain weights and an "fp16" variant, as Hub repositories do).

    Every file is whole before the first rename, so a failure while writing leaves `target` as it was. From step 2
    to step 4 `target` holds `PUBLISHING_FILENAME`, with digests of the old and the new `config.json`: a process that
    stops there leaves files of both saves (the new weights beside the old `config.json`, whose `occult_config`
    would run them pruned or placed as the old save was), and `check_publish_finished` refuses the directory while
    its `config.json` is still the old one.
    """
    staged = sorted(os.listdir(staging))
    weights = [n for n in staged if _WEIGHT_FILE.fullmatch(n)]
    variants = {_variant_of(n) for n in weights}
    loaded_first = _loaded_first(next(iter(variants))) if len(variants) == 1 else ()
    commit = next((n for n in loaded_first if n in weights), None)
    if commit is None:
        raise RuntimeError(
            f"save_pretrained: occult_hf cannot publish the weight files transformers wrote ({shown(staged)} in "
            f"{staging!r}): it knows one variant of model.safetensors, its shards and index, or pytorch_model.bin; "
            f"the previous checkpoint in {target!r} is unchanged"
        )
    kept = {commit}
    for index in (n for n in weights if n.endswith(".json")):  # the index, of any variant
        kept |= {index, *_move_shards(staging, target, index)}
    rest = [n for n in staged if n not in weights and n != "config.json"]
    marker = os.path.join(target, PUBLISHING_FILENAME)
    before = _digest(os.path.join(target, "config.json"))
    after = _digest(os.path.join(staging, "config.json")) if "config.json" in staged else before
    atomic_write_json(marker, {"config_before": before, "config_after": after})
    for name in sorted(rest, key=lambda n: n != PLACEMENT_FILENAME):
        _replace(os.path.join(staging, name), os.path.join(target, name))
    _replace(os.path.join(staging, commit), os.path.join(target, commit))
    for earlier in loaded_first[: loaded_first.index(commit)]:  # an old single file would still load first
        if os.path.isfile(os.path.join(target, earlier)):
            os.remove(os.path.join(target, earlier))
    for name in os.listdir(target):  # transformers loads a distributed checkpoint's shards before anything else
        if RANK_SHARD.fullmatch(name):
            os.remove(os.path.join(target, name))
    if "config.json" in staged:
        _replace(os.path.join(staging, "config.json"), os.path.join(target, "config.json"))
    os.remove(marker)  # the new save loads whole from here on
    for name in os.listdir(target):
        stale = _WEIGHT_FILE.fullmatch(name) and _variant_of(name) in variants and name not in kept
        if stale and os.path.isfile(os.path.join(target, name)):
            os.remove(os.path.join(target, name))


def check_publish_finished(directory: str) -> None:
    """Raise when a save into the checkpoint directory `directory` stopped while `publish_staged` moved it in: the
    marker it left is there and `config.json` is still the old save's, so its files may come from two saves and
    occult_hf would run the new weights with the old save's placement and pruning, silently. A marker whose save
    changed no `config.json`, or whose directory holds another `config.json` since (a later save of any kind, in
    place), or one that cannot be read, says nothing about the files and is ignored."""
    marker = os.path.join(directory, PUBLISHING_FILENAME)
    if not os.path.isfile(marker):
        return
    try:
        configs = read_json_file(marker, "publish marker")
        before, after = configs["config_before"], configs["config_after"]
    except (ValueError, TypeError, KeyError):  # written atomically: not ours, or edited since
        return
    if before != after and _digest(os.path.join(directory, "config.json")) == before:
        raise RuntimeError(
            f"checkpoint {os.path.normpath(directory)!r}: a save_pretrained into it stopped while it replaced the "
            f"files of the earlier save ({PUBLISHING_FILENAME} is there and config.json is still the earlier one), so "
            f"it may hold the new weights beside the old config.json; save the model into it again, or load a copy "
            f"of either save"
        )


def _digest(path: str) -> str | None:
    """The sha256 of a file's bytes, None where there is no file."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _move_shards(staging: str, target: str, index: str) -> set[str]:
    """Move the shards the staged `index` names into `target`, each under a name no file there has; rewrite the
    staged index to name them. Returns the names they have in `target`."""
    with open(os.path.join(staging, index), "rb") as f:
        data = parse_json(f.read(), f"the staged index {index!r}")
    taken, token = set(os.listdir(target)), secrets.token_hex(4)
    renamed = {}
    for shard in sorted(set(data["weight_map"].values())):
        prefix, _, numbering = shard.partition("-")  # "model", "00001-of-00003.safetensors"
        renamed[shard] = shard if shard not in taken else f"{prefix}-{token}-{numbering}"
        _replace(os.path.join(staging, shard), os.path.join(target, renamed[shard]))
    data["weight_map"] = {key: renamed[shard] for key, shard in data["weight_map"].items()}
    atomic_write_json(os.path.join(staging, index), data, indent=2, sort_keys=True)
    return set(renamed.values())


def _replace(source: str, destination: str) -> None:
    if os.path.isdir(source):
        shutil.rmtree(destination, ignore_errors=True)
    os.replace(source, destination)


def snapshot_experts(model: nn.Module) -> None:
    """Collective: gather every layer's experts to EP rank 0 (CPU) for a later rank-0-only save.

    The snapshot serves `save_pretrained` until the expert weights change (checked with the local
    parameters' version counters).
    """
    state = state_of(model, BLOCKS)
    if not state.ep.is_distributed:
        return
    check_model_ranks_agree(model, state, "snapshot_experts")
    state.snapshot = _gather_experts(model, state)
    state.snapshot_versions = _expert_versions(model, state)


def _snapshot_is_current(model, state) -> bool:
    """Whether `save_pretrained` writes the snapshot (EP: taken since the last change of the expert weights, and
    written with the limits it recorded) rather than gathering the experts, which every rank must join."""
    return state.ep.is_distributed and state.snapshot_versions == _expert_versions(model, state)


def _gather_for_save(model, state) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """Collective (EP): `{path: (gate_up [E, 2I, H], down [E, H, I])}` on the writing rank (EP rank 0), None
    elsewhere, once the ranks have checked that they agree."""
    check_model_ranks_agree(model, state, "save_pretrained")
    return _gather_experts(model, state)


def _gather_experts(model, state) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """Collective (EP): every layer's full experts on EP rank 0 (one process: this one), None on the other ranks."""
    full = {path: gather_full_experts(model.get_submodule(path), state, to_all=False) for path in state.block_paths}
    return full if not state.ep.is_distributed or state.ep.rank == 0 else None


def _expert_versions(model, state) -> tuple[int, ...]:
    versions = []
    for path in state.block_paths:
        experts = model.get_submodule(path).local_experts
        versions += [experts.gate_up_proj._version, experts.down_proj._version]
    return tuple(versions)


def _vanilla_state_dict(model, state, full_experts) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each block's local experts replaced by the family's vanilla entries (a plain dict:
    the metadata's local slot orders describe the replaced entries)."""
    state_dict = dict(model.state_dict())
    for path in state.block_paths:
        module = model.get_submodule(path)
        runtime_names = {f"{path}.{name}" for name in module.runtime_state_names()}
        for name in list(state_dict):
            if name.startswith(f"{path}.experts.") or name in runtime_names:
                del state_dict[name]
        for key, value in place_full_experts(module, *full_experts[path]).items():
            state_dict[f"{path}.{key}"] = value
    return state_dict


__all__ = ["save_pretrained", "snapshot_experts"]
