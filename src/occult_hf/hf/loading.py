"""Per-rank loading of the routed experts on the `occult_config` path: each rank reads only its own.

Without it, `from_pretrained(path, occult_config=...)` under torch.distributed builds the full model on
every rank (every expert of every layer) and `apply_occult` then keeps this rank's share: the peak per
rank is the whole checkpoint, which is impossible for the models EP exists for. With it, while
transformers loads the checkpoint (`hf.compat.intercept_state_dict_loading`):

1. the routed experts' checkpoint keys are taken out of the lazily opened safetensors state dict, so
   transformers never reads them, and the model's expert parameters are taken off its missing-key
   list, so they stay on the meta device (never allocated, never randomly initialised);
2. while the files are still open, this rank reads, per MoE layer, exactly the experts its placement
   puts on it (primary and replica homes, local-slot order) with `safe_open(...).get_slice`, and hands
   them to `OccultMoE` (which takes them instead of slicing the full weights).

Checkpoint layouts, per layer (the experts module's keys, with or without the base-model prefix, after
transformers' key renamings for the family):
transformers 5's fused `experts.gate_up_proj` `[E, 2I, H]` / `experts.down_proj` `[E, H, I]` (what
`save_pretrained` of a model built from a config writes), and the per-expert layout of published
checkpoints, `experts.{e}.gate_proj/up_proj/down_proj.weight` (Mixtral: `w1/w3/w2`), `[I, H]` / `[I, H]`
/ `[H, I]`; gate_up is gate then up, as transformers' own conversion concatenates them.

A `device_map` that puts the whole model on one device (`"cpu"`, `{"": "cuda:1"}`, `1`) is where this
rank's experts are read to, one expert at a time; transformers' CUDA allocator warmup (one block the size
of every parameter on the device) leaves the routed experts out. Anything else (a `device_map` that spreads
the model or offloads it, another layout or key, shapes that disagree with the model, `tp_plan`/no process
group, a `.bin` checkpoint) falls back to the full load with a logged reason: never a silently wrong model.

Every `from_pretrained` with occult_hf installed also checks a distributed checkpoint (the rank shards of
`save_pretrained(distributed_checkpoint=True)`, which transformers prefers to any other weight file) before torch DCP
reads it: `check_rank_shards` refuses one whose shards hold only part of a tensor, naming the missing shard files.

Shape legend: E routed experts, L local experts (slots), I expert width, H hidden.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field

import torch

from occult_hf.patches import adapter_for

from .checkpointing import RANK_SHARD, check_publish_finished
from .compat import (
    UNSET,
    check_distributed_checkpoint_loading,
    intercept_state_dict_loading,
    keep_expert_conversions,
    skip_allocator_warmup_for,
)
from ..config import OccultConfig, stored_occult_config
from ..dispatch.group import check_group_size
from ..distributed.agreement import announce_failure
from ..utils.logging import get_logger
from .blocks import LOADED_EXPERTS_ATTR
from ..placement import Placement

logger = get_logger(__name__)


_PER_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_FUSED = ("gate_up_proj", "down_proj")


@dataclass
class _LayerPlan:
    """The checkpoint keys of one MoE layer's routed experts and what this rank reads of them."""

    block: torch.nn.Module
    adapter: object
    layer: int
    model_prefix: str  # the experts module's path in the model, e.g. "model.layers.0.mlp.experts"
    expert_ids: list[int]
    keys: dict[str, str] = field(default_factory=dict)  # rest of the key ("3.gate_proj.weight") -> full key


#: the attribute of a model loaded by `from_pretrained` that holds its `LoadReport`
REPORT_ATTR = "occult_load_report"


@dataclass
class LoadReport:
    """What one `from_pretrained` read on this rank: `{layer: expert ids}` and the expert bytes read, or why it
    read the full checkpoint (`fallback_reason`). Kept on the loaded model as `model.occult_load_report`."""

    experts_read: dict[int, list[int]] = field(default_factory=dict)
    expert_bytes_read: int = 0
    fallback_reason: str | None = None


