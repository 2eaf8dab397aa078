"""Streaming accumulation of one MoE layer's routing statistics (docs/design.md §2, §6).

`LayerAccumulator.update(topk_ids_Tk, logits_TE, token_mask_T)` is the one place where routing
decisions become profile statistics. Forward hooks (`ProfileCollector`), trace import and a Trainer
callback all feed it, so every profile is counted the same way. Memory is bounded: three `[E, E]`
matrices, `[E]` counts and a fixed-size token sample, however many tokens stream through.

Shape legend: T tokens in a batch, E routed experts, k experts per token, N sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..utils.checks import check_topk_ids

#: tokens per step inside `LayerAccumulator.update` (bounds temporary memory, not the result)
_CHUNK_TOKENS = 16384


@dataclass
class LayerRouting:
    """Routing statistics of one MoE layer.

    Attributes:
        coactivation: `[E, E]` int64, tokens whose top-k holds both i and j; symmetric, zero diagonal.
        expert_counts: `[E]` int64, tokens routed to each expert.
        token_count: tokens observed.
        logit_gram: `[E, E]` float64 Gram matrix of the router logits (sum over tokens of l l^T), or None.
        topk_sample: `[N, k]` int64 uniform sample of real per-token expert sets, or None (pair counts only).
    """

    coactivation: np.ndarray
    expert_counts: np.ndarray
    token_count: int
    logit_gram: np.ndarray | None = None
    topk_sample: np.ndarray | None = None


class ReservoirSample:
    """A uniform sample without replacement of at most `capacity` rows from a stream of `[T, k]` batches.

    Each streamed row draws a key uniform in [0, 1) from a generator seeded with `seed`; the sample
    holds the rows with the `capacity` smallest keys seen so far, which is a uniform sample of the
    stream. The same stream in the same order with the same seed gives the same sample, and two
    layers fed the same token stream with the same seed sample the same tokens. `capacity=None`
    keeps every row (used for trace files, whose tokens are all wanted).

    The rows stay on the device they arrive on; keys are drawn on the CPU (device-independent).
    """

    def __init__(self, capacity: int | None, seed: int = 0) -> None:
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"sample_size must be None (keep all) or an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._generator = torch.Generator().manual_seed(int(seed))
        self._keys_N: torch.Tensor | None = None  # float64
        self._order_N: torch.Tensor | None = None  # int64 stream position of each kept row
        self._rows_Nk: torch.Tensor | None = None
        self._seen = 0

    def add(self, rows_Tk: torch.Tensor) -> None:
        """Offer a batch of rows (in stream order) to the sample."""
        num_rows = rows_Tk.shape[0]
        order_T = torch.arange(self._seen, self._seen + num_rows, device=rows_Tk.device)
        self._seen += num_rows
        if self.capacity == 0 or num_rows == 0:
            return
        keys_T = torch.rand(num_rows, generator=self._generator, dtype=torch.float64).to(rows_Tk.device)
        if self._rows_Nk is None:
            keys_N, order_N, rows_Nk = keys_T, order_T, rows_Tk
        else:
            keys_N = torch.cat([self._keys_N, keys_T])
            order_N = torch.cat([self._order_N, order_T])
            rows_Nk = torch.cat([self._rows_Nk, rows_Tk.to(self._rows_Nk.device)])
        if self.capacity is not None and keys_N.shape[0] > self.capacity:
            keep_N = torch.topk(keys_N, self.capacity, largest=False, sorted=False).indices
            keys_N, order_N, rows_Nk = keys_N[keep_N], order_N[keep_N], rows_Nk[keep_N]
        self._keys_N, self._order_N, self._rows_Nk = keys_N, order_N, rows_Nk

    @property
    def rows_seen(self) -> int:
        return self._seen

    def rows(self) -> np.ndarray | None:
        """`[N, k]` int64 sampled rows in stream order, or None when the sample is empty."""
        if self._rows_Nk is None:
            return None
        order = torch.argsort(self._order_N)
        return self._rows_Nk[order].to("cpu", torch.int64).numpy()


class LayerAccumulator:
    """Routing statistics of one MoE layer, accumulated batch by batch.

    Args:
        num_experts: `E`.
        top_k: `k`.
        sample_size: size of the uniform token sample of top-k sets (0: none; None: keep all).
        seed: seed of the sample's random keys.
    """

    def __init__(self, num_experts: int, top_k: int, sample_size: int | None = 8192, seed: int = 0) -> None:
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], got {top_k!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.token_count = 0
        self.sample = ReservoirSample(sample_size, seed)
        self._pairs_EE: torch.Tensor | None = None  # int64, diagonal = per-expert counts
        self._gram_EE: torch.Tensor | None = None  # float64
        self._has_logits: bool | None = None

    @torch.no_grad()
    def update(
        self,
        topk_ids_Tk: torch.Tensor,
        logits_TE: torch.Tensor | None = None,
        token_mask_T: torch.Tensor | None = None,
    ) -> None:
        """Add one batch.

        Args:
            topk_ids_Tk: `[T, k]` integer expert ids in [0, E), distinct within a row (masked-out rows included).
                Checked when on the CPU (traces, tables built by hand); on an accelerator they are not, to keep
                the collector's hooks free of a host synchronisation (`_check_host_ids`).
            logits_TE: `[T, E]` router logits (any float dtype), or None when unknown (trace files).
                Give them for every batch or for none.
            token_mask_T: `[T]` bool, True for tokens to count (padding False), or None for all.
        """
        if topk_ids_Tk.dim() != 2 or topk_ids_Tk.shape[1] != self.top_k:
            raise ValueError(
                f"topk_ids must have shape [T, top_k={self.top_k}], got {tuple(topk_ids_Tk.shape)}"
            )
        has_logits = logits_TE is not None
        if self._has_logits is not None and has_logits != self._has_logits:
            raise ValueError("router logits must be given for every batch of a layer or for none")
        self._has_logits = has_logits
        if has_logits and tuple(logits_TE.shape) != (topk_ids_Tk.shape[0], self.num_experts):
            raise ValueError(
                f"logits must have shape [T={topk_ids_Tk.shape[0]}, E={self.num_experts}], got {tuple(logits_TE.shape)}"
            )
        if token_mask_T is not None and token_mask_T.shape != (topk_ids_Tk.shape[0],):
            raise ValueError(f"token mask must have shape [T={topk_ids_Tk.shape[0]}], got {tuple(token_mask_T.shape)}")
        topk_ids_Tk = topk_ids_Tk.detach().long()
        _check_host_ids(topk_ids_Tk, self.num_experts)
        if token_mask_T is not None:
            keep_T = token_mask_T.to(device=topk_ids_Tk.device, dtype=torch.bool)
            topk_ids_Tk = topk_ids_Tk[keep_T]
            logits_TE = logits_TE[keep_T.to(logits_TE.device)] if has_logits else None
        num_tokens = topk_ids_Tk.shape[0]
        device = topk_ids_Tk.device
        if self._pairs_EE is None:
            self._pairs_EE = torch.zeros(self.num_experts, self.num_experts, dtype=torch.int64, device=device)
        if has_logits and self._gram_EE is None:
            self._gram_EE = torch.zeros(self.num_experts, self.num_experts, dtype=torch.float64, device=device)
        # chunks bound the temporaries ([T, k, k] pair ids, [T, E] fp64 logits) for huge training batches
        for start in range(0, num_tokens, _CHUNK_TOKENS):
            ids_Tk = topk_ids_Tk[start : start + _CHUNK_TOKENS]
            # every ordered pair (i, j) of a token's experts, i == j included: the diagonal counts experts
            pair_ids = (ids_Tk[:, :, None] * self.num_experts + ids_Tk[:, None, :]).reshape(-1)
            pairs_EE = torch.bincount(pair_ids, minlength=self.num_experts**2).view(self.num_experts, self.num_experts)
            self._pairs_EE += pairs_EE.to(self._pairs_EE.device)
            if has_logits:
                chunk_TE = logits_TE[start : start + _CHUNK_TOKENS].detach().to(torch.float64)
                self._gram_EE += (chunk_TE.T @ chunk_TE).to(self._gram_EE.device)
        self.sample.add(topk_ids_Tk)
        self.token_count += num_tokens

    def expert_counts(self) -> np.ndarray:
        """`[E]` int64 tokens routed to each expert so far."""
        if self._pairs_EE is None:
            return np.zeros(self.num_experts, dtype=np.int64)
        return torch.diagonal(self._pairs_EE).cpu().numpy().copy()

    def coactivation(self) -> np.ndarray:
        """`[E, E]` int64 tokens whose top-k holds both i and j; symmetric, zero diagonal."""
        if self._pairs_EE is None:
            return np.zeros((self.num_experts, self.num_experts), dtype=np.int64)
        pairs = self._pairs_EE.cpu().numpy().copy()
        np.fill_diagonal(pairs, 0)
        return pairs

    def logit_gram(self) -> np.ndarray | None:
        """`[E, E]` float64 sum over counted tokens of `logits logits^T`, or None without logits."""
        return None if self._gram_EE is None else self._gram_EE.cpu().numpy().copy()

    def to_layer_routing(self) -> LayerRouting:
        """The statistics as a `LayerRouting` (a snapshot; accumulation may continue)."""
        return LayerRouting(
            coactivation=self.coactivation(),
            expert_counts=self.expert_counts(),
            token_count=self.token_count,
            logit_gram=self.logit_gram(),
            topk_sample=self.sample.rows(),
        )


def _check_host_ids(topk_ids_Tk: torch.Tensor, num_experts: int) -> None:
    """Refuse, as `check_topk_ids` does for files, a row that repeats an expert or an id outside [0, E) when the ids
    are on the CPU: counting would add a repeated expert's pairs to the diagonal (its count) and an id past E to
    another expert's pair, silently, or fail inside torch naming neither rule.

    Ids on an accelerator are left unchecked: `ProfileCollector` feeds `update` from its router hooks on every forward,
    and reading the ids on the host would add a device synchronisation per MoE layer per forward; those ids are the
    router's own top-k, distinct and in range by construction.
    """
    if topk_ids_Tk.device.type == "cpu":
        check_topk_ids(topk_ids_Tk.numpy(), num_experts)


#: the most tokens a profile layer may count (2^48, about 3e14): every count and every sum of E of them stays
#: far inside int64, so no statistic computed from a profile can overflow
MAX_PROFILE_TOKENS = 2**48


def check_layer_counts(layer: int, routing: LayerRouting, top_k: int) -> None:
    """The counts of one layer of a profile file or a pair-count trace agree with each other, as counting real top-k
    sets makes them: `token_count` in [1, `MAX_PROFILE_TOKENS`] (no maker leaves a layer without tokens, and no plan
    can be made on one), every count at most `token_count`, `sum(expert_counts) = top_k * token_count`, a symmetric
    co-activation with a zero diagonal whose rows sum to `expert_counts * (top_k - 1)`, and a top-k sample of at most
    `token_count` rows. Here, not in the profile module, so that the trace reader applies the same rules."""
    tokens, counts_E, coact_EE = routing.token_count, routing.expert_counts, routing.coactivation
    where = f"layer {layer}"
    if not 0 <= tokens <= MAX_PROFILE_TOKENS or tokens * top_k * top_k > MAX_PROFILE_TOKENS * 2**14:
        raise ValueError(f"{where}: token_count {tokens} is outside [0, 2^48] (with top_k^2 = {top_k * top_k}: 2^62)")
    if counts_E.size and (counts_E.max() > tokens or (coact_EE.size and coact_EE.max() > tokens)):
        raise ValueError(f"{where}: a count exceeds token_count={tokens} (no expert or pair is chosen by more tokens than exist)")
    if tokens == 0:
        raise ValueError(f"{where} counts no tokens")
    if int(counts_E.sum()) != top_k * tokens:
        raise ValueError(
            f"{where}: expert_counts sum to {int(counts_E.sum())}, but token_count={tokens} tokens with top_k={top_k} "
            f"make {top_k * tokens}"
        )
    if not (coact_EE == coact_EE.T).all() or np.diagonal(coact_EE).any():
        raise ValueError(f"{where}: coactivation must be symmetric with a zero diagonal")
    if not (coact_EE.sum(axis=1) == counts_E * (top_k - 1)).all():
        expert = int(np.flatnonzero(coact_EE.sum(axis=1) != counts_E * (top_k - 1))[0])
        raise ValueError(
            f"{where}: coactivation row {expert} sums to {int(coact_EE[expert].sum())}, but expert_counts[{expert}]="
            f"{int(counts_E[expert])} tokens with top_k={top_k} make {int(counts_E[expert]) * (top_k - 1)} pairs"
        )
    if routing.topk_sample is not None and len(routing.topk_sample) > tokens:
        raise ValueError(f"{where}: topk_sample holds {len(routing.topk_sample)} rows, more than token_count={tokens}")


def whole_counts(name: str, values: np.ndarray) -> np.ndarray:
    """`values` as int64 counts, or raise naming `name`: an integer array, or a float one holding only whole numbers
    (counts some tools save as floats), none negative (no count is) and none past `MAX_PROFILE_TOKENS`. A bare cast
    would truncate fractions (normalised frequencies would turn into zeros), make NaN INT64_MIN and wrap huge values."""
    values = np.asarray(values)
    if values.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integer counts, got dtype {values.dtype}")
    if values.dtype.kind == "f":
        if not np.isfinite(values).all():
            raise ValueError(f"{name} holds NaN or infinite values; counts are whole numbers")
        fractional = values != np.floor(values)
        if fractional.any():
            first = [int(i) for i in np.argwhere(fractional)[0]]
            raise ValueError(
                f"{name} must hold integer counts, got {values.dtype} with fractions (first: {values[tuple(first)]} "
                f"at {first}); counts are whole numbers (frequencies normalised to fractions are not counts)"
            )
    if values.size and values.min() < 0:
        raise ValueError(f"{name} holds a negative count ({values.min()}); counts are >= 0")
    if values.size and values.max() > MAX_PROFILE_TOKENS:
        raise ValueError(f"{name} holds a count past 2^48 ({values.max()}), more tokens than a profile layer may count")
    return values.astype(np.int64)


__all__ = ["MAX_PROFILE_TOKENS", "LayerAccumulator", "LayerRouting", "ReservoirSample", "check_layer_counts", "whole_counts"]
