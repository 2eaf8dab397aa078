"""The quality study's variants: what is fine-tuned, pruned how, measured against what.

A variant is named so that its name says all of it (the worker's argument, its result file, its row):

- `base`: the pre-trained model, exact (Occult dispatch without pruning: the same function);
- `plain-s<seed>`: fine-tuned exact with that seed (the data order);
- `d<D>-<mode>-<N_d>-s<seed>`: fine-tuned with collaboration pruning (`router` or `similarity`)
  to `N_d` of `D` devices, eased in by `OccultCallback`'s schedule, with that seed;
- `noft-d<D>-<mode>-<N_d>`: the same pruning applied to the base model, not fine-tuned.

Exact variants are the same function at every `D`: they are measured under every study `D`'s
placement. The reference of a fine-tuned variant is `plain` with the same seed (a paired
difference: same data order); that of a variant without fine-tuning is `base`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MODES = ("router", "similarity")
_NAME = re.compile(r"^(?:(?P<base>base)|plain-s(?P<plain_seed>\d+)|noft-d(?P<noft_d>\d+)-(?P<noft_mode>[a-z]+)-(?P<noft_n>\d+)"
                   r"|d(?P<d>\d+)-(?P<mode>[a-z]+)-(?P<n>\d+)-s(?P<seed>\d+))$")  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """One variant (module docstring); `mode`, `devices` and `max_devices_per_token` are None when exact."""

    fine_tuned: bool
    seed: int | None = None
    mode: str | None = None
    devices: int | None = None
    max_devices_per_token: int | None = None

    def __post_init__(self) -> None:
        if self.fine_tuned != (self.seed is not None):
            raise ValueError(f"variant: a fine-tuned variant has a seed and only it (fine_tuned={self.fine_tuned}, seed={self.seed})")
        pruned = (self.mode, self.devices, self.max_devices_per_token)
        if any(p is not None for p in pruned) and not all(p is not None for p in pruned):
            raise ValueError(f"variant: mode, devices and max_devices_per_token are given together or not at all, got {pruned}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"variant: mode {self.mode!r} is not one of {MODES}")
        if self.mode is not None and not 1 <= self.max_devices_per_token < self.devices:
            raise ValueError(f"variant: N_d ({self.max_devices_per_token}) must be in [1, D={self.devices}) for pruning")

    @property
    def pruned(self) -> bool:
        return self.mode is not None

    @property
    def name(self) -> str:
        if not self.pruned:
            return f"plain-s{self.seed}" if self.fine_tuned else "base"
        core = f"d{self.devices}-{self.mode}-{self.max_devices_per_token}"
        return f"{core}-s{self.seed}" if self.fine_tuned else f"noft-{core}"

    @property
    def reference(self) -> "Variant":
        """The unpruned variant it is compared with: `plain` of the same seed, or `base`."""
        return Variant(True, self.seed) if self.fine_tuned else Variant(False)

    @property
    def row(self) -> str:
        """The variant without its seed: the row of the tables (`plain`, `router N_d=2`, `base`, ...)."""
        if not self.pruned:
            return "plain" if self.fine_tuned else "base"
        return f"{self.mode} N_d={self.max_devices_per_token}"

    @classmethod
    def parse(cls, name: str) -> "Variant":
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"variant name {name!r} is not base, plain-s<seed>, d<D>-<mode>-<N_d>-s<seed> or noft-d<D>-<mode>-<N_d>")
        g = match.groupdict()
        if g["base"]:
            return cls(False)
        if g["plain_seed"] is not None:
            return cls(True, int(g["plain_seed"]))
        if g["noft_d"] is not None:
            return cls(False, None, g["noft_mode"], int(g["noft_d"]), int(g["noft_n"]))
        return cls(True, int(g["seed"]), g["mode"], int(g["d"]), int(g["n"]))


def study_variants(device_limits: dict[int, tuple[int, ...]], modes: tuple[str, ...], seeds: tuple[int, ...],
                   first_limit: int = 2) -> list[Variant]:  # fmt: skip
    """Every variant of a study, most wanted first (a run cut short keeps those; the next run of the
    same command does the rest): for each seed `plain` and `N_d = first_limit` at every D and mode;
    then `base` and every variant without fine-tuning (cheap); then the other `N_d` seed by seed.

    `device_limits`: `{D: the N_d values at that D}`.
    """
    def pruned(seed, first: bool) -> list[Variant]:
        return [Variant(seed is not None, seed, mode, d, n) for d in sorted(device_limits, reverse=True)
                for n in device_limits[d] if (n == first_limit) == first for mode in modes]  # fmt: skip

    wanted = [v for seed in seeds for v in (Variant(True, seed), *pruned(seed, True))]
    cheap = [Variant(False), *pruned(None, True), *pruned(None, False)]
    rest = [v for seed in seeds for v in pruned(seed, False)]
    return wanted + cheap + rest
