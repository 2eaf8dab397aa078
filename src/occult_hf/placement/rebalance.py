"""Re-plan only the replicas of a placement from recent routing: the runtime answer to an unseen domain.

A placement planned before deployment cannot know which experts an unseen domain makes hot, and no
split of *its* replicas fixes most of those cases (docs/placement.md). The statistics that do know
are the ones the runtime collects while serving (`OccultCallback`'s window profile, `occult profile`
on recent traffic). Re-planning the whole placement moves most experts; re-planning only the
redundant copies keeps every primary home where it is and moves at most R expert copies (R = the
redundant slots), which is cheap enough to do online.

`replan_replicas` keeps each layer's primary map and chooses the extra homes greedily: R times, the
copy whose addition lowers the max device load the most (ties: the lower sum of squared loads, then
the lower expert and device ids), among copies of an expert on the currently most loaded device onto
a device with a free slot. Loads are measured as the metrics measure them (`metrics.replica_device_load`:
under the replica rule on the profile's token sample, or each expert's load split evenly over its
homes for counts-only profiles), so the figure it optimises is the one `occult report` prints.

Under the load-aware rule (`replica_choice="load_aware"`) those static-rule loads are the wrong target: the rule
splits a copied expert's pairs over its homes by load, keeping a pair on a home its token visits within the pin
slack. There the greedy adds the copy that lowers the fluid bound the most (the least max device load any split
of the copies' loads reaches, `fluid_set_loads`), and among equal bounds the one with the least CT on the sample
(the static-rule greedy's copies balanced held-out tokens worse than not re-planning at all: docs/placement.md).

Shape legend: E experts, D devices, M most homes of one expert, N sampled tokens, k experts per token, F sets of devices (local letter: the cuts of the fluid bound).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterable

import numpy as np

from ..metrics import replica_device_load, served_ct
from ..registry import REPLICA_CHOICES
from ..replicas.routing import home_table_from, resolve_homes_np
from ..utils.checks import shown
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
    replica_choice: str = "static",
) -> dict[int, list[int]]:
    """`{expert: [extra devices]}`: R extra homes for a fixed primary map, chosen greedily on the given loads.

    Args:
        device_of_E: `[E]` int primary device of each expert (kept).
        expert_load_E: `[E]` pairs routed to each expert (used when there is no sample).
        topk_sample_Nk: `[N, k]` int expert ids of sampled tokens, or None (counts only).
        num_devices: `D`.
        num_redundant: R extra homes to place (fewer when no copy lowers the load any more).
        slots_per_device: expert slots per device (primary and extra homes together).
        replica_choice: the runtime rule the copies will serve under (`OccultConfig.replica_choice`): "static"
            balances the loads that rule gives; "load_aware" the fluid bound that rule approaches, with CT as the
            tie-break (`_replan_for_load_aware`).
    """
    device_of_E = np.asarray(device_of_E, dtype=np.int64)
    load_E = np.asarray(expert_load_E, dtype=np.float64)
    num_experts = len(device_of_E)
    used_D = np.bincount(device_of_E, minlength=num_devices)
    if used_D.max() > slots_per_device:
        raise ValueError(f"slots_per_device={slots_per_device} is below the {int(used_D.max())} primary homes on one device")
    if replica_choice not in REPLICA_CHOICES:
        raise ValueError(f"replan replica_choice must be one of {REPLICA_CHOICES}, got {replica_choice!r}")
    if replica_choice == "load_aware":
        return _replan_for_load_aware(device_of_E, load_E, topk_sample_Nk, num_devices, num_redundant, slots_per_device - used_D)
    extra: dict[int, list[int]] = {}
    loads = functools.partial(_static_loads, device_of_E, load_E, topk_sample_Nk, num_devices)
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
        if best is None or best[0][:2] >= _balance_key(load_D):
            break  # no copy lowers the busiest device, or on a tie of busiest devices the spread: keep the slots free
        _, extra, load_D, device = best
        used_D[device] += 1
    return extra


def _static_loads(device_of_E, load_E, topk_sample_Nk, num_devices: int, replicas: dict[int, list[int]]) -> np.ndarray:
    """`[D]` device loads with `replicas` under the static replica rule, as `metrics.replica_device_load` measures them."""
    table_EM = home_table_from(device_of_E, replicas) if replicas else None
    return replica_device_load(topk_sample_Nk, load_E, device_of_E, num_devices, table_EM)


def _held(device_of_E: np.ndarray, num_devices: int, replicas: dict[int, list[int]]) -> np.ndarray:
    """`[E, D]` bool: the devices holding each expert, its primary home and its copies."""
    held_ED = np.zeros((len(device_of_E), num_devices), dtype=bool)
    held_ED[np.arange(len(device_of_E)), device_of_E] = True
    for expert, devices in replicas.items():
        held_ED[expert, devices] = True
    return held_ED


def _load_aware_ct(device_of_E: np.ndarray, topk_sample_Nk, num_devices: int, held_ED: np.ndarray) -> float:
    """CT on the sample with the experts held as `held_ED`, under the load-aware rule's visited-home preference (0
    without a sample)."""
    if topk_sample_Nk is None:
        return 0.0
    copies = {e: [int(d) for d in np.flatnonzero(row) if d != device_of_E[e]] for e, row in enumerate(held_ED) if row.sum() > 1}
    table_EM = home_table_from(device_of_E, copies) if copies else device_of_E[:, None]
    return served_ct(resolve_homes_np(topk_sample_Nk, table_EM, num_devices), num_devices)


def _layer_score(device_of_E: np.ndarray, routing, num_devices: int, replicas: dict, replica_choice: str) -> tuple[float, float]:
    """What the re-plan of `replica_choice` lowers, for one layer's copies on its profile routing (lower is better):
    static, the busiest device's load then the sum of squared loads; load-aware, the fluid bound then CT."""
    load_E = np.asarray(routing.expert_counts, dtype=np.float64)
    if replica_choice == "static":
        load_D = _static_loads(device_of_E, load_E, routing.topk_sample, num_devices, replicas)
        return float(load_D.max()), float((load_D**2).sum())
    held_ED = _held(device_of_E, num_devices, replicas)
    bound = float(fluid_set_loads(load_E, held_ED, device_subsets(num_devices)).max())
    return bound, _load_aware_ct(device_of_E, routing.topk_sample, num_devices, held_ED)


