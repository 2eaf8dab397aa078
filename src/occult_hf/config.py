"""`OccultConfig`: the user-facing settings of occult_hf, serialisable onto a transformers config.

The config holds only plain data (no process groups, devices or tensors) so that it can live
on `PretrainedConfig.occult_config` as a dict and survive `save_pretrained`/`from_pretrained`.

A leaf of the package: names are checked against `occult_hf.registry` (dispatchers, expert backends,
pruning policies), whose built-in names are known without importing the torch-side code that implements
them, and against the fixed choices defined there (`DISPATCH_MODES`, `REPLICA_CHOICES`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .registry import DISPATCH_MODES, DISPATCHERS, EXPERT_BACKENDS, PRUNING_POLICIES, REPLICA_CHOICES
from .utils.checks import check_devices_per_node, check_num_devices, check_timeout_s, did_you_mean
from .utils.differences import placement_differences
from .utils.logging import get_logger
from .utils.strict_json import read_json_file

logger = get_logger(__name__)
_MISSING = object()


@dataclass
class OccultConfig:
    """Settings for replacing a model's MoE blocks with `OccultMoE`.

    Every field validates in `__post_init__`; errors name the field, its value and the rule it broke.
    """

    placement: Any = field(
        default="contiguous",
        metadata={
            "help": 'Expert placement: "contiguous", a path to an occult_placement.json, a `Placement`, '
            "or its JSON dict."
        },
    )
    num_devices: int | None = field(
        default=None,
        metadata={
            "help": "Devices in the expert-parallel group. Under torch.distributed it must equal the EP group "
            "size (None: take it from the group); in one process it is the number of logical devices "
            "(None: 1, or the placement's device count)."
        },
    )
    prune: str | None = field(
        default=None,
        metadata={"help": 'Collaboration pruning: None (exact), "router" or "similarity".'},
    )
    max_devices_per_token: int | None = field(
        default=None,
        metadata={"help": "N_d: the most devices one token may use when pruning is on (>= 1)."},
    )
    max_nodes_per_token: int | None = field(
        default=None,
        metadata={
            "help": "N_n: the most nodes one token may use when pruning is on (>= 1; DeepSeek-V3's node-limited "
            "routing, for every family), alone or beside max_devices_per_token; needs a node layout "
            "(devices_per_node, a launch of several nodes, or a placement planned with one)."
        },
    )
    devices_per_node: int | None = field(
        default=None,
        metadata={
            "help": "Devices of one node of the EP group (dividing num_devices; devices n*G .. n*G+G-1 form node n). "
            'None: $LOCAL_WORLD_SIZE under torch.distributed when smaller than the group, else the placement\'s '
            'recorded layout, else one node. A group spanning nodes makes dispatcher="auto" take "hierarchical" '
            "(one copy per (token, node) over the inter-node link) and enables max_nodes_per_token."
        },
    )
    profile: str | None = field(
        default=None,
        metadata={"help": "Path to a routing profile (.safetensors); needed by similarity pruning."},
    )
    dispatch: str = field(
        default="dedup",
        metadata={
            "help": '"dedup": one row per (token, destination device), local outputs pre-summed (Occult); '
            '"per_expert": one row per (token, expert) pair (the usual all-to-all baseline).'
        },
    )
    dispatcher: str = field(
        default="auto",
        metadata={
            "help": 'How rows move between devices: "auto" ("local" in one process; under torch.distributed '
            '"padded", which reads nothing on the host, where its padding is estimated at most 25% (dedup, one '
            'chunk, no pruning: occult_hf.dispatch.auto), else "all_to_all"), or a registered name '
            "(occult_hf.dispatch.dispatcher_names()). Orthogonal to `dispatch`."
        },
    )
    dispatch_chunks: int | None = field(
        default=None,
        metadata={
            "help": "Chunks a rank's tokens are split into so that the exchange of one chunk overlaps the experts of "
            "another (dispatcher 'all_to_all' only: a config naming another with dispatch_chunks > 1 is refused, and "
            "'auto' choosing another logs a warning; None: occult_hf.dispatch.DEFAULT_CHUNKS, which is 1: on two "
            "H200s 4 chunks measured slower than 1, see docs/bench_ep_h200_2gpu.md)."
        },
    )
    exchange_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "Seconds any wait on a peer rank in the EP exchange may take before it fails with an error naming "
            "the layer and the operation (None: $OCCULT_EXCHANGE_TIMEOUT_S, else 120; at most 86400)."
        },
    )
    replica_choice: str = field(
        default="static",
        metadata={
            "help": 'Which home of a replicated expert serves a (token, expert) pair: "static" (a home the token '
            'visits anyway, else round-robin; docs/design.md §6) or "load_aware" (the same preference, but the batch\'s '
            "per-expert counts, gathered over the EP group, split each replicated expert's pairs so that the devices "
            "balance: occult_hf.replicas.routing.load_aware_homes). No effect without replicas."
        },
    )
    expert_backend: str = field(
        default="auto",
        metadata={
            "help": '"auto" (on CUDA: "grouped_mm_fused" in bf16 with gradients or long expert segments, else "triton"; PyTorch elsewhere), "grouped_mm_fused" '
            "(PyTorch's grouped GEMMs, Triton kernels around them), \"triton\" or \"torch\"."
        },
    )
    deterministic: bool = field(
        default=False,
        metadata={"help": "Use the deterministic (atomic-free) reduction in the Triton expert kernels."},
    )
    logical_devices: bool = field(
        default=False,
        metadata={
            "help": "Allow num_devices > 1 in the only process a launcher (torchrun, accelerate launch) started: "
            "the devices are then logical (pruning plans for them; no expert parallelism runs). Without it such a "
            "launch is an error, since it usually means the launcher ran fewer processes than intended. A plain "
            "`python` process needs no flag: one process with logical devices is its normal mode."
        },
    )

    def __new__(cls, *args, **kwargs):
        """Check the keyword names before the generated `__init__` does, for the nearest valid name of a
        misspelt one (Python 3.11's own TypeError names only the unknown keyword)."""
        _check_keys(kwargs, TypeError)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        from .placement import Placement  # local import: placement imports nothing from here

        if isinstance(self.placement, dict):
            self.placement = Placement.from_dict(self.placement)
        elif isinstance(self.placement, os.PathLike):
            self.placement = os.fspath(self.placement)
        if not isinstance(self.placement, (str, Placement)):
            raise TypeError(
                f"OccultConfig.placement must be 'contiguous', a path, a Placement or a dict, "
                f"got {type(self.placement).__name__}"
            )
        if self.num_devices is not None:
            check_num_devices(self.num_devices, "OccultConfig.num_devices")
        if isinstance(self.placement, Placement) and self.num_devices not in (None, self.placement.num_devices):
            raise ValueError(
                f"OccultConfig.num_devices ({self.num_devices}) does not match the placement's "
                f"num_devices ({self.placement.num_devices})"
            )
        if self.prune is not None:
            PRUNING_POLICIES.check(self.prune)
        if self.prune is not None and self.max_devices_per_token is None and self.max_nodes_per_token is None:
            raise ValueError(
                f"OccultConfig.prune={self.prune!r} needs max_devices_per_token (N_d) or max_nodes_per_token to be set"
            )
        for name in ("max_devices_per_token", "max_nodes_per_token", "dispatch_chunks"):
            value = getattr(self, name)
            if value is not None and (_not_int(value) or value < 1):
                raise ValueError(f"OccultConfig.{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("logical_devices", "deterministic"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"OccultConfig.{name} must be True or False, got {type(value).__name__} {value!r}")
        if self.devices_per_node is not None:
            check_devices_per_node(self.devices_per_node, self.num_devices or self.devices_per_node, "OccultConfig.devices_per_node")  # no D: >= 1 only
        n_d = self.max_devices_per_token
        if n_d is not None and self.num_devices is not None and n_d > self.num_devices:
            raise ValueError(f"OccultConfig.max_devices_per_token (N_d={n_d}) cannot exceed num_devices ({self.num_devices})")
        for name in ("max_nodes_per_token", "max_devices_per_token"):
            if getattr(self, name) is not None and self.prune is None:
                raise ValueError(
                    f"OccultConfig.{name}={getattr(self, name)} is set but prune is None; choose prune='router' or 'similarity'"
                )
        if self.prune is not None and PRUNING_POLICIES.trait(self.prune, "needs_similarity") and self.profile is None:
            raise ValueError(f"OccultConfig.prune={self.prune!r} needs a routing profile: set OccultConfig.profile")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"OccultConfig.dispatch must be one of {DISPATCH_MODES}, got {self.dispatch!r}")
        if self.dispatcher != "auto":
            DISPATCHERS.check(self.dispatcher)
            if (self.dispatch_chunks or 1) > 1 and not DISPATCHERS.trait(self.dispatcher, "overlaps_chunks"):
                raise ValueError(
                    f"OccultConfig.dispatch_chunks={self.dispatch_chunks} needs a dispatcher that overlaps chunks "
                    f"({list(DISPATCHERS.names_with('overlaps_chunks'))}); dispatcher={self.dispatcher!r} runs one chunk: "
                    f"leave dispatch_chunks at None"
                )
        if self.exchange_timeout_s is not None and isinstance(self.exchange_timeout_s, str):
            raise ValueError(f"OccultConfig.exchange_timeout_s must be None or a number, got str {self.exchange_timeout_s!r}")
        if self.exchange_timeout_s is not None:
            check_timeout_s(self.exchange_timeout_s, "OccultConfig.exchange_timeout_s")
        if self.replica_choice not in REPLICA_CHOICES:
            raise ValueError(f"OccultConfig.replica_choice must be one of {REPLICA_CHOICES}, got {self.replica_choice!r}")
        if isinstance(self.profile, os.PathLike):
            self.profile = os.fspath(self.profile)
        if self.profile is not None and not isinstance(self.profile, str):
            raise TypeError(f"OccultConfig.profile must be None or a path, got {type(self.profile).__name__}")
        if self.expert_backend != "auto":
            EXPERT_BACKENDS.check(self.expert_backend)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-native dict (str/int/bool/None/list/dict only), as `PretrainedConfig.to_dict` gives.

        A `Placement` is stored inline so that the dict is self-contained; this is what sits on the
        transformers config as `config.occult_config` (like `quantization_config`).
        """
        from .placement import Placement

        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.placement, Placement):
            data["placement"] = self.placement.to_dict()
        return json.loads(json.dumps(data))  # a deep copy, and a TypeError here rather than in a log call

    def to_diff_dict(self) -> dict[str, Any]:
        """`to_dict` without the fields that hold their default value (HF's `to_diff_dict`)."""
        defaults = OccultConfig().to_dict()
        return {name: value for name, value in self.to_dict().items() if defaults.get(name, _MISSING) != value}

    def to_json_string(self, use_diff: bool = False) -> str:
        """The config as JSON (every field, or only the non-default ones with `use_diff=True`)."""
        data = self.to_diff_dict() if use_diff else self.to_dict()
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = False) -> None:
        """Write `to_json_string` to a file atomically (temporary file, rename; HF's name for `save`).

        `load` reads a relative `placement` or `profile` path as a file beside the JSON file, while this config's
        relative paths name files from the working directory: the file gets each such path relative to its own
        directory when the file lies below it (the two move together), else absolute, so that `load` finds the
        same file.
        """
        from .utils.atomic import atomic_write_text

        directory = os.path.dirname(os.path.abspath(json_file_path))
        paths = {key: getattr(self, key) for key in _PATH_FIELDS}
        paths = _with_paths_resolved(paths, lambda name: _path_from(directory, name))
        atomic_write_text(json_file_path, replace(self, **paths).to_json_string(use_diff=use_diff))

    @classmethod
    def from_json_file(cls, json_file_path: str | os.PathLike) -> "OccultConfig":
        return cls.load(json_file_path)

    def __iter__(self):
        """`dict(config)` gives `to_dict()`, as for HF's quantization configs."""
        yield from self.to_dict().items()

    def __repr__(self) -> str:
        """`OccultConfig {JSON}` of the fields that differ from their defaults, as HF configs print, with an
        inline placement summarised (a placement of many layers x experts would flood a log line)."""
        from .placement import Placement

        data = self.to_diff_dict()
        if isinstance(self.placement, Placement):
            p = self.placement
            layers = sorted(p.layers)
            data["placement"] = (
                f"<Placement num_experts={p.num_experts} num_devices={p.num_devices} "
                f"layers={len(layers)} [{layers[0]}..{layers[-1]}]>" if layers else "<Placement without layers>"
            )
        return f"{type(self).__name__} {json.dumps(data, sort_keys=True)}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OccultConfig":
        _check_keys(data, ValueError)
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON form atomically (see `to_json_file`)."""
        self.to_json_file(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OccultConfig":
        """Read a JSON file written by `save`, strictly (`utils.strict_json`); errors name the file.

        A relative `placement` or `profile` path in it names a file beside it, wherever the reader runs.
        """
        path = os.fspath(path)
        data = read_json_file(path, "occult_config")
        if not isinstance(data, dict):
            raise ValueError(f"occult_config {path!r} must hold a JSON object, got {type(data).__name__}")
        directory = os.path.dirname(os.path.abspath(path))
        try:
            return cls.from_dict(_with_paths_resolved(data, lambda name: os.path.join(directory, name)))
        except (TypeError, ValueError) as error:
            raise ValueError(f"occult_config {path!r}: {error}") from None

    @classmethod
    def coerce(cls, value: "OccultConfig | dict | str | os.PathLike") -> "OccultConfig":
        """Accept what `from_pretrained(occult_config=...)` accepts: a config, a dict or a JSON file path. A config is
        checked again (a copy through `__post_init__`): its fields may have been set after it was built."""
        if isinstance(value, cls):
            return replace(value)
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            if not os.path.isfile(value):
                raise FileNotFoundError(f"occult_config path {os.fspath(value)!r} is not a file")
            return cls.load(value)
        raise TypeError(
            f"occult_config must be an OccultConfig, a dict or a path to a JSON file, got {type(value).__name__}"
        )


def stored_occult_config(model_config, subfolder: str = "") -> "OccultConfig | None":
    """The `occult_config` a loaded checkpoint's config stores, None when it stores none.

    transformers reads `config.json` leniently (a key given twice keeps its last value), so a checkpoint
    directory's `config.json` is read again strictly. A relative `placement` or `profile` path in it
    names a file of the checkpoint (the directory, or the Hub repository at the same revision; below
    `subfolder`, `from_pretrained`'s keyword), never one in the working directory.
    """
    stored = getattr(model_config, "occult_config", None)
    if stored is None or isinstance(stored, OccultConfig):
        return stored
    checkpoint = getattr(model_config, "_name_or_path", "") or ""
    revision = getattr(model_config, "_commit_hash", None)
    config_file = _checkpoint_config_file(checkpoint, revision, subfolder)
    if config_file is None or _lenient_occult_config(config_file) != stored:  # given as a keyword, not read
        return OccultConfig.coerce(stored)
    label = f"checkpoint config {config_file!r}"
    saved = read_json_file(config_file, "checkpoint config")
    stored = saved["occult_config"]
    if not isinstance(stored, dict):
        raise ValueError(f"{label}: occult_config must be a JSON object, got {type(stored).__name__}")
    _check_pruning_description(saved.get(PRUNING_CONFIG_KEY), stored, label)
    _check_placement_file(os.path.dirname(config_file), stored.get("placement"), label)
    try:
        return OccultConfig.from_dict(_with_paths_resolved(stored, lambda name: _checkpoint_file(checkpoint, revision, subfolder, name, label)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{label}: {error}") from None


#: the `config.json` key of a pruned checkpoint's description, which `save_pretrained` writes beside `occult_config`
#: (`hf.model_card`)
PRUNING_CONFIG_KEY = "occult_pruning"
_DESCRIBED_FIELDS = ("prune", "max_devices_per_token", "max_nodes_per_token", "num_devices", "devices_per_node")


def _check_pruning_description(description, stored: dict, label: str) -> None:
    """Raise where a checkpoint's `occult_pruning` says other than its `occult_config`: the description is written
    from the config at each save and never read back, so a hand edit of it would be ignored without a word (and
    overwritten by the next save)."""
    if description is None:
        return
    if not isinstance(description, dict):
        raise ValueError(f"{label}: {PRUNING_CONFIG_KEY} must be a JSON object, got {type(description).__name__}")
    for name in _DESCRIBED_FIELDS:
        if name in description and description[name] != stored.get(name, OccultConfig.__dataclass_fields__[name].default):
            raise ValueError(
                f"{label}: {PRUNING_CONFIG_KEY}.{name} is {description[name]!r} but occult_config.{name} is "
                f"{stored.get(name)!r}; {PRUNING_CONFIG_KEY} only describes the saved model (save_pretrained writes "
                f"it from occult_config, which is what loads): edit occult_config, or pass occult_config=... to "
                f"from_pretrained"
            )


def _check_placement_file(directory: str, stored, label: str) -> None:
    """Warn where the checkpoint's `occult_placement.json` holds another placement than the one inline in its
    `occult_config`, which is what loads: a hand edit of the file alone would otherwise be ignored without a word (and
    the next save would write the inline one back over it). A warning, not an error: a save interrupted while it
    publishes leaves the new file beside the old config for a moment, and that checkpoint must still load."""
    from .placement import PLACEMENT_FILENAME, Placement

    path = os.path.join(directory, PLACEMENT_FILENAME)
    if not isinstance(stored, dict) or not os.path.isfile(path):
        return
    beside, inline = Placement.load(path), Placement.from_dict(stored)
    if beside != inline:
        logger.warning(
            "occult_hf: %s: %r holds another placement than occult_config's own, which is the one that loads (%s); to "
            "run the file's, put it in config.json's occult_config.placement or pass occult_config={'placement': %r} "
            "to from_pretrained", label, path, placement_differences({"the file": beside.to_dict(), "occult_config": inline.to_dict()}), path,
        )


def _checkpoint_config_file(checkpoint: str, revision: str | None, subfolder: str) -> str | None:
    """The local `config.json` of a checkpoint directory or of a Hub checkpoint in the cache (below `subfolder`),
    else None."""
    if os.path.isdir(checkpoint):
        path = os.path.join(checkpoint, subfolder, "config.json")
        return path if os.path.isfile(path) else None
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(checkpoint, f"{subfolder}/config.json" if subfolder else "config.json", revision=revision)
    except ValueError:  # not a Hub id
        return None
    return path if isinstance(path, str) else None


def _lenient_occult_config(config_file: str):
    """The `occult_config` entry of `config_file` as transformers read it (last value of a repeated key)."""
    try:
        with open(config_file, "rb") as f:
            return json.loads(f.read()).get("occult_config")
    except (OSError, ValueError, AttributeError):
        return None


def _with_paths_resolved(data: dict, resolve) -> dict:
    """`data` with a relative `placement` / `profile` path replaced by `resolve(path)`."""
    out = dict(data)
    for key in _PATH_FIELDS:
        value = out.get(key)
        if isinstance(value, str) and value != "contiguous" and not os.path.isabs(value):
            out[key] = resolve(value)
    return out


def _path_from(directory: str, path: str) -> str:
    """`path` (relative to the working directory) as `directory` + the returned path names it: relative below
    `directory`, else absolute."""
    relative = os.path.relpath(os.path.abspath(path), directory)
    return os.path.abspath(path) if relative.split(os.sep)[0] == os.pardir else relative


def _checkpoint_file(checkpoint: str, revision: str | None, subfolder: str, name: str, label: str) -> str:
    """The local path of file `name` of the checkpoint `checkpoint` (a directory, or a Hub id at `revision`; below
    `subfolder`)."""
    if os.path.isdir(checkpoint):
        directory = os.path.join(checkpoint, subfolder)
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{label} names {name!r}, which is not in the checkpoint directory {directory!r}")
        return path
    from transformers.utils import cached_file

    try:
        return cached_file(checkpoint, name, subfolder=subfolder, _commit_hash=revision)
    except OSError as error:
        raise FileNotFoundError(f"{label} names {name!r}, which the checkpoint {checkpoint!r} does not hold ({error})") from None


#: `OccultConfig` fields that may hold a file path
_PATH_FIELDS = ("placement", "profile")


def _check_keys(data: dict, error: type[Exception]) -> None:
    """Raise `error` naming the keys of `data` that are not `OccultConfig` fields, with the nearest field names."""
    known = sorted(f.name for f in fields(OccultConfig))
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise error(f"OccultConfig got unknown keys {unknown}{did_you_mean(unknown, known)}; valid keys are {known}")


def _not_int(value: Any) -> bool:
    """True unless `value` is an `int` (a bool is not a device count: `True` would mean 1)."""
    return isinstance(value, bool) or not isinstance(value, int)


__all__ = ["OccultConfig", "stored_occult_config"]
