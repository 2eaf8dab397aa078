"""Expert-parallel dispatch and combine: the only code that moves tokens between ranks (DESIGN.md §3).

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
- `auto`: the rule by which "auto" takes "padded" under torch.distributed (its padding estimated from the
  placement and k).

`OccultConfig.dispatcher` names the implementation ("auto": "padded" where `auto.AutoHints.prefers_padded`
says its padding is cheap, else the supported one of highest priority; chosen when `OccultMoE` is built and
again when it moves to another device, e.g. `.cuda()`).
A new implementation is a module here whose class is decorated with `register_dispatcher` and imported
below; "auto" prefers it where its `supports(ep, device)` is true and its `priority` is higher.
"""

from . import all_to_all, local, static  # noqa: F401  (register the implementations)
from .all_to_all import AllToAllDispatcher
from .auto import PADDED_MAX_OVERHEAD, AutoHints
from .base import (
    ExchangeError,
    DEFAULT_EXCHANGE_TIMEOUT_S,
    EXCHANGE_TIMEOUT_ENV,
    DispatchPlan,
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
from .local import LocalDispatcher
from ..replicas.routing import PIN_SLACK


def build_dispatcher(
    name: str,
    ep: ExpertParallelGroup,
    device_of_E,
    local_index_E,
    num_local_experts: int,
    mode: str = "dedup",
    chunks: int | None = None,
    timeout_s: float | None = None,
    layer: str = "layer",
    device=None,
    home_table_EM=None,
    slot_ED=None,
    replica_choice: str = "static",
    hints: AutoHints | None = None,
    pin_slack: float = PIN_SLACK,
) -> TokenDispatcher:
    """The dispatcher `name` ("auto" or a registered name) for one layer; see `TokenDispatcher` for the arguments,
    `auto.AutoHints` for `hints` (what "auto" weighs the padded exchange by; None: by priority alone)."""
    cls = dispatcher_class(name, ep, device, hints)
    return cls(
        ep, device_of_E, local_index_E, num_local_experts, mode=mode, chunks=chunks, timeout_s=timeout_s, layer=layer,
        home_table_EM=home_table_EM, slot_ED=slot_ED, replica_choice=replica_choice, pin_slack=pin_slack,
    )


__all__ = [
    "PADDED_MAX_OVERHEAD",
    "AutoHints",
    "DEFAULT_EXCHANGE_TIMEOUT_S",
    "EXCHANGE_TIMEOUT_ENV",
    "AllToAllDispatcher",
    "DispatchPlan",
    "Dispatched",
    "ExchangeError",
    "ExpertParallelGroup",
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