class _LoadScope(contextlib.ExitStack):
    """The context one `from_pretrained` runs in; it enters as the function that puts its report on the model.

    With `announce` (an `occult_config` was given, so the other ranks will wait for this one at `apply_occult`), a
    load that fails (a checkpoint file missing or corrupt on this rank's copy) tells them: they raise at once,
    naming this rank and its error, instead of after `OCCULT_SAVE_TIMEOUT_S`."""

    def __init__(self, report: LoadReport, announce: bool = False) -> None:
        super().__init__()
        self.report, self.announce = report, announce

    def __enter__(self):
        super().__enter__()
        return lambda model: model.__dict__.__setitem__(REPORT_ATTR, self.report)

    def __exit__(self, kind, error, traceback):
        if self.announce and isinstance(error, Exception):
            announce_failure(error, "from_pretrained")
        return super().__exit__(kind, error, traceback)


def load_scope(occult_config, kwargs: dict, model_class: type | None = None, checkpoint=None):
    """The context `from_pretrained` runs in: per-rank expert loading when it applies, else nothing.

    A given `occult_config` is validated first, and so is the model type (from the config the Auto classes
    pass, else from `model_class`'s config class), so a bad one fails before the checkpoint is read (a real
    checkpoint takes minutes to read; both are checked again when the config is applied). A local `checkpoint`
    directory that a save stopped publishing into is refused first (`checkpointing.check_publish_finished`)."""
    if isinstance(checkpoint, (str, os.PathLike)):
        check_publish_finished(os.path.join(checkpoint, kwargs.get("subfolder") or ""))
    report = LoadReport()
    scope = _LoadScope(report, announce=occult_config is not UNSET and occult_config is not None)
    if scope.announce:
        try:
            occult_config = OccultConfig.coerce(occult_config)
            _check_model_type(kwargs.get("config"), model_class)
            if _distributed() and kwargs.get("distributed_config") is None:  # the EP group of a load is the world:
                # a device count it cannot run fails here, not in apply_occult after every rank read every expert
                check_group_size(occult_config.num_devices, torch.distributed.get_world_size())
        except Exception as error:  # the other ranks will wait at apply_occult: they raise at once, naming this one
            announce_failure(error, "from_pretrained")
            raise
    scope.enter_context(check_distributed_checkpoint_loading(check_rank_shards))
    if kwargs.get("distributed_config") is not None:  # transformers' EP reads each rank's share itself
        report.fallback_reason = "transformers' EP (distributed_config=) loads the experts"
        return scope
    reason = _unsupported_call(occult_config, kwargs)
    device, device_reason = device_of_map(kwargs.get("device_map"))
    reason = reason or device_reason
    if reason is not None:
        _fall_back(report, reason, occult_config)
        return scope
    # UNSET: the checkpoint's config may hold the occult_config (`_apply_on_load` applies it); read there
    loader = ExpertLoader(occult_config, report, device, kwargs.get("subfolder") or "")
    scope.enter_context(intercept_state_dict_loading(loader))
    scope.enter_context(skip_allocator_warmup_for(_routed_expert_filter()))
    return scope


