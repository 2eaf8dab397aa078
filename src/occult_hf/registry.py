"""`Registry`: the one name -> implementation table behind every extension point of occult_hf.

occult_hf has five: token dispatchers, expert backends, pruning policies, placement planners and model
family adapters. Each is a `Registry`, so they behave alike: names are unique, lowercase strings; a lookup
of an unknown name is a `ValueError` that names the setting, lists the valid names and suggests the
closest one.

A registry can also *declare* built-in names with the module that registers them, without importing it.
`OccultConfig` validates `dispatcher`, `expert_backend` and `prune` against `DISPATCHERS`,
`EXPERT_BACKENDS` and `PRUNING_POLICIES` below, so the config stays a leaf: checking a name never imports
the torch-side code that implements it. `get()` imports the declaring module on first use, and a name
registered at run time (a user's own dispatcher) is valid from then on.

The fixed choices of two settings live here too (`DISPATCH_MODES`, `REPLICA_CHOICES`), so that the config and
the code that implements them read one definition. This module imports nothing of occult_hf but the input checks.
"""

from __future__ import annotations

import importlib
from typing import Any, Generic, Iterable, Iterator, TypeVar

from .utils.checks import did_you_mean

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """Unique lowercase name -> entry, with built-in names declared by the module that registers them.

    Args:
        kind: what an entry is, for messages ("dispatcher").
        setting: the user-facing setting that names an entry, for messages ("OccultConfig.dispatcher").
        declared: built-in name -> the module whose import registers it.
        reserved: values of the setting that are not entries and that no entry may take as its name ("auto",
            which chooses among the others; None, "off"), listed first in the error.
        traits: built-in name -> facts about it that validation needs before the module is imported
            (e.g. `{"similarity": {"needs_similarity": True}}`); registering sets them for new names.
    """

    def __init__(
        self,
        kind: str,
        setting: str,
        declared: dict[str, str] | None = None,
        reserved: Iterable[str] = (),
        traits: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.kind = kind
        self.setting = setting
        self.reserved = tuple(reserved)
        self._declared = dict(declared or {})
        self._traits = {name: dict(facts) for name, facts in (traits or {}).items()}
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, entry: Entry, **traits: Any) -> Entry:
        """Add `entry` under `name` and return it; a name already taken by another entry is an error."""
        if not isinstance(name, str) or not name or name != name.lower() or name in self.reserved:
            reserved = f" other than {', '.join(map(repr, self.reserved))}" if self.reserved else ""
            raise ValueError(f"a {self.kind} name must be a non-empty lowercase string{reserved}, got {name!r}")
        current = self._entries.get(name)
        if current is not None and current is not entry:
            raise ValueError(f"{self.kind} {name!r} is already registered ({_describe(current)}); choose another name")
        self._entries[name] = entry
        if traits:
            self._traits[name] = dict(traits)
        return entry

    def unregister(self, name: str) -> Entry:
        """Remove the entry of `name` and return it (a registration undone; a built-in name stays declared, and its
        module does not register it again once imported)."""
        self.get(name)
        return self._entries.pop(name)

    def names(self) -> tuple[str, ...]:
        """Every valid name, declared or registered, sorted (without the reserved ones)."""
        return tuple(sorted(set(self._declared) | set(self._entries)))

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._declared

    def trait(self, name: str, key: str, default: Any = None) -> Any:
        """A fact about `name` known without importing it (`traits`), else `default`."""
        return self._traits.get(name, {}).get(key, default)

    def names_with(self, key: str) -> tuple[str, ...]:
        """The valid names whose trait `key` is true (known without importing them), sorted."""
        return tuple(name for name in self.names() if self.trait(name, key))

    def check(self, name: str) -> str:
        """Return `name` if it is valid, else raise the registry's `ValueError` (imports nothing)."""
        if not isinstance(name, str) or name not in self:
            self._unknown(name)
        return name

    def get(self, name: str) -> Entry:
        """The entry of `name`, importing its declaring module first if needed."""
        if isinstance(name, str) and name not in self._entries and name in self._declared:
            importlib.import_module(self._declared[name])
        if not isinstance(name, str) or name not in self._entries:
            self._unknown(name)
        return self._entries[name]

    def items(self) -> Iterator[tuple[str, Entry]]:
        """Every `(name, entry)`, declared modules imported, in registration order."""
        for module in dict.fromkeys(self._declared.values()):
            importlib.import_module(module)
        return iter(list(self._entries.items()))

    def _unknown(self, name: object):
        valid = self.reserved + self.names()
        hint = did_you_mean([name], [v for v in valid if isinstance(v, str)]) if isinstance(name, str) else ""
        raise ValueError(f"{self.setting} must be one of {list(valid)}, got {name!r}{hint}")


def _describe(entry: object) -> str:
    return getattr(entry, "__qualname__", None) or type(entry).__qualname__


#: `OccultConfig.dispatch`: one row per (token, destination device), or per (token, expert) pair
DISPATCH_MODES = ("dedup", "per_expert")
#: `OccultConfig.replica_choice`: which home serves a pair of a replicated expert (`occult_hf.replicas.routing`)
REPLICA_CHOICES = ("static", "load_aware")

#: token dispatchers (`occult_hf.dispatch.register_dispatcher`); "auto" picks one per layer; trait `overlaps_chunks`
DISPATCHERS: Registry = Registry(
    "dispatcher",
    "OccultConfig.dispatcher",
    declared={
        "local": "occult_hf.dispatch.local",
        "all_to_all": "occult_hf.dispatch.all_to_all",
        "padded": "occult_hf.dispatch.static",
        "symm_mem": "occult_hf.dispatch.static",
        "hierarchical": "occult_hf.dispatch.hierarchical",
    },
    reserved=("auto",),
    traits={"all_to_all": {"overlaps_chunks": True}},  # `OccultConfig.dispatch_chunks` > 1 means something only here
)
#: local expert computations (`occult_hf.experts.register_expert_backend`); "auto" picks one per call
EXPERT_BACKENDS: Registry = Registry(
    "expert backend",
    "OccultConfig.expert_backend",
    declared={"torch": "occult_hf.experts", "triton": "occult_hf.experts", "grouped_mm_fused": "occult_hf.experts"},
    reserved=("auto",),
)
#: collaboration pruning policies (`occult_hf.pruning.register_pruning_policy`); trait `needs_similarity`
PRUNING_POLICIES: Registry = Registry(
    "pruning policy",
    "OccultConfig.prune",
    declared={"router": "occult_hf.pruning", "similarity": "occult_hf.pruning"},
    reserved=(None,),
    traits={"similarity": {"needs_similarity": True}},
)

__all__ = ["DISPATCHERS", "DISPATCH_MODES", "EXPERT_BACKENDS", "PRUNING_POLICIES", "REPLICA_CHOICES", "Registry"]