def _balance_key(load_D: np.ndarray) -> tuple[float, float]:
    """What the static-rule greedy lowers: the busiest device's load, then (where several devices share it, so no
    one copy lowers it) the sum of squared loads, less a tolerance that stops it on rounding."""
    return float(load_D.max()) - 1e-9, float((load_D**2).sum()) * (1 - 1e-12)


#: the most devices whose subsets the load-aware re-plan enumerates (2^D - 1 of them)
MAX_FLUID_DEVICES = 16


def device_subsets(num_devices: int) -> np.ndarray:
    """`[F, D]` bool: every non-empty set of devices (F = 2^D - 1), the cuts of the fluid bound."""
    if num_devices > MAX_FLUID_DEVICES:
        raise ValueError(
            f"the load-aware re-plan enumerates the 2^D - 1 device sets: num_devices={num_devices} must be at most "
            f"{MAX_FLUID_DEVICES}; use replica_choice='static'"
        )
    return ((np.arange(1, 2**num_devices)[:, None] >> np.arange(num_devices)) & 1).astype(bool)


def experts_inside(held_ED: np.ndarray, sets_FD: np.ndarray) -> np.ndarray:
    """`[E, F]` bool: expert e has every home in device set f."""
    return ~(held_ED[:, None, :] & ~sets_FD[None]).any(2)


def fluid_set_loads(load_E: np.ndarray, held_ED: np.ndarray, sets_FD: np.ndarray) -> np.ndarray:
    """`[F]` load of the experts whose homes all lie in each device set, per device of the set.

    Its maximum is the least max device load any split of the replicated experts' loads over their homes
    reaches (max-flow min-cut: a set's experts have nowhere else to go, and a split meeting every set's
    average exists), the balance a load-aware rule approaches when it ignores CT."""
    return (load_E @ experts_inside(held_ED, sets_FD)) / sets_FD.sum(1)


