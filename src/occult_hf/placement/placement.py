"""`Placement`: per MoE layer, which device holds each routed expert (docs/design.md §2, §6).

An expert has one *primary* home (`layers[l][e]`) and, optionally, extra homes on other devices
(`replicas[l][e]`, within `slots_per_device`): its *homes* are all of them, in increasing device id.
A device's local slots are the experts with a home on it, in increasing global id;
`slot_table(l)[e, d]` is expert `e`'s slot on device `d` (-1: no home there) and `local_slot(l)[e]`
its slot on its primary device. The runtime, the planners and the metrics all read placements
through this class so that the slot convention lives in one place; which home serves a
(token, expert) pair is decided by `occult_hf.replicas.routing.resolve_homes` (the one routing rule).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ..utils.atomic import atomic_write_text, json_text, to_json_native
from ..utils.checks import check_devices_per_node, did_you_mean, shown
from ..utils.strict_json import json_kind, read_json_file
from ..replicas.routing import PIN_SLACK, home_table_from
from ..layout import LayerLayout

PLACEMENT_FILENAME = "occult_placement.json"
#: the largest decoder-layer index a placement may name (DeepSeek-V3 has 61 layers)
MAX_LAYER_INDEX = 65535
#: the largest placement file read (61 layers x 256 experts with replicas and meta is well under 1 MB)
MAX_PLACEMENT_BYTES = 16 * 2**20


def contiguous_devices(num_experts: int, num_devices: int) -> np.ndarray:
    """`[E]` int64 device map `e * D // E`: what every EP framework does (capacities differ by at most one)."""
    return np.arange(num_experts, dtype=np.int64) * num_devices // num_experts


@dataclass
class Placement:
    """Expert -> device maps for a set of MoE layers.

    Attributes:
        num_experts: `E`, routed experts per layer.
        num_devices: `D`, devices in the expert-parallel group.
        layers: decoder-layer index -> list of `E` device ids (`layers[l][e]` is the primary device of expert `e`).
        meta: free-form JSON-safe information (method, profile, scores).
        replicas: decoder-layer index -> {expert: [extra devices]}: homes beyond the primary one (a
            device at most once per expert, never the primary). Empty: one home per expert.
        slots_per_device: the expert slots per device the plan assumed (None: not stated); every
            device's slots (primary and extra homes) must fit in it.
        pin_slack: decoder-layer index -> the pin slack of the load-aware replica rule there (a number in
            [0, 1]: how far above the least max load, as a fraction of the mean device load, a device may
            keep pairs on a home their token visits anyway; `replicas.routing.replica_shares`), as the
            planner chose it for the layer's replicas. A layer without one uses `replicas.routing.PIN_SLACK`.
        devices_per_node: `G`, the devices of one node of the cluster the plan was made for (devices `n*G .. n*G +
            G - 1` form node n, as torchrun numbers the ranks of `--nnodes` nodes); it must divide `num_devices`.
            None: not stated (one node). A node-aware planner minimised the nodes per token first
            (`plan_placement(devices_per_node=G)`); the metrics then report CT_node and the rows that cross nodes.
        source: the file it was read from (None when built in memory), for errors only: `validate_for` runs far from
            the load (apply_occult, `occult eval`, `occult report`), where the user must still learn which file
            does not fit. Not part of the JSON form nor of equality.
    """

    num_experts: int
    num_devices: int
    layers: dict[int, list[int]]
    meta: dict[str, Any] = field(default_factory=dict)
    replicas: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    slots_per_device: int | None = None
    pin_slack: dict[int, float] = field(default_factory=dict)
    devices_per_node: int | None = None
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.num_experts = _strict_int(self.num_experts, "Placement.num_experts", minimum=1)
        self.num_devices = _strict_int(self.num_devices, "Placement.num_devices", minimum=1)
        if self.num_devices > self.num_experts:
            raise ValueError(
                f"Placement.num_devices ({self.num_devices}) exceeds num_experts ({self.num_experts}): some device would "
                f"hold no primary expert (every device needs one; replicas, which could fill the others, do not count)"
            )
        if not isinstance(self.layers, dict):
            raise TypeError(f"Placement.layers must be a dict layer -> device list, got {type(self.layers).__name__}")
        layers: dict[int, list[int]] = {}
        for layer, devices in self.layers.items():
            index = _strict_int(layer, "Placement.layers key", minimum=0)
            if index in layers:
                raise ValueError(f"Placement.layers names layer {index} twice")
            where = f"Placement.layers[{index}]"
            if isinstance(devices, np.ndarray):
                devices = devices.tolist()
            if not isinstance(devices, (list, tuple)):
                raise TypeError(f"{where} must be a list of device ids, got {type(devices).__name__}")
            layers[index] = list(devices) if all(type(d) is int for d in devices) else [
                _strict_int(d, f"{where}[{e}]") for e, d in enumerate(devices)
            ]  # the per-item label only where an item is not an int (formatting it costs most of a large placement)
        self.layers = layers
        for layer, devices in self.layers.items():
            if len(devices) != self.num_experts:
                raise ValueError(
                    f"Placement layer {layer} maps {len(devices)} experts, expected num_experts={self.num_experts}"
                )
            bad = [d for d in devices if not 0 <= d < self.num_devices]
            if bad:
                raise ValueError(
                    f"Placement layer {layer} uses device ids {shown(sorted(set(bad)))} outside [0, {self.num_devices})"
                )
        if not isinstance(self.meta, dict):
            raise TypeError(f"Placement.meta must be a dict, got {type(self.meta).__name__}")
        self._check_replicas()
        self._check_pin_slack()
        if self.devices_per_node is not None:
            self.devices_per_node = check_devices_per_node(self.devices_per_node, self.num_devices, "Placement.devices_per_node")
        self._check_no_empty_device()

    def _check_no_empty_device(self) -> None:
        """Every device holds at least one expert at every layer: an empty one would take part in every exchange with
        nothing to compute, which no plan means (a placement for fewer devices is what was meant)."""
        for layer, devices in self.layers.items():
            used = set(devices).union(*self.replicas.get(layer, {}).values())
            if len(used) < self.num_devices:
                empty = sorted(set(range(self.num_devices)) - used)
                raise ValueError(
                    f"Placement layer {layer} leaves devices {shown(empty)} without an expert; every device of the "
                    f"{self.num_devices} must hold at least one"
                )

    def _check_pin_slack(self) -> None:
        """Normalise `pin_slack` to int layers and float values; each layer must be one of `layers`, each
        value a number in [0, 1] (a fraction of the mean device load)."""
        if not isinstance(self.pin_slack, dict):
            raise ValueError(f"Placement.pin_slack must map layer -> number, got {type(self.pin_slack).__name__}")
        normalised = {}
        for layer, slack in self.pin_slack.items():
            layer = _strict_int(layer, "Placement.pin_slack key", minimum=0)
            if layer not in self.layers:
                raise ValueError(f"Placement.pin_slack names layer {layer}, which is not among its layers {shown(sorted(self.layers))}")
            normalised[layer] = _fraction(slack, f"Placement.pin_slack[{layer}]")
        self.pin_slack = normalised

    def _check_replicas(self) -> None:
        """Normalise `replicas` to int keys and sorted device lists; check them against the layers and slots."""
        if not isinstance(self.replicas, dict):
            raise ValueError(f"Placement.replicas must map layer -> {{expert: [devices]}}, got {type(self.replicas).__name__}")
        normalised = {}
        for layer, extra in self.replicas.items():
            layer = _strict_int(layer, "Placement.replicas key", minimum=0)
            if layer not in self.layers:
                raise ValueError(f"Placement replicas name layer {layer}, which is not among its layers {shown(sorted(self.layers))}")
            if not isinstance(extra, dict):
                raise ValueError(f"Placement replicas of layer {layer} must map expert -> [devices], got {type(extra).__name__}")
            homes = {}
            for expert, devices in extra.items():
                expert = _strict_int(expert, f"Placement.replicas[{layer}] key")
                if not 0 <= expert < self.num_experts:
                    raise ValueError(
                        f"Placement replicas of layer {layer} name expert {expert} outside [0, num_experts={self.num_experts})"
                    )
                where = f"Placement.replicas[{layer}][{expert}]"
                if not isinstance(devices, (list, tuple, np.ndarray)):
                    raise TypeError(f"{where} must be a list of device ids, got {type(devices).__name__} {devices!r}")
                devices = sorted(_strict_int(d, f"{where} entry") for d in devices)
                primary = self.layers[layer][expert]
                if len(set(devices)) != len(devices) or primary in devices or not all(0 <= d < self.num_devices for d in devices):
                    raise ValueError(
                        f"Placement replicas of layer {layer} expert {expert}: {devices} must be distinct device ids in "
                        f"[0, {self.num_devices}) other than its primary device {primary}"
                    )
                if devices:
                    homes[expert] = devices
            if homes:
                normalised[layer] = homes
        self.replicas = normalised
        if self.slots_per_device is not None:
            if not isinstance(self.slots_per_device, int) or isinstance(self.slots_per_device, bool) or self.slots_per_device < 1:
                raise ValueError(f"Placement.slots_per_device must be a positive integer or None, got {self.slots_per_device!r}")
            for layer in self.layers:
                used = max(self.capacities(layer))
                if used > self.slots_per_device:
                    raise ValueError(
                        f"Placement layer {layer} puts {used} experts on one device, more than slots_per_device="
                        f"{self.slots_per_device}"
                    )

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int, layers: Iterable[int]) -> "Placement":
        """Expert `e` on device `e * D // E`: what every framework does; capacities differ by at most one."""
        devices = contiguous_devices(num_experts, num_devices).tolist()
        return cls(num_experts, num_devices, {int(l): list(devices) for l in layers}, {"method": "contiguous"})

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> "Placement":
        """Parse the JSON form strictly (docs/design.md §6); errors name `source` (a file) and the JSON path.

        Integers only (no floats, no booleans), layer keys in canonical decimal ("0", never "00" or
        " 0"), known top-level keys only. The optional `"replicas"` and `"slots_per_device"` are
        checked for form here (see `_parse_replicas`).
        """
        where = f"placement {source!r}: " if source else "placement: "
        try:
            placement = cls._from_dict(data)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}{error}") from None
        placement.source = source
        return placement

    @classmethod
    def _from_dict(cls, data: Any) -> "Placement":
        if not isinstance(data, dict):
            raise _SchemaError(f"$ must be a JSON object, got {json_kind(data)}")
        missing = sorted(_REQUIRED_KEYS - set(data))
        if missing:
            raise _SchemaError(f"$ lacks keys {missing}")
        unknown = sorted(set(data) - _REQUIRED_KEYS - _OPTIONAL_KEYS)
        if unknown:
            valid = sorted(_REQUIRED_KEYS | _OPTIONAL_KEYS)
            raise _SchemaError(f"$ has unknown keys {unknown}{did_you_mean(unknown, valid)}; valid keys are {valid}")
        num_experts = _json_int(data["num_experts"], "$.num_experts", minimum=1)
        num_devices = _json_int(data["num_devices"], "$.num_devices", minimum=1)
        raw_layers = data["layers"]
        if not isinstance(raw_layers, dict) or not raw_layers:
            raise _SchemaError(f"$.layers must be a non-empty JSON object, got {json_kind(raw_layers)}")
        layers = {}
        for key, devices in raw_layers.items():
            path = f"$.layers[{_key_repr(key)}]"
            layer = _canonical_index(key, path)
            if not isinstance(devices, list):
                raise _SchemaError(f"{path} must be a list of device ids, got {json_kind(devices)}")
            if len(devices) != num_experts:
                raise _SchemaError(f"{path} maps {len(devices)} experts, expected num_experts={num_experts}")
            if not all(type(d) is int and 0 <= d < num_devices for d in devices):  # find and name the bad one
                for e, d in enumerate(devices):
                    _json_int(d, f"{path}[{e}]", minimum=0, below=num_devices, below_name="num_devices")
            layers[layer] = list(devices)
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise _SchemaError(f"$.meta must be a JSON object, got {json_kind(meta)}")
        replicas, slots = _parse_replicas(data, num_experts, num_devices, layers)
        pin_slack = _parse_pin_slack(data, layers)
        devices_per_node = None
        if "devices_per_node" in data:
            devices_per_node = _json_int(data["devices_per_node"], "$.devices_per_node", minimum=1)
            if num_devices % devices_per_node:
                raise _SchemaError(
                    f"$.devices_per_node is {devices_per_node}, which does not divide num_devices={num_devices} "
                    f"(every node holds the same number of devices)"
                )
        return cls(
            num_experts, num_devices, layers, dict(meta), replicas=replicas, slots_per_device=slots, pin_slack=pin_slack,
            devices_per_node=devices_per_node,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (docs/design.md §6); "replicas", "slots_per_device" and "pin_slack" only when set, so that
        a placement without replicas writes exactly the format of earlier versions."""
        out: dict[str, Any] = {
            "num_experts": self.num_experts,
            "num_devices": self.num_devices,
            "layers": {str(l): list(d) for l, d in sorted(self.layers.items())},
        }
        if self.replicas:
            out["replicas"] = {
                str(l): {str(e): list(d) for e, d in sorted(extra.items())} for l, extra in sorted(self.replicas.items())
            }
        if self.slots_per_device is not None:
            out["slots_per_device"] = self.slots_per_device
        if self.pin_slack:
            out["pin_slack"] = {str(l): slack for l, slack in sorted(self.pin_slack.items())}
        if self.devices_per_node is not None:
            out["devices_per_node"] = self.devices_per_node
        out["meta"] = to_json_native(self.meta, "$.meta")
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write `occult_placement.json` atomically; a directory path gets the standard file name.

        The text is serialised in memory (numpy scalars in `meta` converted to JSON numbers), parsed
        back and checked against this placement before it replaces the old file.
        """
        if os.path.isdir(path):
            path = os.path.join(path, PLACEMENT_FILENAME)
        text = json_text(self.to_dict())
        if Placement.from_dict(json.loads(text)).layers != self.layers:  # pragma: no cover - a serialiser bug
            raise RuntimeError(f"placement {os.fspath(path)!r}: the serialised placement does not read back equal")
        atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Placement":
        """Read an `occult_placement.json` (or a directory holding one) strictly; see `from_dict`."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, PLACEMENT_FILENAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"placement {path!r} is not a file")
        return cls.from_dict(read_json_file(path, "placement", max_bytes=MAX_PLACEMENT_BYTES), source=path)

    @classmethod
    def from_setting(cls, value) -> "Placement | None":
        """`OccultConfig.placement` resolved: a `Placement` as it is, None for "contiguous" (built once
        the device count is known), or the file (or directory holding one) it names."""
        if isinstance(value, Placement):
            return value
        if value == "contiguous":
            return None
        if os.path.isfile(value) or os.path.isdir(value):
            return cls.load(value)
        raise ValueError(
            f"OccultConfig.placement={value!r} is neither 'contiguous' nor an existing occult_placement.json "
            f"(or a directory holding one)"
        )

    # ----- queries ------------------------------------------------------------------------
    def device_of(self, layer: int) -> list[int]:
        """`[E]` device of each expert at `layer`."""
        try:
            return self.layers[int(layer)]
        except KeyError:
            raise KeyError(
                f"placement has no entry for layer {layer}; it covers layers {shown(sorted(self.layers))}"
            ) from None

    @property
    def num_nodes(self) -> int:
        """Nodes of the cluster the plan was made for (1 when `devices_per_node` is not stated)."""
        return 1 if self.devices_per_node is None else self.num_devices // self.devices_per_node

    @property
    def has_replicas(self) -> bool:
        """True when some expert of some layer has more than one home."""
        return bool(self.replicas)

    def homes(self, layer: int) -> list[list[int]]:
        """`[E]` lists of the devices holding each expert at `layer` (primary and replicas), increasing."""
        extra = self.replicas.get(int(layer), {})
        return [sorted([d, *extra.get(e, [])]) for e, d in enumerate(self.device_of(layer))]

    def pin_slack_of(self, layer: int) -> float:
        """The load-aware replica rule's pin slack at `layer`: the planner's choice, else `replicas.routing.PIN_SLACK`."""
        return self.pin_slack.get(int(layer), PIN_SLACK)

    def home_table(self, layer: int) -> np.ndarray:
        """`[E, M]` int64 homes of each expert in increasing device id, padded with -1 (M: most homes of an expert)."""
        return home_table_from(self.device_of(layer), self.replicas.get(int(layer)))

    def slot_table(self, layer: int) -> np.ndarray:
        """`[E, D]` int64 local slot of expert e on device d (-1 where d holds no copy of e).

        A device's slots hold the experts with a home on it in increasing global id."""
        held_ED = np.zeros((self.num_experts, self.num_devices), dtype=bool)
        for expert, devices in enumerate(self.homes(layer)):
            held_ED[expert, devices] = True
        slots_ED = np.cumsum(held_ED, axis=0) - 1
        return np.where(held_ED, slots_ED, -1).astype(np.int64)

    def experts_on(self, layer: int, device: int) -> list[int]:
        """Global ids of the experts `device` holds at `layer` (primary or replica), in local-slot order (increasing id)."""
        return [e for e, devices in enumerate(self.homes(layer)) if device in devices]

    def local_slot(self, layer: int) -> list[int]:
        """`[E]` position of each expert among the slots of its primary device."""
        slots_ED = self.slot_table(layer)
        return [int(slots_ED[e, d]) for e, d in enumerate(self.device_of(layer))]

    def layout(self, layer: int, rank: int | None = None):
        """The `LayerLayout` of `layer` for EP rank `rank` (None: one process, logical devices), built once per
        (layer, rank) and kept: every consumer of the layer (dispatcher, pruner, statistics) shares it. A
        `Placement` is not to be changed after its layouts are taken."""
        cache = self.__dict__.setdefault("_layouts", {})
        key = (int(layer), rank)
        if key not in cache:
            cache[key] = LayerLayout.of(self, layer, rank)
        return cache[key]

    def capacities(self, layer: int) -> list[int]:
        """`[D]` number of expert slots each device uses at `layer` (primary and replica homes)."""
        return [int(n) for n in (self.slot_table(layer) >= 0).sum(axis=0)]

    def validate_for(
        self,
        num_experts: int,
        layers: Iterable[int],
        num_devices: int | None = None,
        exact: bool = True,
        against: str = "the model",
    ) -> None:
        """Raise a clear error when this placement does not fit a model (expert count, layers, devices).

        `exact=True` (for a model): the placement names exactly `layers`, no more (docs/design.md §6: an
        extra layer would be written back on save as if the model had it). `exact=False` (for a
        profile that covers some layers): it covers at least `layers`. `against` names what the
        counts come from in the error ("the routing profile"); the placement's file is named when it
        has one (`source`).
        """
        placement = f"placement {self.source!r}" if self.source else "placement"
        if num_experts != self.num_experts:
            raise ValueError(
                f"{placement} is for num_experts={self.num_experts} but {against} has {num_experts} routed experts"
            )
        if num_devices is not None and num_devices != self.num_devices:
            raise ValueError(
                f"{placement} is for num_devices={self.num_devices} but the expert-parallel group has {num_devices}"
            )
        wanted = set(int(l) for l in layers)
        missing = sorted(wanted - set(self.layers))
        if missing:
            raise ValueError(
                f"{placement} lacks MoE layers {shown(missing)} of {against}; it covers layers {shown(sorted(self.layers))}"
            )
        extra = sorted(set(self.layers) - wanted)
        if exact and extra:
            raise ValueError(
                f"{placement} names layers {shown(extra)} that are not MoE layers of {against}; it must name exactly "
                f"the MoE layers {shown(sorted(wanted))}"
            )


