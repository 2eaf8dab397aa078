"""Expert-parallel dispatch and combine: the only code that moves tokens between ranks (docs/design.md §3).

The other collectives (experts gathered for a save, the global gradient norm, the ranks' agreement
check, the callback's metric reductions) live in `collectives`, `checkpointing`, `agreement` and
`callback`.

- `plan`: the pure dispatch plan (the paper's BRIM): destinations, send order, per-row metadata,
  expert layout; no communication.
- `base`: the `TokenDispatcher` interface (`dispatch(x_TH, routing) -> Dispatched` with a frozen
  `DispatchPlan`; `combine(out_RH, plan) -> [T, H]`; `run()` around the local experts), the packed
  row format and the registry of implementations (unique lowercase names).
- `local` ("local"): one process, logical devices, no host synchronisation.
- `all_to_all` ("all_to_all"): all-to-all-v over `torch.distributed`: rows and metadata in one
  collective per direction and chunk, chunks overlapping the experts, bounded waits
  (`OccultConfig.exchange_timeout_s` / `$OCCULT_EXCHANGE_TIMEOUT_S`).
- `static` ("padded", "symm_mem"): static capacities, split sizes on the device: no host read.
- `hierarchical` ("hierarchical"): a group that spans nodes: one row per (token, node) over the inter-node link, then
  one per (token, device) inside the node, summed back on the device and on the node (the flat exchange's pieces
  over the `group.ExpertParallelGroup`'s rail and node subgroups).
- `auto`: the rule by which "auto" takes "padded" under torch.distributed (its padding estimated from the
  placement and k).

`OccultConfig.dispatcher` names the implementation ("auto": "hierarchical" where the group spans nodes, else "padded"
where `auto.AutoHints.prefers_padded` says its padding is cheap, else the supported one of highest priority; chosen when `OccultMoE` is built and
again when it moves to another device, e.g. `.cuda()`).
A new implementation is a module here whose class is decorated with `register_dispatcher` and imported
below; "auto" prefers it where its `supports(ep, device)` is true and its `priority` is higher.
"""

import functools

from . import all_to_all, hierarchical, local, static  # noqa: F401  (register the implementations)
from .all_to_all import AllToAllDispatcher
from .auto import PADDED_MAX_OVERHEAD, AutoHints
from .base import (
    ExchangeError,
    DEFAULT_EXCHANGE_TIMEOUT_S,
    EXCHANGE_TIMEOUT_ENV,
    DispatchPlan,
    DispatchSettings,
    Dispatched,
    RowFormat,
    TokenDispatcher,
    TokenRouting,
    DEFAULT_CHUNKS,
    dispatcher_class,
    dispatcher_names,
    register_dispatcher,
)
from .group import ExpertParallelGroup
from .hierarchical import HierarchicalDispatcher, HierarchicalPlan
from .local import LocalDispatcher
from ..layout import LayerLayout
from ..registry import DISPATCHERS
from ..utils.logging import get_logger


def build_dispatcher(
    settings: DispatchSettings, ep: ExpertParallelGroup, layout: LayerLayout, device=None, label: str | None = None
) -> TokenDispatcher:
    """The dispatcher `settings.dispatcher` names ("auto": chosen for `ep` on `device` with the layer's
    `DispatchSettings.hints`) for the layer of `layout`; `label` names the layer in errors (default "layer <index>")."""
    cls = dispatcher_class(settings.dispatcher, ep, device, settings.hints(layout))
    if ep.is_distributed and (settings.chunks or 1) > 1 and not cls.overlaps_chunks:
        _warn_chunks_unused(cls.name, settings.chunks)
    return cls(ep, layout, settings, label)


@functools.lru_cache(maxsize=None)
def _warn_chunks_unused(name: str, chunks: int) -> None:
    """Once per process and choice: "auto" took a dispatcher that runs one chunk, so `dispatch_chunks` is unused
    (a config that names such a dispatcher is refused by `OccultConfig` instead)."""
    get_logger(__name__).warning(
        f"OccultConfig.dispatch_chunks={chunks} is unused: dispatcher='auto' chose {name!r} for this group, which runs "
        f"one chunk (only {list(DISPATCHERS.names_with('overlaps_chunks'))} overlap chunks)"
    )


__all__ = [
    "PADDED_MAX_OVERHEAD",
    "AutoHints",
    "DEFAULT_EXCHANGE_TIMEOUT_S",
    "EXCHANGE_TIMEOUT_ENV",
    "AllToAllDispatcher",
    "DispatchPlan",
    "DispatchSettings",
    "Dispatched",
    "ExchangeError",
    "ExpertParallelGroup",
    "HierarchicalDispatcher",
    "HierarchicalPlan",
    "LocalDispatcher",
    "RowFormat",
    "TokenDispatcher",
    "TokenRouting",
    "build_dispatcher",
    "DEFAULT_CHUNKS",
    "dispatcher_class",
    "dispatcher_names",
    "register_dispatcher",
]
