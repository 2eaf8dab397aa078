"""Held-out perplexity and learned-routing statistics of a trained model (docs/design.md §8).

- `perplexity`: exp of the mean next-token negative log-likelihood over non-overlapping `[B, S]`
  windows of a held-out stream; every token is predicted at most once (the first token of each
  window has no context inside the window and is not scored).
- `capture_routing`: the top-k expert ids and routing weights each MoE layer's router chose for
  every token, through forward hooks on the routers (what the model dispatches when it is not pruned).
- `routing_structure`: is the routing learned? Expert-load entropy (1.0 = uniform) and how much of
  the co-activation mass sits in the most frequent pairs, each beside the same numbers for a
  uniformly random router on as many tokens.

Shape legend (docs/conventions.md): B windows (sequences; a batch of them), S sequence length, N tokens,
k experts per token, E experts.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch


@contextlib.contextmanager
def _eval_batches(model, windows_BS: np.ndarray, batch_size: int):
    """The windows as `[B, S]` int64 batches on the model's device, the model in eval mode inside the block (its mode
    restored after)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        yield (torch.as_tensor(windows_BS[start : start + batch_size], dtype=torch.long, device=device)
               for start in range(0, len(windows_BS), batch_size))  # fmt: skip
    finally:
        model.train(was_training)


@torch.no_grad()
def mean_nll(model, windows_BS: np.ndarray, batch_size: int = 16) -> tuple[float, int]:
    """(mean next-token NLL in nats, tokens scored) over the windows; the model's mode is restored."""
    total, count = 0.0, 0
    with _eval_batches(model, windows_BS, batch_size) as batches:
        for ids_BS in batches:
            logits_BSV = model(input_ids=ids_BS, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]), ids_BS[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll)
            count += ids_BS[:, 1:].numel()
    return total / max(count, 1), count


def perplexity(model, windows_BS: np.ndarray, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) over the windows (module docstring)."""
    return float(math.exp(mean_nll(model, windows_BS, batch_size)[0]))


@torch.no_grad()
def capture_routing(model, windows_BS: np.ndarray, batch_size: int = 16) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per MoE layer, (`[N, k]` int64 expert ids, `[N, k]` float32 routing weights) of every window token,
    for any supported family: the family adapter's view of its router (`patches.base`), the weights by
    the model's own rule for the chosen experts."""
    from occult_hf.patches.base import adapter_for

    adapter = adapter_for(model.config)
    captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    handles = []

    def hook_for(layer: int, block):
        def hook(router, inputs, output) -> None:
            logits_TE, ids_Tk = adapter.observe(router, inputs, output)
            weights_Tk = adapter.renormalize(block, logits_TE, ids_Tk)
            captured.setdefault(layer, []).append((ids_Tk.detach().cpu(), weights_Tk.detach().float().cpu()))

        return hook

    for layer, _, block in adapter.iter_moe_blocks(model):
        handles.append(adapter.router(block).register_forward_hook(hook_for(layer, block)))
    base = getattr(model, "model", model)
    try:
        with _eval_batches(model, windows_BS, batch_size) as batches:
            for ids_BS in batches:
                base(input_ids=ids_BS, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {
        layer: (torch.cat([c[0] for c in chunks]).numpy().astype(np.int64), torch.cat([c[1] for c in chunks]).numpy())
        for layer, chunks in captured.items()
    }


def random_topk(num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """`[N, k]` distinct experts per token, uniformly at random (a router that learned nothing)."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k]


def load_entropy(topk_ids_Nk: np.ndarray, num_experts: int) -> float:
    """Entropy of the expert-load distribution over log(E): 1.0 when every expert gets the same load."""
    load_E = np.bincount(topk_ids_Nk.reshape(-1), minlength=num_experts).astype(np.float64)
    p_E = load_E / load_E.sum()
    nz = p_E[p_E > 0]
    return float(-(nz * np.log(nz)).sum() / math.log(num_experts))


def top_pair_share(topk_ids_Nk: np.ndarray, num_experts: int, fraction: float = 0.1) -> float:
    """Share of all co-activations (token, expert pair) that fall on the top `fraction` of expert pairs."""
    from ..profile.stats import LayerAccumulator

    acc = LayerAccumulator(num_experts, topk_ids_Nk.shape[1], sample_size=None)
    acc.update(torch.from_numpy(topk_ids_Nk))
    coact_EE = acc.to_layer_routing().coactivation
    pairs = coact_EE[np.triu_indices(num_experts, 1)].astype(np.float64)
    top = np.sort(pairs)[::-1][: max(1, int(round(len(pairs) * fraction)))]
    return float(top.sum() / max(pairs.sum(), 1.0))


def routing_structure(routing: dict[int, tuple[np.ndarray, np.ndarray]], num_experts: int, seed: int = 0) -> dict:
    """Per layer and mean: load entropy and top-10% pair share, learned vs a uniformly random router."""
    rows = {}
    for layer, (ids_Nk, _weights) in sorted(routing.items()):
        rand_Nk = random_topk(len(ids_Nk), num_experts, ids_Nk.shape[1], seed + layer)
        rows[layer] = {
            "load_entropy": load_entropy(ids_Nk, num_experts),
            "load_entropy_random": load_entropy(rand_Nk, num_experts),
            "top10_pair_share": top_pair_share(ids_Nk, num_experts),
            "top10_pair_share_random": top_pair_share(rand_Nk, num_experts),
            "max_expert_load_over_mean": float(
                np.bincount(ids_Nk.reshape(-1), minlength=num_experts).max() / (ids_Nk.size / num_experts)
            ),
        }
    mean = {name: float(np.mean([r[name] for r in rows.values()])) for name in next(iter(rows.values()))}
    return {"layers": rows, "mean": mean}


def removed_weight(
    topk_ids_Nk: np.ndarray, topk_weights_Nk: np.ndarray, device_of_E, num_devices: int, max_devices_per_token: int
) -> tuple[float, float]:
    """(mean fraction of routing weight outside each token's `N_d` devices, share of tokens that lose an
    expert): what collaboration pruning to `N_d` removes (or hands to a replacement), by the pruning walk."""
    from ..pruning import token_device_sets

    ids = torch.as_tensor(topk_ids_Nk, dtype=torch.long)
    weights = torch.as_tensor(topk_weights_Nk, dtype=torch.float32)
    device_of_E = torch.as_tensor(np.asarray(device_of_E), dtype=torch.long)
    allowed_ND = token_device_sets(ids, weights, device_of_E, num_devices, max_devices_per_token)
    inside_Nk = allowed_ND.gather(1, device_of_E[ids])
    removed_N = (weights * ~inside_Nk).sum(1) / weights.sum(1).clamp_min(torch.finfo(torch.float32).tiny)
    return float(removed_N.mean()), float((~inside_Nk).any(1).float().mean())
