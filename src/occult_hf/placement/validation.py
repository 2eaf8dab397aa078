"""What a placement will do on tokens it has not seen, estimated before deploying it.

`cross_validate` cuts each profile's token sample into K contiguous folds, plans on K - 1 of them
with the same method and options, and measures on the fold left out: CT, balance and the balance
floor of the held-out tokens. A placement's promise counts only held out (docs/design.md §2): a plan
well balanced on its profile can be far less so on the next tokens. Contiguous folds (not random
tokens) keep documents and batches together, so the estimate includes the drift between parts of
the data, not only the sampling noise.

Shape legend: N sampled tokens, k experts per token, E experts.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from ..metrics import evaluate_layer
from ..profile import RoutingProfile
from ..profile.stats import LayerAccumulator
from .registry import plan_profiles


def profile_from_sample(layers_topk: dict[int, np.ndarray], num_experts: int, source: str) -> RoutingProfile:
    """A `RoutingProfile` holding every given token (as its sample) per layer, counted by `LayerAccumulator`."""
    layers = {}
    top_k = None
    for layer, ids_Nk in layers_topk.items():
        top_k = ids_Nk.shape[1]
        accumulator = LayerAccumulator(num_experts, top_k, sample_size=None)
        accumulator.update(torch.from_numpy(np.ascontiguousarray(ids_Nk, dtype=np.int64)))
        layers[layer] = accumulator.to_layer_routing()
    return RoutingProfile(num_experts, int(top_k), layers, meta={"source": source})


def _fold(profile: RoutingProfile, layers: list[int], folds: int, index: int) -> tuple[RoutingProfile, RoutingProfile]:
    """(planning part, held-out fold `index`) of `profile`'s samples, contiguous folds."""
    train, test = {}, {}
    for layer in layers:
        sample = profile.layer(layer).topk_sample
        fold_N = np.arange(len(sample)) * folds // len(sample)
        train[layer], test[layer] = sample[fold_N != index], sample[fold_N == index]
    source = profile.meta.get("source")
    return (
        profile_from_sample(train, profile.num_experts, f"{source} without fold {index}"),
        profile_from_sample(test, profile.num_experts, f"{source} fold {index}"),
    )


def cross_validate(
    profiles: RoutingProfile | list[RoutingProfile],
    num_devices: int,
    method: str = "refined",
    *,
    folds: int = 2,
    layers: Iterable[int] | None = None,
    devices_per_node: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Expected held-out figures of `plan_profiles(profiles, num_devices, method, **options)`.

    Returns a JSON-safe dict: `folds`; per layer (`"layers"`) the held-out CT (mean over folds;
    None without samples), balance (mean over folds of the worst profile's held-out balance),
    `balance_worst` (the worst fold) and `balance_floor` (held-out floor, mean over folds); and the
    same averaged over layers (`"mean"`); with `devices_per_node` (planned node-aware) also the held-out
    CT_node (`"ct_node"`). Without per-token samples nothing can be held out:
    `{"folds": K, "skipped": reason}`.
    """
    items = [profiles] if isinstance(profiles, RoutingProfile) else list(profiles)
    if not isinstance(folds, int) or folds < 2:
        raise ValueError(f"cross_validate folds must be an integer >= 2, got {folds!r}")
    if not all(p.has_samples for p in items):
        return {"folds": folds, "skipped": "the profile has no per-token top-k sample to hold out"}
    chosen = sorted(set.intersection(*(set(p.layers) for p in items))) if layers is None else [int(l) for l in layers]
    short = min(len(p.layer(l).topk_sample) for p in items for l in chosen)
    if short < 2 * folds:
        return {"folds": folds, "skipped": f"a layer's sample holds {short} tokens, too few for {folds} folds"}
    per_layer: dict[int, dict[str, list[float]]] = {l: {"ct": [], "ct_node": [], "balance": [], "balance_floor": []} for l in chosen}
    for index in range(folds):
        parts = [_fold(p, chosen, folds, index) for p in items]
        planned = plan_profiles(
            [t for t, _ in parts], num_devices, method, layers=chosen, progress=False, devices_per_node=devices_per_node, **options
        )
        for layer in chosen:
            home_table = planned.home_table(layer) if planned.has_replicas else None
            device_of_E = np.asarray(planned.device_of(layer))
            measured = [
                evaluate_layer(held.layer(layer), device_of_E, num_devices, held.top_k, home_table, devices_per_node)
                for _, held in parts
            ]
            sizes = [len(held.layer(layer).topk_sample) for _, held in parts]
            per_layer[layer]["ct"].append(float(np.average([m.ct for m in measured], weights=sizes)))
            if devices_per_node is not None:
                per_layer[layer]["ct_node"].append(float(np.average([m.nodes.ct_node_mean for m in measured], weights=sizes)))
            worst = max(measured, key=lambda m: m.balance)
            per_layer[layer]["balance"].append(worst.balance)
            per_layer[layer]["balance_floor"].append(worst.balance_floor)
    out_layers = {
        str(layer): {
            "ct": round(float(np.mean(v["ct"])), 4),
            "balance": round(float(np.mean(v["balance"])), 4),
            "balance_worst": round(float(np.max(v["balance"])), 4),
            "balance_floor": round(float(np.mean(v["balance_floor"])), 4),
            **({"ct_node": round(float(np.mean(v["ct_node"])), 4)} if v["ct_node"] else {}),
        }
        for layer, v in per_layer.items()
    }
    keys = ("ct", "balance", "balance_floor") + (("ct_node",) if devices_per_node is not None else ())
    mean = {key: round(float(np.mean([row[key] for row in out_layers.values()])), 4) for key in keys}
    mean["balance_worst"] = round(float(max(row["balance_worst"] for row in out_layers.values())), 4)
    return {"folds": folds, "layers": out_layers, "mean": mean}


__all__ = ["cross_validate", "profile_from_sample"]
