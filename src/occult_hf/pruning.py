"""Collaboration pruning (docs/design.md §4): limit every token to at most `N_d` devices.

Shape legend: T tokens, E routed experts, k experts per token, D devices, M most homes of one expert; local to
this file: Q nodes (of `devices_per_node` devices each).

Pruning changes the model (fine-tune afterwards); `OccultMoE` calls the pruner right after the
model's own router and dispatches what it returns, so one process with `D` logical devices and an
EP group of `D` ranks prune identically (the pruner only sees the token's routing and the
placement, never the rank).

**A token's device set.** Its top-k experts are walked in descending routing weight (the weight the
model applies, `RouterOutput.topk_weights_Tk`; routers such as DeepSeek-V2's return their top-k
unsorted, so the order comes from the weights, not from the slot order) and their devices are
collected until `N_d` distinct devices are held. *Ties*: experts of equal weight are walked in
increasing device id, so when two devices compete for the last place the lower id wins. In
vectorised form: a device's score is the largest weight among the token's experts on it, and the
`N_d` best-scoring devices are kept, equal scores ordered by device id.

**Nodes** (`max_nodes_per_token`, DeepSeek-V3's node-limited routing for every family). With a node layout of
`G` devices per node (devices `n*G .. n*G + G - 1` form node n), a token may also be limited to `N_n` nodes: the
same walk over nodes (a node's score is the largest weight among the token's experts on it; ties to the lower
node id; with replicas an expert is served by a node holding any of its homes), and the token may then use
every device of its nodes. DeepSeek-V3 scores a node by the sum of its best `k / N_n` affinities instead; the walk
keeps one rule for devices and nodes (and a token whose top-k already spans at most `N_n` nodes keeps its routing).

**Both limits** compose: node pruning, then device pruning of its result. The device walk runs on the routing the
policy gives under the node limit alone (router: the model's top-k among the experts of the token's nodes, as
DeepSeek-V3 selects; similarity: the experts off those nodes replaced), k experts all on the token's nodes, so it
keeps taking devices until it holds all k or `N_d` devices: either way they hold at least k experts (any `N_d`
devices do, by the `N_d` check), and no token is left short. (Walking only the token's own experts left on its
nodes could stop at fewer than k: E=8 on 2 nodes of 2 devices, k=3, N_d=2, N_n=1, a token whose best node holds one
of its experts.) The policy then runs once on the router's own routing with those devices.

**Policies** (registry `occult_hf.registry.PRUNING_POLICIES`, lowercase names):

- ``router``: re-select the top-k among the experts on the token's devices with the model's own
  selection and weight rule (`MoEAdapter.select` with the mask; DeepSeek-V3's group limit and
  correction bias apply to the masked scores).
- ``similarity``: each selected expert outside the token's devices is replaced by the most similar
  (`S[l]`, cosine of router-logit columns from a routing profile) expert inside them that the token
  does not already use. Replacements are made in descending weight order (equal weights: lower slot
  first), so the heaviest dropped expert picks first; among equally similar candidates the lower
  expert id wins. The replacement *keeps the replaced expert's score*: it takes the dropped expert's
  router score in its slot. Every supported family computes a slot's weight from the k selected
  scores alone (softmax or sigmoid score, then optional `norm_topk_prob` normalisation over the k
  scores and `routed_scaling_factor`), so applying the model's rule to the kept scores gives back
  exactly the router's own weights: the weights are returned unchanged (and their gradient reaches
  the router through the dropped expert's logit, the logit that chose the slot).

Under both policies a token whose top-k already spans at most `N_d` devices keeps the router's own
ids and weights untouched (a DeepSeek-V3 group limit re-applied to masked scores could otherwise
move such a token), and `N_d >= min(k, D)` returns the router's outputs themselves.

**Auxiliary loss.** transformers' `load_balancing_loss_func` (OLMoE, Qwen2-MoE, Qwen3-MoE) recomputes
the top-k from the recorded `router_logits` (softmax, then top-k). So that it sees the routing
actually dispatched, the pruner replaces this layer's recorded logits, for the current forward only,
by *effective logits*: for every pruned token the logits of experts outside its devices are `-inf`
(router mode: softmax-then-top-k of them is exactly the re-selection), and in similarity mode each
replacement carries the logit of the expert it replaced (the kept score), so their top-k is exactly
the dispatched set. The expert-frequency term therefore counts dispatched experts and the
probability term is the router's distribution restricted to the token's devices; unpruned tokens
keep their raw logits. DeepSeek-MoE computes its balance loss from its own router's choice (the
adapter's `route`), before pruning: there it sees the unpruned top-k.

**Statistics.** Under `no_grad` and without host synchronisation each pruner accumulates the
fraction of routing weight that lay on experts outside the token's devices (what pruning removes or
hands to a replacement) and the number of pruned tokens; `pop_stats()` reads them, and `OccultCallback`
takes them on the device after each training step (`take_sums()`), so that evaluations in between do not count.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from typing import Callable

import torch

from occult_hf.dispatch import TokenRouting
from occult_hf.patches.base import MoEAdapter, RouterOutput, replace_recorded_router_logits

from .layout import LayerLayout
from .registry import PRUNING_POLICIES
from .utils.checks import check_devices_per_node

# ----- the device set of each token -----------------------------------------------------------


def token_device_sets(
    topk_ids_Tk: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    device_of_E: torch.Tensor,
    num_devices: int,
    max_devices_per_token: int,
    within_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, D]` bool: the devices each token may use, by the walk described in the module docstring.

    Args:
        topk_ids_Tk: `[T, k]` int64 expert ids chosen by the router (any slot order).
        topk_weights_Tk: `[T, k]` routing weights of those experts; the walk order is descending weight.
        device_of_E: `[E]` int64 device of every expert (same device as the ids).
        num_devices: `D`.
        max_devices_per_token: `N_d >= 1`.
        within_TD: `[T, D]` bool devices the walk may take (the devices of a token's nodes), None: all.

    A row holds at most `N_d` True entries, all among the devices of the token's own top-k experts (and
    `within_TD`). Called with nodes for devices (`device_of_E // G`, `D / G`) it is the node walk.
    """
    num_tokens = topk_ids_Tk.shape[0]
    device_Tk = device_of_E[topk_ids_Tk]
    weights_Tk = topk_weights_Tk.detach().float()
    if within_TD is not None:  # experts outside the token's nodes take no part in the walk
        weights_Tk = weights_Tk.masked_fill(~within_TD.gather(1, device_Tk), float("-inf"))
    # a device's score: the largest weight among the token's experts on it (-inf where it has none)
    score_TD = torch.full((num_tokens, num_devices), float("-inf"), dtype=torch.float32, device=topk_ids_Tk.device)
    score_TD.scatter_reduce_(1, device_Tk, weights_Tk, reduce="amax")
    used_TD = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=topk_ids_Tk.device)
    used_TD.scatter_(1, device_Tk, True)
    if within_TD is not None:
        used_TD &= within_TD
    # a stable descending sort keeps equal scores in increasing device id: the tie rule
    best_TD = torch.sort(score_TD, dim=1, descending=True, stable=True).indices
    keep_TD = torch.zeros_like(used_TD).scatter_(1, best_TD[:, :max_devices_per_token], True)
    return keep_TD & used_TD


