"""Re-plan only the replicas of a placement from recent routing: the runtime answer to an unseen domain.

A placement planned before deployment cannot know which experts an unseen domain makes hot: on the
six OLMoE-0924 domains, a plan made on five with 8 redundant slots leaves the sixth at 1.13-2.03x
the mean load, and no split of *its* replicas fixes most of those cases (docs/placement.md). The
statistics that do know are the ones the runtime collects while serving (`OccultCallback`'s window
profile, `occult profile` on recent traffic). Re-planning the whole placement moves most experts;
re-planning only the redundant copies keeps every primary home where it is and moves at most R
expert copies (R = the redundant slots), which is cheap enough to do online.

`replan_replicas` keeps each layer's primary map and chooses the extra homes greedily: R times, the
copy whose addition lowers the max device load the most (ties: the lower sum of squared loads, then
the lower expert and device ids), among copies of an expert on the currently most loaded device onto
a device with a free slot. Loads are measured as the metrics measure them (`metrics.replica_device_load`:
under the replica rule on the profile's token sample, or each expert's load split evenly over its
homes for counts-only profiles), so the figure it optimises is the one `occult report` prints.

Shape legend: E experts, D devices, M most homes of one expert, N sampled tokens, k experts per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from ..metrics import replica_device_load
from ..replica_routing import home_table_from
from .placement import Placement

if TYPE_CHECKING:
    from ..profile import RoutingProfile


def replan_layer_replicas(
    device_of_E: np.ndarray,
    expert_load_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    num_redundant: int,
    slots_per_device: int,
) -> dict[int, list[int]]:
    """`{expert: [extra devices]}`: R extra homes for a fixed primary map, chosen greedily on the given loads.

    Args:
        device_of_E: `[E]` int primary device of each expert (kept).
        expert_load_E: `[E]` pairs routed to each expert (used when there is no sample).
        topk_sample_Nk: `[N, k]` int expert ids of sampled tokens, or None (counts only).
        num_devices: `D`.
        num_redundant: R extra homes to place (fewer when no copy lowers the load any more).
        slots_per_device: expert slots per device (primary and extra homes together).
    """
    device_of_E = np.asarray(device_of_E, dtype=np.int64)
    load_E = np.asarray(expert_load_E, dtype=np.float64)
    num_experts = len(device_of_E)
    used_D = np.bincount(device_of_E, minlength=num_devices)
    if used_D.max() > slots_per_device:
        raise ValueError(f"slots_per_device={slots_per_device} is below the {int(used_D.max())} primary homes on one device")
    extra: dict[int, list[int]] = {}

    def loads(replicas: dict[int, list[int]]) -> np.ndarray:
        table_EM = home_table_from(device_of_E, replicas) if replicas else None
        return replica_device_load(topk_sample_Nk, load_E, device_of_E, num_devices, table_EM)

    load_D = loads(extra)
    for _ in range(num_redundant):
        busiest = int(np.argmax(load_D))
        homes = [sorted([int(device_of_E[e]), *extra.get(e, [])]) for e in range(num_experts)]
        best = None
        for expert in (e for e in range(num_experts) if busiest in homes[e]):
            for device in range(num_devices):
                if used_D[device] >= slots_per_device or device in homes[expert]:
                    continue
                trial = {**extra, expert: sorted([*extra.get(expert, []), device])}
                trial_D = loads(trial)
                key = (float(trial_D.max()), float((trial_D**2).sum()), expert, device)
                if best is None or key < best[0]:
                    best = (key, trial, trial_D, device)
        if best is None or best[0][0] >= float(load_D.max()) - 1e-9:
            break  # no copy lowers the busiest device: keep the slots free
        _, extra, load_D, device = best
        used_D[device] += 1
    return extra


def replan_replicas(
    placement: Placement,
    profile: "RoutingProfile",
    num_redundant: int | None = None,
    layers: Iterable[int] | None = None,
) -> Placement:
    """A copy of `placement` with the same primary homes and replicas re-chosen on `profile`'s routing.

    Args:
        placement: the deployed placement (its primary map is kept; its replicas are replaced).
        profile: recent routing (for example `OccultCallback`'s window profile); its layers must include `layers`.
        num_redundant: R extra homes per layer; default: as many as `placement` has in that layer, or
            `slots_per_device x D - E` when it states its slots and has none.
        layers: layers to re-plan (default: all of the placement's; others keep their replicas).

    The result keeps `slots_per_device` (default `ceil((E + R) / D)`) and the deployed layers' `pin_slack` (the
    load-aware rule's setting, not chosen again here), and records in `meta["replicas_replanned_on"]` the
    profile's source.
    """
    chosen = list(placement.layers) if layers is None else [int(layer) for layer in layers]
    missing = [layer for layer in chosen if layer not in profile.layers]
    if missing:
        raise ValueError(f"replan_replicas: profile has no routing for layers {missing} (it has {sorted(profile.layers)})")
    if profile.num_experts != placement.num_experts:
        raise ValueError(
            f"replan_replicas: the profile has {profile.num_experts} routed experts but the placement is for "
            f"num_experts={placement.num_experts}: a profile of another model"
        )
    replicas = {layer: dict(extra) for layer, extra in placement.replicas.items()}
    slots = placement.slots_per_device
    final_slots = slots
    for layer in chosen:
        redundant = num_redundant
        if redundant is None:
            redundant = sum(len(d) for d in placement.replicas.get(layer, {}).values())
            if not redundant and slots is not None:
                redundant = slots * placement.num_devices - placement.num_experts
        if not isinstance(redundant, int) or isinstance(redundant, bool) or redundant < 0:
            raise ValueError(f"replan_replicas num_redundant must be an integer >= 0, got {redundant!r}")
        layer_slots = slots if slots is not None else -(-(placement.num_experts + redundant) // placement.num_devices)
        routing = profile.layer(layer)
        replicas[layer] = replan_layer_replicas(
            np.asarray(placement.device_of(layer)), routing.expert_counts, routing.topk_sample,
            placement.num_devices, redundant, layer_slots,
        )
        final_slots = layer_slots if slots is not None else max(final_slots or 0, layer_slots)
    meta = {**placement.meta, "replicas_replanned_on": profile.meta.get("source", "profile")}
    return Placement(
        placement.num_experts, placement.num_devices, dict(placement.layers), meta,
        {layer: extra for layer, extra in replicas.items() if extra}, final_slots,
        pin_slack={layer: slack for layer, slack in placement.pin_slack.items() if replicas.get(layer)},
    )


__all__ = ["replan_layer_replicas", "replan_replicas"]