_REQUIRED_KEYS = frozenset({"num_experts", "num_devices", "layers"})
_OPTIONAL_KEYS = frozenset({"meta", "replicas", "slots_per_device", "pin_slack", "devices_per_node"})
_CANONICAL_INDEX = re.compile(r"(0|[1-9][0-9]*)")


class _SchemaError(ValueError):
    """A placement file that breaks the schema; the message starts with the JSON path."""


def _json_int(value: Any, path: str, minimum: int | None = None, below: int | None = None, below_name: str = "") -> int:
    """A JSON integer: `int` but not `bool` (json gives 1.0 as float, true as bool: both rejected)."""
    if type(value) is not int:
        raise _SchemaError(f"{path} must be an integer, got {json_kind(value)}")
    if minimum is not None and value < minimum:
        raise _SchemaError(f"{path} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise _SchemaError(f"{path} is {value}, outside [0, {below_name}={below})")
    return value


def _strict_int(value: Any, what: str, minimum: int | None = None) -> int:
    """An `int` or numpy integer (planners return numpy), never a float or a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {int(value)}")
    return int(value)


def _fraction(value: Any, what: str) -> float:
    """A number in [0, 1] (an int or float, never a bool), as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be a number in [0, 1] (a fraction of the mean device load), got {value!r}")
    return float(value)


def _key_repr(key: str) -> str:
    """A JSON key as the error's JSON path shows it, cut to 24 characters (a key may be megabytes long)."""
    return repr(key) if len(key) <= 24 else f"{key[:24]!r}..."


def _canonical_index(key: str, path: str, maximum: int = MAX_LAYER_INDEX) -> int:
    if not _CANONICAL_INDEX.fullmatch(key):
        raise _SchemaError(f"{path}: layer key must be a decimal layer index in canonical form (\"3\", not \"03\")")
    if len(key) > len(str(maximum)) or int(key) > maximum:
        raise _SchemaError(f"{path}: the index is larger than {maximum}")
    return int(key)


def _parse_replicas(
    data: dict[str, Any], num_experts: int, num_devices: int, layers: dict[int, list[int]]
) -> tuple[dict[int, dict[int, list[int]]], int | None]:
    """Check the optional `"replicas"` / `"slots_per_device"` fields of docs/design.md §6 for form.

    `"replicas": {"<layer>": {"<expert>": [device, ...]}}`: extra homes of an expert beyond its device
    in `"layers"`; `"slots_per_device"`: the capacity the plan assumed. Returns `(replicas with int
    keys, slots_per_device or None)`; `Placement.__post_init__` checks the slots against the homes.
    """
    slots = None
    if "slots_per_device" in data:
        slots = _json_int(data["slots_per_device"], "$.slots_per_device", minimum=1)
    replicas = data.get("replicas")
    if replicas is None:
        return {}, slots
    if not isinstance(replicas, dict):
        raise _SchemaError(f"$.replicas must be a JSON object, got {json_kind(replicas)}")
    parsed: dict[int, dict[int, list[int]]] = {}
    for key, experts in replicas.items():
        path = f"$.replicas[{_key_repr(key)}]"
        layer = _canonical_index(key, path)
        if layer not in layers:
            raise _SchemaError(f"{path}: layer {layer} is not in $.layers")
        if not isinstance(experts, dict):
            raise _SchemaError(f"{path} must be a JSON object expert -> devices, got {json_kind(experts)}")
        for expert_key, homes in experts.items():
            expert_path = f"{path}[{_key_repr(expert_key)}]"
            expert = _canonical_index(expert_key, expert_path)
            if expert >= num_experts:
                raise _SchemaError(f"{expert_path}: expert {expert} is outside [0, num_experts={num_experts})")
            if not isinstance(homes, list) or not homes:
                raise _SchemaError(f"{expert_path} must be a non-empty list of device ids, got {json_kind(homes)}")
            for i, d in enumerate(homes):
                _json_int(d, f"{expert_path}[{i}]", minimum=0, below=num_devices, below_name="num_devices")
            if len(set(homes)) != len(homes) or layers[layer][expert] in homes:
                raise _SchemaError(f"{expert_path} repeats a device or the expert's own device in $.layers")
            parsed.setdefault(layer, {})[expert] = list(homes)
    return parsed, slots


def _parse_pin_slack(data: dict[str, Any], layers: dict[int, list[int]]) -> dict[int, float]:
    """Check the optional `"pin_slack": {"<layer>": number in [0, 1]}` of docs/design.md §6 (absent in files of
    earlier versions: every layer then uses `replicas.routing.PIN_SLACK`)."""
    raw = data.get("pin_slack", {})
    if not isinstance(raw, dict):
        raise _SchemaError(f"$.pin_slack must be a JSON object layer -> number, got {json_kind(raw)}")
    parsed = {}
    for key, slack in raw.items():
        path = f"$.pin_slack[{_key_repr(key)}]"
        layer = _canonical_index(key, path)
        if layer not in layers:
            raise _SchemaError(f"{path}: layer {layer} is not in $.layers")
        parsed[layer] = _fraction(slack, path)
    return parsed


__all__ = ["Placement", "PLACEMENT_FILENAME", "check_devices_per_node", "contiguous_devices"]