def _replan_for_load_aware(
    device_of_E: np.ndarray,
    load_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    num_redundant: int,
    free_D: np.ndarray,
) -> dict[int, list[int]]:
    """R extra homes for the load-aware rule: each step adds the copy that lowers the fluid bound the most
    (`fluid_set_loads`), and among copies that reach the same bound the one with the lowest CT on the sample
    under the rule's visited-home preference (a copy on a device its tokens visit anyway cuts CT as well as
    load); ties: the lower expert and device ids. Stops when no copy lowers the bound or the CT.

    A balance-only greedy on the static rule's loads is the wrong target here: the load-aware rule splits a
    copied expert's pairs by load, so what bounds it is the fluid split, not the static rule's counts."""
    sets_FD = device_subsets(num_devices)
    held_ED = _held(device_of_E, num_devices, {})
    free_D = free_D.copy()
    extra: dict[int, list[int]] = {}
    ct = functools.partial(_load_aware_ct, device_of_E, topk_sample_Nk, num_devices)

    bound, current_ct = float(fluid_set_loads(load_E, held_ED, sets_FD).max()), ct(held_ED)
    tolerance = 1e-9 * max(float(load_E.sum()), 1.0)
    for _ in range(num_redundant):
        # a copy of e on d takes e out of every set that lacks d: [E, D, F] set loads after each copy
        inside_EF = experts_inside(held_ED, sets_FD)
        base_F = load_E @ inside_EF
        leaves_EDF = inside_EF[:, None, :] & ~sets_FD.T[None]
        trial_EDF = (base_F[None, None] - load_E[:, None, None] * leaves_EDF) / sets_FD.sum(1)
        bound_ED = trial_EDF.max(2)
        bound_ED[held_ED | (free_D <= 0)[None]] = np.inf
        least = float(bound_ED.min())
        if not np.isfinite(least):
            break
        best = None
        for expert, device in zip(*np.nonzero(bound_ED <= least + tolerance)):
            trial_ED = held_ED.copy()
            trial_ED[expert, device] = True
            key = (ct(trial_ED), int(expert), int(device))
            if best is None or key < best[0]:
                best = (key, trial_ED)
        (trial_ct, expert, device), trial_ED = best
        if least >= bound - tolerance and trial_ct >= current_ct - 1e-12:
            break  # neither the bound nor the CT improves: keep the slots free
        held_ED, bound, current_ct = trial_ED, least, trial_ct
        free_D[device] -= 1
        extra.setdefault(expert, []).append(device)
    return {expert: sorted(devices) for expert, devices in extra.items()}


#: the meta entries in which a planner scores its placement, replicas included (`occult report` prints them): a
#: re-plan that changes the replicas drops them rather than carry figures of copies it removed
PLAN_SCORES = ("profile_metrics", "expected_held_out", "worst_profile")


