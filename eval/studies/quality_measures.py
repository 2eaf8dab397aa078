"""What the quality study measures on a model with Occult blocks (docs/design.md §8; docs/quality.md).

- held-out perplexity of every domain (`occult_hf.training.evaluate.perplexity`);
- on held-out B, the routing as dispatched (after pruning) and what pruning removed, through one
  forward pass; from it, under a placement: mean CT, remote copies and bytes per token (bf16, one
  direction, per MoE layer: remote copies x hidden x 2 bytes);
- drift: CT on held-out B of the placement planned before fine-tuning against one re-planned on the
  fine-tuned model's routing of B's training split (the same planner and options).

Shape legend (docs/conventions.md): N tokens, k experts per token, B windows, S sequence length.
"""

from __future__ import annotations

import numpy as np

#: bytes of one element of a dispatched hidden state (bf16, as deployed)
BYTES_PER_ELEMENT = 2


def dispatched_routing(model, windows_BS: np.ndarray) -> tuple[dict[int, np.ndarray], float]:
    """(`{layer: [N, k]}` expert ids each Occult block dispatched over `windows_BS`, the mean fraction
    of routing weight that pruning removed: 0.0 without pruning)."""
    import torch

    from occult_hf.hf.apply import occult_modules
    from occult_hf.pruning import pruners_of
    from occult_hf.training.evaluate import mean_nll

    blocks = {module.layer_idx: module for module in occult_modules(model).values()}
    captured: dict[int, list] = {layer: [] for layer in blocks}
    handles = [block.register_forward_hook(lambda m, i, o, layer=layer: captured[layer].append(m.last_topk_ids_Tk.cpu()))
               for layer, block in blocks.items()]  # fmt: skip
    pruners = pruners_of(model)
    for pruner in pruners.values():
        pruner.pop_stats()
    try:
        mean_nll(model, windows_BS)
    finally:
        for handle in handles:
            handle.remove()
    removed = [p.pop_stats()["removed_weight_fraction"] for p in pruners.values()]
    return {layer: torch.cat(chunks).numpy() for layer, chunks in captured.items()}, float(np.mean(removed)) if removed else 0.0


def communication(ids_by_layer: dict[int, np.ndarray], placement, hidden_size: int) -> dict:
    """Mean over layers of CT and remote copies of dispatching `ids_by_layer` under `placement`, and the
    bytes per token that makes (module docstring)."""
    from occult_hf.metrics import communication_volume

    volumes = [communication_volume(ids_Nk, np.asarray(placement.device_of(layer)), placement.num_devices)
               for layer, ids_Nk in ids_by_layer.items()]  # fmt: skip
    remote = float(np.mean([v.remote_copies_mean for v in volumes]))
    return {"ct": float(np.mean([v.ct_mean for v in volumes])), "remote_copies": remote,
            "bytes_per_token": remote * hidden_size * BYTES_PER_ELEMENT}  # fmt: skip


def profile_from_ids(ids_by_layer: dict[int, np.ndarray], num_experts: int, source: str):
    """A `RoutingProfile` of the given top-k ids (every token kept in its sample)."""
    import torch

    from occult_hf.profile import RoutingProfile
    from occult_hf.profile.stats import LayerAccumulator

    layers = {}
    for layer, ids_Nk in ids_by_layer.items():
        acc = LayerAccumulator(num_experts, ids_Nk.shape[1], sample_size=None)
        acc.update(torch.from_numpy(np.ascontiguousarray(ids_Nk)))
        layers[int(layer)] = acc.to_layer_routing()
    return RoutingProfile(num_experts, next(iter(ids_by_layer.values())).shape[1], layers, meta={"source": source})


def drift(train_ids: dict[int, np.ndarray], heldout_ids: dict[int, np.ndarray], before, num_experts: int,
          planner_options: dict) -> dict:  # fmt: skip
    """CT and balance on `heldout_ids` of the placement `before` and of one `refined` placement
    re-planned (with `planner_options`) on `train_ids`, at `before`'s device count."""
    from occult_hf.metrics import evaluate_placement
    from occult_hf.placement import plan_placement

    replanned = plan_placement(profile_from_ids(train_ids, num_experts, "fine-tuned routing, training split"),
                               before.num_devices, "refined", progress=False, **planner_options)  # fmt: skip
    held = profile_from_ids(heldout_ids, num_experts, "fine-tuned routing, held-out split")
    result = {}
    for name, placement in (("before", before), ("replanned", replanned)):
        metrics = evaluate_placement(held, placement)
        result[f"ct_{name}"] = float(np.mean([m.ct for m in metrics.values()]))
        result[f"balance_{name}"] = float(np.mean([m.balance for m in metrics.values()]))
    return result
