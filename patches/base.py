"""The contract every model-family adapter fulfils, and the registry that finds one for a model.

An adapter says, for one model family, where its MoE blocks are, how its router scores and
selects experts, how its expert weights are laid out and what its shared experts add. `OccultMoE`,
routing-profile collection and pruning read a model only through this interface, so that adding a
family means adding one file in `patches/` that registers an adapter instance (of an existing class,
such as `SoftmaxTopKAdapter`, or of a subclass of `MoEAdapter` it defines); `patches/__init__.py`
imports every module of the folder, so nothing else names the family (docs/models.md walks through it).

Shape legend: T tokens, H hidden, E routed experts, k experts per token, I expert width.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from occult_hf.registry import Registry


def config_field(config, name: str):
    """`config.<name>`, or an error naming the model type and the missing field (never a guess)."""
    if not hasattr(config, name):
        raise ValueError(f"{getattr(config, 'model_type', type(config).__name__)} config has no field {name!r}")
    return getattr(config, name)


@dataclass(frozen=True)
class RouterOutput:
    """What the model's own router decided for a batch of tokens.

    Attributes:
        logits_TE: `[T, E]` router logits (what transformers records as `router_logits`).
        topk_weights_Tk: `[T, k]` routing weights as the model applies them (after its normalisation
            and scaling).
        topk_ids_Tk: `[T, k]` int64 expert ids.
        aux_loss: the block-level auxiliary loss some families (DeepSeek-MoE) attach to
            their output in training, else None.
    """

    logits_TE: torch.Tensor
    topk_weights_Tk: torch.Tensor
    topk_ids_Tk: torch.Tensor
    aux_loss: torch.Tensor | None = None


class MoEAdapter(abc.ABC):
    """How one model family's MoE blocks work: the contract, with no behaviour of its own.

    An adapter is an instance: its names are constructor arguments, its behaviour the methods a
    subclass implements (`FusedExpertsAdapter` in `_transformers_moe.py` does so for transformers
    5's fused-experts layout). Families whose behaviour is the same share one class and differ only
    in the names they are built with. Only three things here are not abstract, because they follow
    from the names or from having nothing to add: `num_experts`/`top_k` (config fields),
    `iter_moe_blocks` (block class names), and the no-op `shared_output`/`attach_aux_loss` of a
    family without shared experts or block-level auxiliary loss.

    Args:
        name: registry key, lowercase (e.g. "olmoe").
        block_class_names: class names of the MoE blocks this adapter replaces.
        num_experts_field: the config field holding the number of routed experts
            (e.g. "num_experts", "n_routed_experts").
        top_k_field: the config field holding k, the experts per token.
        model_types: `config.model_type` values this adapter serves (default: `(name,)`).
    """

    def __init__(
        self,
        *,
        name: str,
        block_class_names: tuple[str, ...],
        num_experts_field: str,
        top_k_field: str = "num_experts_per_tok",
        model_types: tuple[str, ...] | None = None,
    ) -> None:
        self.name = name
        self.model_types = tuple(model_types) if model_types is not None else (name,)
        self.block_class_names = tuple(block_class_names)
        self.num_experts_field = num_experts_field
        self.top_k_field = top_k_field

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, model_types={self.model_types}, blocks={self.block_class_names})"

    # ----- model structure --------------------------------------------------------------
    def num_experts(self, config) -> int:
        return config_field(config, self.num_experts_field)

    def top_k(self, config) -> int:
        return config_field(config, self.top_k_field)

    def iter_moe_blocks(self, model: nn.Module) -> Iterator[tuple[int, str, nn.Module]]:
        """Yield `(decoder layer index, module path, block)` for every MoE block (dense layers skipped).

        In a model with occult_hf applied, an `OccultMoE` stands for the block it replaced: its
        `original_block` is yielded (the block this adapter routes with), under the OccultMoE's path.
        """
        for name, module in model.named_modules():
            block = getattr(module, "original_block", module)
            if type(block).__name__ in self.block_class_names:
                yield _layer_index(name), name, block

    @abc.abstractmethod
    def router(self, block: nn.Module) -> nn.Module:
        """The router module instance (kept as is so transformers' `router_logits` capture works)."""

    # ----- routing ----------------------------------------------------------------------
    def block_input(self, block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the block routes and computes its experts on, from its input (identity; Mixtral's training-time
        jitter noise scales it first, as the model's own block does)."""
        return hidden_states

    @abc.abstractmethod
    def route(self, block: nn.Module, x_TH: torch.Tensor) -> RouterOutput:
        """Run the block's own router module on `[T, H]` tokens (or the block's `[B, S, H]` input).

        Pass the block input's own shape where the router needs the sequence structure (DeepSeek-MoE's
        sequence-level auxiliary loss); `RouterOutput` tensors are always `[T, ...]`.
        """

    @abc.abstractmethod
    def select(self, block: nn.Module, logits_TE: torch.Tensor, allowed_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own top-k selection and weight rule, restricted to experts where `allowed_TE` is True.

        Returns `(topk_weights_Tk, topk_ids_Tk)`. With `allowed_TE` all True this equals `route`.
        Used by router-mode collaboration pruning.
        """

    @abc.abstractmethod
    def renormalize(self, block: nn.Module, logits_TE: torch.Tensor, topk_ids_Tk: torch.Tensor) -> torch.Tensor:
        """`[T, k]` routing weights for a given expert choice, by the model's own rule (similarity pruning)."""

    @abc.abstractmethod
    def observe(self, router: nn.Module, inputs: tuple, output) -> tuple[torch.Tensor, torch.Tensor]:
        """From a forward hook on `router`: `(logits_TE, topk_ids_Tk)` for routing-profile collection."""

    def attach_aux_loss(self, block: nn.Module, routed_TH: torch.Tensor, aux_loss: torch.Tensor | None) -> torch.Tensor:
        """Attach `RouterOutput.aux_loss` to the routed output as the model does (identity without one)."""
        if aux_loss is None:
            return routed_TH
        raise NotImplementedError(f"adapter {self.name!r} returned an aux_loss but does not say how to attach it")

    # ----- experts ----------------------------------------------------------------------
    @abc.abstractmethod
    def experts_module(self, block: nn.Module) -> nn.Module:
        """The submodule that holds the routed experts (what the runtime replaces by its local experts)."""

    @abc.abstractmethod
    def expert_weights(self, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """`(gate_up_proj [E, 2I, H], down_proj [E, H, I])` of the routed experts, original order."""

    @abc.abstractmethod
    def act_fn(self, block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The experts' activation (applied to the gate half of `gate_up_proj`'s output)."""

    @abc.abstractmethod
    def expert_state_dict(
        self, block: nn.Module, gate_up_proj_E2IH: torch.Tensor, down_proj_EHI: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The routed experts' entries of `block.state_dict()` (keys relative to the block) holding the
        given weights in the family's own layout: what a vanilla checkpoint stores for them."""

    def shared_output(self, block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor | None:
        """What the block's shared experts add for `[T, H]` tokens, as the model defines it; None if none."""
        return None


#: the model families (one adapter per `patches/<family>.py`), by adapter name
ADAPTERS: Registry[MoEAdapter] = Registry("model family adapter", "the adapter name")


def register_adapter(adapter: MoEAdapter) -> MoEAdapter:
    """Add an adapter to `ADAPTERS`; names are unique and lowercase, model types served once."""
    if not isinstance(adapter, MoEAdapter):
        raise TypeError(f"register_adapter needs a MoEAdapter instance, got {type(adapter).__name__}")
    for name, other in ADAPTERS.items():
        shared = sorted(set(other.model_types) & set(adapter.model_types))
        if shared and name != adapter.name:
            raise ValueError(f"adapter {adapter.name!r} serves model types {shared} that adapter {other.name!r} already serves")
    if not adapter.block_class_names or not adapter.num_experts_field:
        raise ValueError(f"adapter {adapter.name!r} needs block_class_names and num_experts_field")
    return ADAPTERS.register(adapter.name, adapter)


def registered_adapters() -> dict[str, MoEAdapter]:
    return dict(ADAPTERS.items())


def adapter_for(model_or_config) -> MoEAdapter:
    """The adapter serving a model (or its config), by `config.model_type`; a clear error otherwise."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    for _, adapter in ADAPTERS.items():
        if model_type in adapter.model_types:
            return adapter
    supported = sorted(t for _, a in ADAPTERS.items() for t in a.model_types)
    raise ValueError(f"occult_hf does not support model_type {model_type!r}; supported model types: {supported}")


def replace_recorded_router_logits(raw_logits_TE: torch.Tensor, aux_logits_TE: torch.Tensor) -> bool:
    """Swap `raw_logits_TE` for `aux_logits_TE` in transformers' `router_logits` record of this forward.

    transformers records `router_logits` with a forward hook on the router module into a per-forward
    collector; the auxiliary loss reads that record. Returns False only when a record is being made
    but does not hold `raw_logits_TE`; True when it was replaced or nothing records router logits.
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without the collector records nothing we could replace
        return True
    collected = _active_collector.get()
    if collected is None or "router_logits" not in collected:
        return True
    record = collected["router_logits"]
    for position in range(len(record) - 1, -1, -1):
        if record[position] is raw_logits_TE:
            record[position] = aux_logits_TE
            return True
    return False


def _layer_index(module_path: str) -> int:
    """The decoder-layer index in a path like `model.layers.3.mlp`."""
    parts = module_path.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    raise ValueError(f"cannot find a decoder-layer index in module path {module_path!r}")


__all__ = [
    "ADAPTERS",
    "MoEAdapter",
    "RouterOutput",
    "adapter_for",
    "config_field",
    "register_adapter",
    "registered_adapters",
    "replace_recorded_router_logits",
]