def check_rank_shards(model, directory: str) -> None:
    """Raise `FileNotFoundError` naming the missing rank shards when the distributed checkpoint in `directory` holds
    only part of one of `model`'s tensors.

    torch DCP takes a tensor's size from the chunks it finds and reads only the chunks there are: without the last
    rank's shard it fails on a size mismatch that names no file, and without any other rank's shard it loads, the
    rows that shard held left as the uninitialised memory the model was materialised into (NaN logits). The shard
    names do not say how many ranks saved (`-of-N` counts one rank's files), so the check is the chunks' elements
    against the model's tensor; a rank whose save plan was empty writes no file, so a gap in the numbering alone
    is no error. Tensors the checkpoint lacks are left to DCP's own "Missing key" error."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    stored = HuggingFaceStorageReader(directory).read_metadata().state_dict_metadata
    short = {}
    for key, tensor in get_model_state_dict(model).items():
        entry = stored.get(key)
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(tensor, torch.Tensor):
            continue
        chunks = {(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks}
        held, total = sum(math.prod(sizes) for _, sizes in chunks), tensor.numel()
        if held < total:
            short[key] = (held, total)
    if not short:
        return
    key, (held, total) = next(iter(short.items()))
    more = f" and only part of {len(short) - 1} more tensors" if len(short) > 1 else ""
    raise FileNotFoundError(
        f"the distributed checkpoint in {os.path.normpath(directory)} is incomplete: its rank shards hold {held} of "
        f"the {total} elements of {key}{more}; {_missing_rank_shards(os.listdir(directory))}. A rank died in "
        "save_pretrained(distributed_checkpoint=True), a copy was cut short or a file was deleted: copy the missing "
        "files from the complete checkpoint or save the model again (loading it would leave the missing rows "
        "uninitialised)"
    )


def _missing_rank_shards(names: list[str]) -> str:
    """The rank shards missing from a directory of `names` (transformers found one there at least), in words: the
    gaps in the rank numbering, else the files of the rank after the last present (a trailing rank's absence shows
    in no name)."""
    present = {tuple(int(part) for part in match.groups()) for match in map(RANK_SHARD.fullmatch, names) if match}
    last, counts = max(rank for rank, _, _ in present), sorted({count for _, _, count in present})
    expected = [(rank, file, count) for rank in range(1, last + 1) for count in counts for file in range(1, count + 1)]
    missing = [_rank_shard_name(*shard) for shard in expected if shard not in present]
    if missing:
        return "missing rank shard files: " + ", ".join(missing)
    after = ", ".join(_rank_shard_name(last + 1, file, count) for count in counts for file in range(1, count + 1))
    return f"the rank shards after shard-{last:05d} are missing (from {after} on)"


def _rank_shard_name(rank: int, file: int, count: int) -> str:
    return f"shard-{rank:05d}-model-{file:05d}-of-{count:05d}.safetensors"


def device_of_map(device_map) -> tuple[torch.device | None, str | None]:
    """`(device, None)` for a `from_pretrained(device_map=...)` that puts the whole model on one device
    (`None`, `"cpu"`, `"cuda:1"`, `1`, a `torch.device`, `{"": ...}` or a dict whose values are all the same
    device); `(None, reason)` for one that spreads it (`"auto"`, several devices, `"disk"`). Per-rank expert
    loading reads this rank's experts onto that device: a rank under EP holds its experts and the whole dense
    part (DDP), so a map that spreads the model over devices or offloads it is not an EP layout."""
    if device_map is None:
        return None, None
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    devices = {_device(value) for value in values}
    if len(devices) != 1 or None in devices:
        shown = device_map if not isinstance(device_map, dict) else sorted(map(str, set(values)))
        return None, (
            f"device_map={shown!r} does not put the whole model on one device; per-rank expert loading needs "
            f"this rank's device, e.g. device_map={{'': 'cuda:<local rank>'}}"
        )
    return devices.pop(), None


def _device(value) -> torch.device | None:
    """One `device_map` value as a device (an int is an accelerator index, as in transformers); None for
    "auto"/"balanced"/"sequential"/"disk" and anything that is not a device."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return torch.device("cuda", value)
    if isinstance(value, str) and value in ("auto", "balanced", "balanced_low_0", "sequential", "disk"):
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        return None


def _routed_expert_filter():
    """`skipped(model, name)`: whether parameter `name` belongs to a routed experts module (read per rank,
    not by transformers); the experts modules' prefixes are found once per model."""
    prefixes_of = {}

    def skipped(model, name: str) -> bool:
        if id(model) not in prefixes_of:
            try:
                adapter = adapter_for(model)
                blocks = list(adapter.iter_moe_blocks(model))
            except ValueError:
                blocks = []
            prefixes_of[id(model)] = tuple(
                f"{path}.{child}."
                for _, path, block in blocks
                for child, module in block.named_children()
                if module is adapter.experts_module(block)
            )
        return name.startswith(prefixes_of[id(model)])

    return skipped


def _fall_back(report: LoadReport, reason: str, occult_config) -> None:
    report.fallback_reason = reason
    if occult_config is not UNSET and occult_config is not None and _distributed():
        logger.warning("occult_hf: every rank loads all experts (per-rank expert loading off: %s)", reason)


def _check_model_type(config, model_class: type | None) -> None:
    """Raise `adapter_for`'s error when the model type has no family (no routed experts), known before the
    weights: from the config object the Auto classes pass, else from the class's `config_class` (a direct
    `LlamaForCausalLM.from_pretrained`). A class without a declared model type is left to the load."""
    if config is None or isinstance(config, str):
        config = getattr(model_class, "config_class", None)
    if getattr(config, "model_type", None):
        adapter_for(config)


