"""`Placement`: per MoE layer, which device holds each routed expert (DESIGN.md §2, §6).

A device's local experts are its experts in increasing global id; `local_slot(l)[e]` is the
position of expert `e` among its device's experts. The runtime, the planners and the metrics all
read placements through this class so that the slot convention lives in one place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

PLACEMENT_FILENAME = "occult_placement.json"


@dataclass
class Placement:
    """Expert -> device maps for a set of MoE layers.

    Attributes:
        num_experts: `E`, routed experts per layer.
        num_devices: `D`, devices in the expert-parallel group.
        layers: decoder-layer index -> list of `E` device ids (`layers[l][e]` is the device of expert `e`).
        meta: free-form JSON-safe information (method, profile, scores).
    """

    num_experts: int
    num_devices: int
    layers: dict[int, list[int]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"Placement.num_experts must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"Placement.num_devices must be a positive integer, got {self.num_devices!r}")
        if self.num_devices > self.num_experts:
            raise ValueError(
                f"Placement.num_devices ({self.num_devices}) exceeds num_experts ({self.num_experts}): "
                f"some device would hold no expert"
            )
        self.layers = {int(layer): [int(d) for d in devices] for layer, devices in self.layers.items()}
        for layer, devices in self.layers.items():
            if len(devices) != self.num_experts:
                raise ValueError(
                    f"Placement layer {layer} maps {len(devices)} experts, expected num_experts={self.num_experts}"
                )
            bad = [d for d in devices if not 0 <= d < self.num_devices]
            if bad:
                raise ValueError(
                    f"Placement layer {layer} uses device ids {sorted(set(bad))} outside [0, {self.num_devices})"
                )

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int, layers: Iterable[int]) -> "Placement":
        """Expert `e` on device `e * D // E`: what every framework does; capacities differ by at most one."""
        devices = [e * num_devices // num_experts for e in range(num_experts)]
        return cls(num_experts, num_devices, {int(l): list(devices) for l in layers}, {"method": "contiguous"})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Placement":
        missing = {"num_experts", "num_devices", "layers"} - set(data)
        if missing:
            raise ValueError(f"placement JSON lacks keys {sorted(missing)}")
        return cls(int(data["num_experts"]), int(data["num_devices"]), dict(data["layers"]), dict(data.get("meta", {})))

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "num_devices": self.num_devices,
            "layers": {str(l): list(d) for l, d in sorted(self.layers.items())},
            "meta": self.meta,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write `occult_placement.json`; a directory path gets the standard file name."""
        if os.path.isdir(path):
            path = os.path.join(path, PLACEMENT_FILENAME)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Placement":
        if os.path.isdir(path):
            path = os.path.join(path, PLACEMENT_FILENAME)
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # ----- queries ------------------------------------------------------------------------
    def device_of(self, layer: int) -> list[int]:
        """`[E]` device of each expert at `layer`."""
        try:
            return self.layers[int(layer)]
        except KeyError:
            raise KeyError(
                f"placement has no entry for layer {layer}; it covers layers {sorted(self.layers)}"
            ) from None

    def experts_on(self, layer: int, device: int) -> list[int]:
        """Global ids of the experts `device` holds at `layer`, in local-slot order (increasing id)."""
        return [e for e, d in enumerate(self.device_of(layer)) if d == device]

    def local_slot(self, layer: int) -> list[int]:
        """`[E]` position of each expert among the experts of its own device."""
        seen = [0] * self.num_devices
        slots = []
        for d in self.device_of(layer):
            slots.append(seen[d])
            seen[d] += 1
        return slots

    def capacities(self, layer: int) -> list[int]:
        """`[D]` number of experts each device holds at `layer`."""
        return np.bincount(self.device_of(layer), minlength=self.num_devices).tolist()

    def validate_for(self, num_experts: int, layers: Iterable[int], num_devices: int | None = None) -> None:
        """Raise a clear error when this placement does not fit a model (expert count, layers, devices)."""
        if num_experts != self.num_experts:
            raise ValueError(
                f"placement is for num_experts={self.num_experts} but the model has {num_experts} routed experts"
            )
        if num_devices is not None and num_devices != self.num_devices:
            raise ValueError(
                f"placement is for num_devices={self.num_devices} but the expert-parallel group has {num_devices}"
            )
        missing = sorted(set(int(l) for l in layers) - set(self.layers))
        if missing:
            raise ValueError(
                f"placement lacks MoE layers {missing}; it covers layers {sorted(self.layers)}"
            )


__all__ = ["Placement", "PLACEMENT_FILENAME"]
