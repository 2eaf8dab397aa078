"""What differs between dicts that should be equal, in words: the ranks' agreement summaries
(`occult_hf.distributed.agreement`) and a checkpoint's two copies of its placement (`occult_hf.config`) describe their
mismatches through these, so that a user reads the same words for the same fault."""

from __future__ import annotations

from typing import Any

#: how a key missing from one of the dicts reads
ABSENT = "<absent>"


def differing_keys(values: list[dict[str, Any]]) -> list[str]:
    """The keys whose value (or absence) is not the same in every dict, sorted."""
    return sorted({k for v in values for k in v if any(w.get(k, ABSENT) != values[0].get(k, ABSENT) for w in values)})


def placement_differences(placements: dict[str, dict[str, Any]]) -> str:
    """Where placements in their JSON form (`Placement.to_dict`, or a summary with a digest per layer and field)
    differ, each side named by its key ("rank 1", "the file"): the expert and device counts, the layers whose expert ->
    device maps differ, else the other fields that do."""
    names, values = list(placements), list(placements.values())
    notes = []
    for key in ("num_experts", "num_devices"):
        seen = [value.get(key) for value in values]
        if any(s != seen[0] for s in seen):
            notes.append(f"{key} " + ", ".join(f"{name} {s}" for name, s in zip(names, seen)))
    maps = [value.get("layers", {}) for value in values]
    layers = sorted({layer for m in maps for layer in m if any(other.get(layer) != m.get(layer) for other in maps)}, key=int)
    if layers:
        notes.append(f"expert -> device maps differ at layers [{', '.join(layers)}]")
    if not notes:
        others = [key for key in differing_keys(values) if key not in ("num_experts", "num_devices", "layers")]
        notes.append(f"{', '.join(others) or 'the placements'} differ")
    return "; ".join(notes)


__all__ = ["ABSENT", "differing_keys", "placement_differences"]