def token_device_sets_replicated(
    topk_ids_Tk: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    home_table_EM: torch.Tensor,
    num_devices: int,
    max_devices_per_token: int,
    within_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, D]` bool: the devices each token may use when some experts have several homes (replicas).

    The same walk as `token_device_sets` (descending weight; equal weights in increasing id of the
    expert's lowest home), where an expert is already served when one of its homes is held. Otherwise,
    while fewer than `N_d` devices are held, one of its homes is added: a home on a device the token
    uses anyway (a device of one of its single-home experts, the best-scoring one), else its lowest
    home. Without replicas this is `token_device_sets`. A row holds at most `N_d` True entries, and
    every expert of the token with a home among them is served there (`replicas.resolve_homes` with
    these devices as `visited_TD`), so the token's CT is at most `N_d`.

    Args:
        topk_ids_Tk, topk_weights_Tk: as in `token_device_sets`.
        home_table_EM: `[E, M]` int64 homes of each expert, increasing, -1 padded (`Placement.home_table`).
        num_devices: `D`.
        max_devices_per_token: `N_d >= 1`.
        within_TD: `[T, D]` bool devices the walk may take (the devices of a token's nodes): homes elsewhere do not
            count, and an expert with none there is not served. None: all.
    """
    ids_Tk = topk_ids_Tk.long()
    num_tokens, top_k = ids_Tk.shape
    homes_TkM = home_table_EM[ids_Tk]
    held_TkM = homes_TkM >= 0
    if within_TD is not None:  # only the homes on the token's nodes, still increasing and first (an expert may have none)
        held_TkM = held_TkM & within_TD.gather(1, homes_TkM.clamp_min(0).flatten(1)).view(held_TkM.shape)
        homes_TkM = torch.sort(torch.where(held_TkM, homes_TkM, num_devices), dim=-1).values
        held_TkM = homes_TkM < num_devices
        homes_TkM = torch.where(held_TkM, homes_TkM, -1)
    first_Tk = homes_TkM[..., 0]
    single_Tk = held_TkM.sum(-1) == 1
    weights_Tk = topk_weights_Tk.detach().float()
    # devices the token uses anyway, scored by the largest weight of its single-home experts there
    score_TD = torch.full((num_tokens, num_devices + 1), float("-inf"), dtype=torch.float32, device=ids_Tk.device)
    score_TD.scatter_reduce_(1, torch.where(single_Tk, first_Tk, num_devices), weights_Tk, reduce="amax")
    score_TD = score_TD[:, :num_devices]
    # walk order: descending weight, equal weights in increasing lowest home (two stable sorts)
    by_device_Tk = torch.sort(first_Tk, dim=1, stable=True).indices
    by_weight_Tk = torch.sort(weights_Tk.gather(1, by_device_Tk), dim=1, descending=True, stable=True).indices
    order_Tk = by_device_Tk.gather(1, by_weight_Tk)
    chosen_TD = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=ids_Tk.device)
    count_T = torch.zeros(num_tokens, dtype=torch.int64, device=ids_Tk.device)
    rows_T = torch.arange(num_tokens, device=ids_Tk.device)
    for step in range(top_k):
        slot_T = order_Tk[:, step]
        homes_TM, held_TM = homes_TkM[rows_T, slot_T], held_TkM[rows_T, slot_T]
        served_T = (chosen_TD.gather(1, homes_TM.clamp_min(0)) & held_TM).any(1)
        score_TM = score_TD.gather(1, homes_TM.clamp_min(0)).masked_fill(~held_TM, float("-inf"))
        best_T = score_TM.max(1)
        pick_T = torch.where(best_T.values > float("-inf"), homes_TM.gather(1, best_T.indices[:, None])[:, 0], homes_TM[:, 0])
        add_T = ~served_T & (count_T < max_devices_per_token) & held_TM.any(1)
        chosen_TD |= torch.nn.functional.one_hot(pick_T.clamp_min(0), num_devices).bool() & add_T[:, None]
        count_T += add_T
    return chosen_TD


def allowed_experts(devices_TD: torch.Tensor, home_table_EM: torch.Tensor) -> torch.Tensor:
    """`[T, E]` bool: experts with a home on one of each token's devices (`home_table_EM` `[E, M]`, -1 padded)."""
    held_EM = home_table_EM >= 0
    return (devices_TD[:, home_table_EM.clamp_min(0)] & held_EM).any(-1)


# ----- policies ----------------------------------------------------------------------------------


def prune_router(
    adapter: MoEAdapter,
    block: torch.nn.Module,
    routing: RouterOutput,
    allowed_TE: torch.Tensor,
    similarity_EE: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-select with the model's own rule among the allowed experts.

    Returns `(topk_weights_Tk, topk_ids_Tk, aux_logits_TE)`; `aux_logits_TE` are the effective logits
    the auxiliary loss sees (see the module docstring).
    """
    weights_Tk, ids_Tk = adapter.select(block, routing.logits_TE, allowed_TE)
    fits_T = allowed_TE.gather(1, routing.topk_ids_Tk).all(dim=1)
    weights_Tk = torch.where(fits_T[:, None], routing.topk_weights_Tk, weights_Tk.to(routing.topk_weights_Tk.dtype))
    ids_Tk = torch.where(fits_T[:, None], routing.topk_ids_Tk, ids_Tk.to(routing.topk_ids_Tk.dtype))
    aux_logits_TE = routing.logits_TE.masked_fill(~(allowed_TE | fits_T[:, None]), float("-inf"))
    return weights_Tk, ids_Tk, aux_logits_TE


def prune_similarity(
    adapter: MoEAdapter,
    block: torch.nn.Module,
    routing: RouterOutput,
    allowed_TE: torch.Tensor,
    similarity_EE: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replace every expert outside the token's devices by its most similar unused expert inside them.

    Returns `(topk_weights_Tk, topk_ids_Tk, aux_logits_TE)`; the weights are the router's own (the
    replacement keeps the replaced expert's score).
    """
    ids_Tk = routing.topk_ids_Tk
    num_tokens, top_k = ids_Tk.shape
    inside_Tk = allowed_TE.gather(1, ids_Tk)
    # candidates: allowed experts the token does not use yet
    candidate_TE = allowed_TE.clone()
    candidate_TE.scatter_(1, ids_Tk, False)
    # slots in descending weight; a stable sort keeps equal weights in slot order
    slot_order_Tk = torch.sort(routing.topk_weights_Tk.detach(), dim=1, descending=True, stable=True).indices
    new_ids_Tk = ids_Tk.clone()
    rows_T = torch.arange(num_tokens, device=ids_Tk.device)
    for rank in range(top_k):
        slot_T = slot_order_Tk[:, rank]
        expert_T = ids_Tk[rows_T, slot_T]
        outside_T = ~inside_Tk[rows_T, slot_T]
        similarity_TE = similarity_EE[expert_T].masked_fill(~candidate_TE, float("-inf"))
        replacement_T = similarity_TE.argmax(dim=1)  # first maximum: the lower expert id wins ties
        new_ids_Tk[rows_T, slot_T] = torch.where(outside_T, replacement_T, expert_T)
        candidate_TE[rows_T, replacement_T] &= ~outside_T
    # the replacement carries the replaced expert's logit (its kept score) for the auxiliary loss
    fits_T = inside_Tk.all(dim=1)
    aux_logits_TE = routing.logits_TE.masked_fill(~(allowed_TE | fits_T[:, None]), float("-inf"))
    aux_logits_TE = aux_logits_TE.scatter(1, new_ids_Tk, routing.logits_TE.gather(1, ids_Tk))
    return routing.topk_weights_Tk, new_ids_Tk, aux_logits_TE


PruningPolicy = Callable[
    [MoEAdapter, torch.nn.Module, RouterOutput, torch.Tensor, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor, torch.Tensor]",
]

def register_pruning_policy(name: str, policy: PruningPolicy, needs_similarity: bool = False) -> PruningPolicy:
    """Register `policy` under `name` in `occult_hf.registry.PRUNING_POLICIES`; `needs_similarity`: it reads `S[l]`
    (so `OccultConfig.profile` is required)."""
    return PRUNING_POLICIES.register(name, policy, needs_similarity=needs_similarity)


def pruning_policy_names() -> tuple[str, ...]:
    """The registered pruning policies (what `OccultConfig.prune` accepts besides None)."""
    return PRUNING_POLICIES.names()


def needs_similarity(name: str) -> bool:
    """Whether policy `name` reads the similarity table of a routing profile."""
    return bool(PRUNING_POLICIES.trait(name, "needs_similarity"))


register_pruning_policy("router", prune_router)
register_pruning_policy("similarity", prune_similarity, needs_similarity=True)


# ----- the pruner OccultMoE calls --------------------------------------------------------------


class CollaborationPruner:
    """Prunes one MoE layer's routing to at most `max_devices_per_token` devices (and `max_nodes_per_token` nodes)
    per token.

    `pruner.route(block, router_output) -> TokenRouting`. `max_devices_per_token` and `max_nodes_per_token` may be
    changed between steps (the `OccultCallback` schedule does); `N_d >= min(k, D)` and `N_n >= min(k, nodes)` (or
    None) switch pruning off (the router's outputs are returned as they are).

    Args:
        policy: a registered pruning policy (`pruning_policy_names()`).
        adapter: the model family's adapter.
        layout: the layer's `LayerLayout` (its devices; with replicated experts the device walk counts an
            expert as served by any of its homes, `token_device_sets_replicated`, and `route` returns the
            token's devices so that the dispatch keeps every pair on them).
        top_k: `k`, experts per token.
        max_devices_per_token: `N_d` (None: no device limit, only the node limit).
        similarity_EE: `[E, E]` similarity table, required by policies that need one (`needs_similarity`).
        max_nodes_per_token: `N_n` (None: no node limit); needs `devices_per_node`.
        devices_per_node: `G`, devices per node of the group (devices `n*G .. n*G + G - 1` are node n), or None.
    """

    def __init__(
        self,
        policy: str,
        adapter: MoEAdapter,
        layout: LayerLayout,
        top_k: int,
        max_devices_per_token: int | None,
        similarity_EE: torch.Tensor | None = None,
        max_nodes_per_token: int | None = None,
        devices_per_node: int | None = None,
    ) -> None:
        self.policy_name = policy
        self._policy = PRUNING_POLICIES.get(policy)
        self.adapter = adapter
        self.layout = layout
        num_experts = layout.num_experts
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an integer in [1, E={num_experts}], got {top_k!r}")
        self.top_k = top_k
        if needs_similarity(policy):
            if similarity_EE is None:
                raise ValueError(
                    f"pruning policy {policy!r} needs a similarity table: set OccultConfig.profile to a routing "
                    f"profile collected from this model (`occult profile`)"
                )
            if tuple(similarity_EE.shape) != (num_experts, num_experts):
                raise ValueError(
                    f"layer {layout.layer}: similarity table has shape {tuple(similarity_EE.shape)}, "
                    f"expected [{num_experts}, {num_experts}]"
                )
            # an undefined similarity (NaN) ranks below every real one but stays a valid candidate
            similarity_EE = torch.nan_to_num(torch.as_tensor(similarity_EE, dtype=torch.float32), nan=-2.0)
        self.similarity_EE = similarity_EE
        # the N_d smallest primary capacities bound the experts any N_d devices hold from below, and so does the
        # fewest experts one device holds with its replicas (`_fewest_held`)
        capacity_D = torch.bincount(layout.device_of_E.cpu(), minlength=layout.num_devices)
        self._capacity_sorted_D = torch.sort(capacity_D).values
        self._fewest_held_D = _fewest_held(layout.home_table_EM, layout.num_devices)
        self.devices_per_node = devices_per_node
        if devices_per_node is not None:
            check_devices_per_node(devices_per_node, layout.num_devices)
            self._capacity_sorted_Q = torch.sort(capacity_D.view(-1, devices_per_node).sum(1)).values
            self._node_homes_EM = None if not layout.replicated else _node_home_table(layout.home_table_EM.cpu(), devices_per_node)
            self._fewest_held_Q = _fewest_held(self._node_homes_EM, layout.num_devices // devices_per_node)
        self.max_devices_per_token = max_devices_per_token
        self.max_nodes_per_token = max_nodes_per_token
        self._sums_3 = None  # float64 [3]: tokens, removed weight fraction summed over tokens, pruned tokens
        self._warned_recording = False

    @property
    def layer_idx(self) -> int:
        return self.layout.layer

    @property
    def num_devices(self) -> int:
        return self.layout.num_devices

    # ----- N_d ------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return 1 if self.devices_per_node is None else self.num_devices // self.devices_per_node

    @property
    def max_devices_per_token(self) -> int | None:
        return self._max_devices_per_token

    @max_devices_per_token.setter
    def max_devices_per_token(self, value: int | None) -> None:
        self._max_devices_per_token = self._checked_limit(
            value, "max_devices_per_token", "N_d", "devices", self._capacity_sorted_D, self._fewest_held_D
        )

    @property
    def max_nodes_per_token(self) -> int | None:
        return self._max_nodes_per_token

    @max_nodes_per_token.setter
    def max_nodes_per_token(self, value: int | None) -> None:
        if value is not None and self.devices_per_node is None:
            raise ValueError(
                f"max_nodes_per_token={value!r} needs a node layout: set OccultConfig.devices_per_node, launch on several "
                f"nodes (LOCAL_WORLD_SIZE < the group size), or plan the placement with devices_per_node"
            )
        self._max_nodes_per_token = None if value is None else self._checked_limit(
            value, "max_nodes_per_token", "N_n", "nodes", self._capacity_sorted_Q, self._fewest_held_Q
        )

    def _checked_limit(self, value, setting: str, symbol: str, unit: str, capacity_sorted, fewest_held: int) -> int | None:
        """`value` (None: no limit) if it is an integer in [1, units] that leaves every token at least top_k experts:
        any `value` units hold at least the sum of the `value` smallest primary capacities and at least the
        `fewest_held` experts the emptiest unit holds with its replicas."""
        if value is None:
            return None
        units = len(capacity_sorted)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= units:
            raise ValueError(f"{setting} ({symbol}) must be an integer in [1, num_{unit}={units}], got {value!r}")
        fewest_experts = max(int(capacity_sorted[:value].sum()), fewest_held)
        if value < min(self.top_k, units) and fewest_experts < self.top_k:
            replicas = f"; with its replicas the emptiest holds {fewest_held}" if fewest_held else ""
            raise ValueError(
                f"{setting} ({symbol}={value}) leaves some tokens of layer {self.layer_idx} only {fewest_experts} experts "
                f"(the {value} smallest {unit} of the placement hold {capacity_sorted[:value].tolist()} primary experts"
                f"{replicas}), fewer than top_k={self.top_k}; use {symbol} with at least top_k experts on any {symbol} {unit}"
            )
        return value

    @property
    def _devices_active(self) -> bool:
        return self._max_devices_per_token is not None and self._max_devices_per_token < min(self.top_k, self.num_devices)

    @property
    def _nodes_active(self) -> bool:
        return self._max_nodes_per_token is not None and self._max_nodes_per_token < min(self.top_k, self.num_nodes)

    @property
    def active(self) -> bool:
        """False when `N_d >= min(k, D)` and `N_n >= min(k, nodes)` (or unset): no token can span more, nothing is
        pruned."""
        return self._devices_active or self._nodes_active

    # ----- forward ------------------------------------------------------------------------------
    def route(self, block: torch.nn.Module, routing: RouterOutput) -> TokenRouting:
        """The `TokenRouting` to dispatch: ids and weights of at most `N_d` devices per token, and with replicated
        experts (while pruning is active) `devices_TD`, each token's devices, on which the dispatch keeps its pairs."""
        if routing.topk_ids_Tk.shape[1] != self.top_k:
            raise ValueError(
                f"layer {self.layer_idx}: the router chose {routing.topk_ids_Tk.shape[1]} experts per token but the "
                f"pruner was built for top_k={self.top_k}"
            )
        if not self.active:
            self._record(routing, None)
            return TokenRouting(routing.topk_ids_Tk, routing.topk_weights_Tk)
        layout = self.layout.to(routing.topk_ids_Tk.device)
        if self.similarity_EE is not None and self.similarity_EE.device != routing.logits_TE.device:
            self.similarity_EE = self.similarity_EE.to(routing.logits_TE.device)
        devices_TD = self._token_devices(block, routing, layout)
        allowed_TE = _experts_on(devices_TD, layout)
        weights_Tk, ids_Tk, aux_logits_TE = self._policy(self.adapter, block, routing, allowed_TE, self.similarity_EE)
        self._record(routing, allowed_TE)
        self._record_aux_logits(routing, aux_logits_TE)
        return TokenRouting(ids_Tk, weights_Tk, devices_TD if layout.replicated else None)

    def _token_devices(self, block: torch.nn.Module, routing: RouterOutput, layout: LayerLayout) -> torch.Tensor:
        """`[T, D]` bool the devices each token may use: the node walk (nodes as devices, every device of a chosen
        node); with a device limit too, the device walk on the routing the policy gives under the node limit alone,
        which holds k experts on the token's nodes (module docstring)."""
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        within_TD = None
        if self._nodes_active:
            per_node, num_nodes = self.devices_per_node, self.num_nodes
            if not layout.replicated:
                nodes_TQ = token_device_sets(ids_Tk, weights_Tk, layout.device_of_E // per_node, num_nodes, self._max_nodes_per_token)
            else:
                if self._node_homes_EM.device != ids_Tk.device:
                    self._node_homes_EM = self._node_homes_EM.to(ids_Tk.device)
                nodes_TQ = token_device_sets_replicated(ids_Tk, weights_Tk, self._node_homes_EM, num_nodes, self._max_nodes_per_token)
            within_TD = nodes_TQ.repeat_interleave(per_node, dim=1)
            if not self._devices_active:
                return within_TD
            with torch.no_grad():  # only its ids and weights' order are read
                weights_Tk, ids_Tk, _ = self._policy(self.adapter, block, routing, _experts_on(within_TD, layout), self.similarity_EE)
        if not layout.replicated:
            return token_device_sets(ids_Tk, weights_Tk, layout.device_of_E, self.num_devices, self._max_devices_per_token, within_TD)
        return token_device_sets_replicated(
            ids_Tk, weights_Tk, layout.home_table_EM, self.num_devices, self._max_devices_per_token, within_TD
        )

    @torch.no_grad()
    def _record(self, routing: RouterOutput, allowed_TE: torch.Tensor | None) -> None:
        """Add this forward's tokens, removed routing weight and pruned tokens to `_sums_3` (no host read)."""
        ids_Tk = routing.topk_ids_Tk
        if self._sums_3 is None or self._sums_3.device != ids_Tk.device:
            self._sums_3 = torch.zeros(3, dtype=torch.float64, device=ids_Tk.device)
        if allowed_TE is None:
            self._sums_3[0] += ids_Tk.shape[0]
            return
        weights_Tk = routing.topk_weights_Tk.detach().double()
        outside_Tk = ~allowed_TE.gather(1, ids_Tk)
        removed_T = (weights_Tk * outside_Tk).sum(1) / weights_Tk.sum(1).clamp_min(torch.finfo(torch.float64).tiny)
        tokens = torch.ones_like(removed_T).sum()  # not new_tensor(T): a traced T would be fixed at its traced value
        self._sums_3 += torch.stack([tokens, removed_T.sum(), outside_Tk.any(1).sum().double()])

    def _record_aux_logits(self, routing: RouterOutput, aux_logits_TE: torch.Tensor) -> None:
        if not replace_recorded_router_logits(routing.logits_TE, aux_logits_TE) and not self._warned_recording:
            self._warned_recording = True
            warnings.warn(
                f"layer {self.layer_idx}: transformers is recording router_logits but not the tensor the adapter "
                f"{self.adapter.name!r} returned as RouterOutput.logits_TE, so the auxiliary loss sees unpruned routing",
                stacklevel=3,
            )

    def take_sums(self) -> torch.Tensor | None:
        """`[3]` float64 on the forwards' device, since the last take: tokens routed, their summed fractions of routing
        weight removed, tokens that lost an expert (None: no forward); then reset. No host read."""
        sums, self._sums_3 = self._sums_3, None
        return sums

    def pop_stats(self) -> dict[str, float]:
        """Statistics since the last call, then reset (reads device tensors: call at logging time).

        `tokens`: tokens routed; `removed_weight_fraction`: mean over tokens of the fraction of routing
        weight on experts outside the token's devices; `pruned_token_fraction`: tokens that lost an expert.
        """
        sums = self.take_sums()
        tokens, removed, pruned = (0.0, 0.0, 0.0) if sums is None else sums.tolist()
        return {
            "tokens": int(tokens),
            "removed_weight_fraction": removed / tokens if tokens else 0.0,
            "pruned_token_fraction": pruned / tokens if tokens else 0.0,
        }

    def __repr__(self) -> str:
        nodes = "" if self.devices_per_node is None else f", max_nodes_per_token={self._max_nodes_per_token}, devices_per_node={self.devices_per_node}"
        return (
            f"CollaborationPruner(policy={self.policy_name!r}, layer={self.layer_idx}, "
            f"max_devices_per_token={self._max_devices_per_token}{nodes}, num_devices={self.num_devices}, top_k={self.top_k})"
        )


def _experts_on(devices_TD: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """`[T, E]` bool: the experts with a home on one of each token's devices."""
    if not layout.replicated:
        return devices_TD.index_select(1, layout.device_of_E)
    return allowed_experts(devices_TD, layout.home_table_EM)


def _fewest_held(homes_EM: torch.Tensor | None, units: int) -> int:
    """The fewest distinct experts any one unit (device or node) holds, replicas included, from the `[E, M]` table of
    each expert's distinct homes (-1 padded); 0 without replicas (the primary capacities say it then)."""
    if homes_EM is None:
        return 0
    homes_EM = homes_EM.cpu()
    return int(torch.bincount(homes_EM[homes_EM >= 0], minlength=units).min())


def _node_home_table(home_table_EM: torch.Tensor, devices_per_node: int) -> torch.Tensor:
    """`[E, M]` int64 the distinct nodes holding each expert's homes, increasing, -1 padded (nodes as devices for the
    replicated walk)."""
    node_EM = torch.where(home_table_EM >= 0, home_table_EM // devices_per_node, -1)
    node_EM = torch.sort(torch.where(node_EM >= 0, node_EM, torch.iinfo(torch.int64).max), dim=1).values
    repeated_EM = torch.cat([torch.zeros_like(node_EM[:, :1], dtype=torch.bool), node_EM[:, 1:] == node_EM[:, :-1]], dim=1)
    node_EM = torch.where(repeated_EM | (node_EM == torch.iinfo(torch.int64).max), torch.iinfo(torch.int64).max, node_EM)
    node_EM = torch.sort(node_EM, dim=1).values
    return torch.where(node_EM == torch.iinfo(torch.int64).max, -1, node_EM)


# ----- construction from an OccultConfig ----------------------------------------------------------


def build_pruner(
    occult_config, adapter: MoEAdapter, layout: LayerLayout, *, top_k: int, profile=None
) -> CollaborationPruner | None:
    """The pruner of one MoE layer, or None when `occult_config.prune` is None (exact mode).

    Args:
        occult_config: the `OccultConfig` (`prune`, `max_devices_per_token`, `profile`).
        adapter: the family adapter.
        layout: the layer's `LayerLayout` (the placement the dispatch uses).
        top_k: `k` of the model.
        profile: a loaded `RoutingProfile` to take the similarity table from (a model's layers share the one
            `build_pruners` loads); None loads `occult_config.profile` (`load_pruning_profile`: a copy of the file
            read once).
    """
    if occult_config.prune is None:
        return None
    similarity_EE = None
    if needs_similarity(occult_config.prune):
        if profile is None:  # OccultConfig checked that a policy needing it names one
            profile = load_pruning_profile(occult_config.profile)
        check_profile_for_pruning(profile, adapter, layout.layer, num_experts=layout.num_experts, top_k=top_k)
        similarity_EE = torch.as_tensor(profile.similarity(layout.layer), dtype=torch.float32)
    return CollaborationPruner(
        occult_config.prune, adapter, layout, top_k, occult_config.max_devices_per_token, similarity_EE,
        max_nodes_per_token=occult_config.max_nodes_per_token, devices_per_node=occult_config.devices_per_node,
    )  # fmt: skip


def check_profile_for_pruning(profile, adapter: MoEAdapter, layer_idx: int, num_experts: int, top_k: int) -> None:
    """Raise a clear error when `profile` cannot give layer `layer_idx`'s similarity table for this model."""
    source = profile.meta.get("source")
    if profile.model_type is not None and adapter.model_types and profile.model_type not in adapter.model_types:
        raise ValueError(
            f"routing profile (source {source!r}) is from model_type {profile.model_type!r} but the model is served by "
            f"adapter {adapter.name!r} (model types {list(adapter.model_types)})"
        )
    if profile.num_experts != num_experts:
        raise ValueError(
            f"routing profile (source {source!r}) is for num_experts={profile.num_experts} but the model has "
            f"{num_experts} routed experts at layer {layer_idx}"
        )
    if profile.top_k != top_k:
        raise ValueError(
            f"routing profile (source {source!r}) is for top_k={profile.top_k} but the model routes each token to "
            f"top_k={top_k} experts"
        )
    if layer_idx not in profile.layers:
        raise ValueError(
            f"routing profile (source {source!r}) has no MoE layer {layer_idx}; it covers layers {sorted(profile.layers)}"
        )


def load_pruning_profile(path: str | os.PathLike):
    """A routing profile read once per file version, handed out as a copy of its own: the caller (a model, whose
    layers' pruners share it, and which bundles it into its checkpoints) may change it without changing what a
    later model loaded from the same file sees."""
    path = os.path.realpath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"OccultConfig.profile {path!r} is not a file")
    stat = os.stat(path)
    return copy.deepcopy(_load_profile_cached(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _load_profile_cached(path: str, mtime_ns: int, size: int):
    from occult_hf.profile import RoutingProfile

    return RoutingProfile.load(path)


def pruners_of(model: torch.nn.Module) -> dict[int, CollaborationPruner]:
    """Decoder-layer index -> the `CollaborationPruner` of every pruned MoE block of `model`: an `OccultMoE`'s, or the
    one `apply_occult_ep` puts on a transformers block it prunes."""
    found = {}
    for module in model.modules():
        pruner = getattr(module, "pruner", None)
        if isinstance(pruner, CollaborationPruner):
            found[pruner.layer_idx] = pruner
    return found


__all__ = [
    "CollaborationPruner",
    "build_pruner",
    "check_profile_for_pruning",
    "load_pruning_profile",
    "pruners_of",
    "needs_similarity",
    "pruning_policy_names",
    "register_pruning_policy",
    "token_device_sets",
    "token_device_sets_replicated",
]