def _unsupported_call(occult_config, kwargs: dict) -> str | None:
    if occult_config is None:
        return "occult_config=None"
    if not _distributed():
        return "torch.distributed is not initialised"
    if torch.distributed.get_world_size() < 2:
        return "one rank"
    for name in ("tp_plan", "device_mesh", "state_dict", "quantization_config"):
        if kwargs.get(name) is not None:
            return f"from_pretrained({name}=...) is given"
    return None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class ExpertLoader:
    """`intercept(model, state_dict) -> (state_dict, after)` for `intercept_state_dict_loading`."""

    def __init__(
        self, occult_config: OccultConfig, report: LoadReport, device: torch.device | None = None, subfolder: str = ""
    ) -> None:
        self.occult_config = occult_config
        self.report = report
        self.device = device  # from `device_map`: where this rank's experts go (None: where the slices are read, CPU)
        self.subfolder = subfolder  # from_pretrained's: the checkpoint's config.json and files lie below it

    def __call__(self, model, state_dict, rename):
        if self.occult_config is UNSET:  # no keyword: the occult_config the checkpoint's config stores, if any
            stored = stored_occult_config(model.config, self.subfolder)  # strict, relative paths against the checkpoint
            if stored is None:
                self.report.fallback_reason = "a vanilla load (no occult_config)"
                return state_dict, None
            self.occult_config = stored
            check_group_size(  # before any expert is read, as for a given config
                stored.num_devices, torch.distributed.get_world_size(),
                "the occult_config the checkpoint stores (config.json) has num_devices",
                "; load it with an occult_config= of this job's device count (it replaces the stored one whole: repeat "
                "any pruning) or occult_config=None for the model without occult_hf",
            )
        try:
            plans = self._plan(model, state_dict, rename)
        except _Unsupported as error:
            _fall_back(self.report, str(error), self.occult_config)
            return state_dict, None
        skipped = {full for plan in plans for full in plan.keys.values()}
        kept = {key: value for key, value in state_dict.items() if key not in skipped}

        def after(model, loading_info) -> None:
            for plan in plans:
                self._read_local(plan, state_dict)
            if any(set(plan.keys) != set(_FUSED) for plan in plans):  # the published per-expert layout: saved so again
                keep_expert_conversions(model)
            prefixes = tuple(plan.model_prefix + "." for plan in plans)
            for name, param in model.named_parameters():
                if name.startswith(prefixes):
                    loading_info.missing_keys.discard(name)
                    param._is_hf_initialized = True  # stays on meta: transformers neither allocates nor inits it

        return kept, after

    # ----- planning (before transformers reads anything) -------------------------------------
    def _plan(self, model, state_dict, rename) -> list[_LayerPlan]:
        if not all(hasattr(value, "get_shape") for value in state_dict.values()):
            raise _Unsupported("the checkpoint is not safetensors opened lazily")
        try:
            adapter = adapter_for(model)
        except ValueError as error:
            raise _Unsupported(str(error)) from None
        blocks = list(adapter.iter_moe_blocks(model))
        if not blocks:
            raise _Unsupported("no MoE block")
        num_experts = adapter.num_experts(model.config)
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        placement = Placement.from_setting(self.occult_config.placement)
        layers = [layer for layer, _, _ in blocks]
        if placement is None:
            placement = Placement.contiguous(num_experts, world, layers)
        try:
            placement.validate_for(num_experts, layers, world)
        except ValueError as error:  # apply_occult raises it again, with the full message, after the full load
            raise _Unsupported(f"the placement does not fit: {error}") from None
        prefix = model.base_model_prefix + "."
        plans, by_prefix = [], {}
        for layer, path, block in blocks:
            experts = adapter.experts_module(block)
            child = next((name for name, module in block.named_children() if module is experts), None)
            if child is None:
                raise _Unsupported(f"layer {layer}: the experts module is not a direct child of the block")
            plan = _LayerPlan(block, adapter, layer, f"{path}.{child}", placement.experts_on(layer, rank))
            plans.append(plan)
            by_prefix[plan.model_prefix + "."] = plan
            if plan.model_prefix.startswith(prefix):  # a head model reading a base model's checkpoint
                by_prefix[plan.model_prefix[len(prefix) :] + "."] = plan
            else:  # a base model (`AutoModel`) reading a head model's checkpoint
                by_prefix[prefix + plan.model_prefix + "."] = plan
        for key in state_dict:
            renamed = rename(key)  # e.g. Mixtral's `block_sparse_moe.experts.0.w1` -> `mlp.experts.0.w1`
            for key_prefix, plan in by_prefix.items():
                if renamed.startswith(key_prefix):
                    plan.keys[renamed[len(key_prefix) :]] = key
                    break
        for plan in plans:
            self._check_layout(plan, adapter, num_experts, state_dict)
        return plans

    @staticmethod
    def _check_layout(plan: _LayerPlan, adapter, num_experts: int, state_dict) -> None:
        layer = plan.layer
        gate_up_E2IH, down_EHI = adapter.expert_weights(plan.block)
        want = {"gate": (gate_up_E2IH.shape[1] // 2, gate_up_E2IH.shape[2]), "down": tuple(down_EHI.shape[1:])}
        want["up"] = want["gate"]
        rests = set(plan.keys)
        if rests == set(_FUSED):
            shapes = {name: tuple(state_dict[plan.keys[name]].get_shape()) for name in _FUSED}
            if shapes != {"gate_up_proj": tuple(gate_up_E2IH.shape), "down_proj": tuple(down_EHI.shape)}:
                raise _Unsupported(f"layer {layer}: fused expert shapes {shapes} differ from the model's")
            return
        seen = set()
        for rest in rests:
            match = _PER_EXPERT.fullmatch(rest)
            if match is None:
                raise _Unsupported(f"layer {layer}: unrecognised expert key {plan.keys[rest]!r}")
            expert, part = int(match.group(1)), _PART[match.group(2)]
            shape = tuple(state_dict[plan.keys[rest]].get_shape())
            if shape != want[part] or expert >= num_experts or (expert, part) in seen:
                raise _Unsupported(f"layer {layer}: expert key {plan.keys[rest]!r} has shape {shape}, want {want[part]}")
            seen.add((expert, part))
        if len(seen) != 3 * num_experts:
            raise _Unsupported(f"layer {layer}: {len(seen)} per-expert tensors, want 3 x {num_experts}")

    # ----- reading (while transformers still has the files open) --------------------------------
    def _read_local(self, plan: _LayerPlan, state_dict) -> None:
        gate_up_E2IH, down_EHI = plan.adapter.expert_weights(plan.block)  # on meta: shapes and dtypes only
        num_local, device = len(plan.expert_ids), self.device or torch.device("cpu")
        # filled one expert at a time, so that a device_map device never holds more than this rank's share
        gate_up_L2IH = torch.empty((num_local, *gate_up_E2IH.shape[1:]), dtype=gate_up_E2IH.dtype, device=device)
        down_LHI = torch.empty((num_local, *down_EHI.shape[1:]), dtype=down_EHI.dtype, device=device)
        for slot, expert in enumerate(plan.expert_ids):
            if set(plan.keys) == set(_FUSED):
                gate_up = state_dict[plan.keys["gate_up_proj"]][expert : expert + 1][0]
                down = state_dict[plan.keys["down_proj"]][expert : expert + 1][0]
            else:
                parts = {}
                for rest, full in plan.keys.items():
                    match = _PER_EXPERT.fullmatch(rest)
                    if int(match.group(1)) == expert:
                        parts[_PART[match.group(2)]] = state_dict[full][:]
                gate_up, down = torch.cat([parts["gate"], parts["up"]], dim=0), parts["down"]
            gate_up_L2IH[slot].copy_(gate_up)
            down_LHI[slot].copy_(down)
            self.report.expert_bytes_read += gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
        setattr(plan.block, LOADED_EXPERTS_ATTR, (list(plan.expert_ids), gate_up_L2IH, down_LHI))
        self.report.experts_read[plan.layer] = list(plan.expert_ids)


class _Unsupported(Exception):
    """This checkpoint or call cannot be loaded per rank; the message is the logged reason."""


__all__ = ["load_scope", "check_rank_shards", "ExpertLoader", "LoadReport"]