def _unstated_slots(placement: Placement, layer: int, redundant: int) -> int:
    """The slots per device a placement that states none has for `layer`: `ceil((E + R) / D)`, or the most experts
    one device holds there now when more (the deployment shows its devices hold them: fewer would refuse uneven
    primaries, or drop deployed copies for worse ones)."""
    even = -(-(placement.num_experts + redundant) // placement.num_devices)
    return max(even, *placement.capacities(layer))


def _check_recent_routing(routing, layer: int) -> None:
    """Raise unless the layer's recent routing holds tokens counted as finite, non-negative numbers: on no tokens
    every choice of copies scores the same, and NaN or negative counts choose copies on garbage, both silently."""
    counts_E = np.asarray(routing.expert_counts, dtype=np.float64)
    if not np.isfinite(counts_E).all() or (counts_E < 0).any():
        raise ValueError(
            f"replan_replicas: layer {layer} of the routing profile has expert counts that are not finite, "
            f"non-negative numbers ({shown(counts_E.tolist())}): re-profile the recent routing"
        )
    if int(routing.token_count) < 1 or counts_E.sum() <= 0:
        raise ValueError(
            f"replan_replicas: layer {layer} of the routing profile holds no tokens, so there is nothing to re-plan "
            f"the replicas on: profile a window that saw traffic"
        )


def replan_replicas(
    placement: Placement,
    profile: "RoutingProfile",
    num_redundant: int | None = None,
    layers: Iterable[int] | None = None,
    replica_choice: str = "static",
) -> Placement:
    """A copy of `placement` with the same primary homes and replicas re-chosen on `profile`'s routing.

    Args:
        placement: the deployed placement (its primary map is kept; its replicas are replaced).
        profile: recent routing (for example `OccultCallback`'s window profile); its layers must include `layers`.
        num_redundant: R extra homes per layer; default: as many as `placement` has in that layer, or
            `slots_per_device x D - E` when it states its slots and has none.
        layers: layers to re-plan (default: all of the placement's; others keep their replicas).
        replica_choice: the runtime's replica rule, which the copies are chosen for (`replan_layer_replicas`).

    The result keeps `slots_per_device` (default `ceil((E + R) / D)`, and at least what any layer holds now),
    `devices_per_node` and the deployed layers' `pin_slack` (the load-aware rule's setting, not chosen again here), and
    records in `meta["replicas_replanned_on"]` the profile's source; when the replicas change it drops the plan's
    scores (`PLAN_SCORES`), which describe the copies it replaced. A layer whose deployed copies fit the budget
    and score no worse on the profile than the re-planned ones (`_layer_score`: the greedy adds one copy at a
    time and can stop where only several copies together help) keeps them, listed in
    `meta["replicas_kept_in_layers"]`: the re-plan never balances the profile worse than what is deployed.
    """
    chosen = list(placement.layers) if layers is None else [int(layer) for layer in layers]
    missing = [layer for layer in chosen if layer not in profile.layers]
    if missing:
        profile_name = f"the routing profile {profile.path!r}" if profile.path else "the routing profile"
        placement_name = f"the placement {placement.source!r}" if placement.source else "the placement"
        raise ValueError(
            f"replan_replicas: {profile_name} has no routing for layers {shown(missing)} of {placement_name} (it has "
            f"{shown(sorted(profile.layers))})"
        )
    if profile.num_experts != placement.num_experts:
        raise ValueError(
            f"replan_replicas: the profile has {profile.num_experts} routed experts but the placement is for "
            f"num_experts={placement.num_experts}: a profile of another model"
        )
    replicas = {layer: dict(extra) for layer, extra in placement.replicas.items()}
    kept_layers: list[int] = []
    slots = placement.slots_per_device
    final_slots = slots
    for layer in chosen:
        redundant = num_redundant
        if redundant is None:
            redundant = sum(len(d) for d in placement.replicas.get(layer, {}).values())
            if not redundant and slots is not None:
                redundant = slots * placement.num_devices - placement.num_experts
        if not isinstance(redundant, (int, np.integer)) or isinstance(redundant, bool) or redundant < 0:
            raise ValueError(f"replan_replicas num_redundant must be an integer >= 0, got {redundant!r}")
        redundant = int(redundant)
        layer_slots = slots if slots is not None else _unstated_slots(placement, layer, redundant)
        routing = profile.layer(layer)
        _check_recent_routing(routing, layer)
        device_of_E = np.asarray(placement.device_of(layer))
        replanned = replan_layer_replicas(
            device_of_E, routing.expert_counts, routing.topk_sample, placement.num_devices, redundant, layer_slots, replica_choice,
        )
        deployed = placement.replicas.get(layer, {})
        if (
            deployed
            and sum(len(d) for d in deployed.values()) <= redundant
            and max(placement.capacities(layer)) <= layer_slots
            and _layer_score(device_of_E, routing, placement.num_devices, deployed, replica_choice)
            <= _layer_score(device_of_E, routing, placement.num_devices, replanned, replica_choice)
        ):
            replanned = dict(deployed)  # the greedy (one copy at a time) found nothing better than what is deployed
            kept_layers.append(layer)
        replicas[layer] = replanned
        final_slots = layer_slots if slots is not None else max(final_slots or 0, layer_slots)
    if slots is None:  # the slots the result states hold the layers left alone as they are
        kept = [max(placement.capacities(layer)) for layer in placement.layers if layer not in chosen]
        final_slots = max([final_slots or 0, *kept]) or None
    replicas = {layer: extra for layer, extra in replicas.items() if extra}
    stale = PLAN_SCORES if replicas != placement.replicas else ()  # figures of the copies no longer deployed
    meta = {key: value for key, value in placement.meta.items() if key not in stale}
    meta["replicas_replanned_on"] = profile.meta.get("source", "profile")
    meta["replicas_kept_in_layers"] = kept_layers
    return Placement(
        placement.num_experts, placement.num_devices, dict(placement.layers), meta, replicas, final_slots,
        pin_slack={layer: slack for layer, slack in placement.pin_slack.items() if replicas.get(layer)},
        devices_per_node=placement.devices_per_node,
    )


__all__ = ["MAX_FLUID_DEVICES", "device_subsets", "experts_inside", "fluid_set_loads", "replan_layer_replicas", "replan_replicas"]
