"""The methods the cost model compares, by name.

`<dispatch>+<placement>[+Nd=<n>][+Nn=<n>]` (as `occult bench ep` names its modes), or a baseline:

| part | values |
|---|---|
| dispatch | `per_expert` (one row per (token, expert): Tutel / Megatron / MegaBlocks), `dedup` (one per (token, device), flat), `hierarchical` (one per (token, node) across nodes, then per (token, device) inside the node) |
| placement | `contiguous`, `occult` (the paper's Algorithm 1), `refined`, `node_refined` (`refined` with `devices_per_node=G`: nodes per token first, then devices) |
| `Nd=<n>`, `Nn=<n>` | collaboration pruning to n devices / n nodes per token (`max_devices_per_token`, `max_nodes_per_token`) |
| baselines | `transformers_ep` (transformers' own EP, `ep_implementation="all_to_all"`: per-expert rows, contiguous experts), `fsdp2` (no EP: every GPU computes all experts on its tokens, the parameters gathered) |
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .traffic import DISPATCHES

PLACEMENTS = ("contiguous", "occult", "refined", "node_refined")
BASELINES = ("transformers_ep", "fsdp2")
_LIMIT = re.compile(r"^(Nd|Nn)=(\d+)$")

#: the projection's default set: the baselines, each dispatch, each placement, node-limited pruning
DEFAULT_METHODS = (
    "transformers_ep", "fsdp2", "per_expert+contiguous", "dedup+contiguous", "dedup+occult", "dedup+refined",
    "dedup+node_refined", "dedup+refined+Nd=4", "hierarchical+contiguous", "hierarchical+node_refined", "hierarchical+node_refined+Nn=4",
    "hierarchical+node_refined+Nn=2",
)  # fmt: skip


@dataclass(frozen=True)
class Method:
    """A parsed method name (module docstring); `dispatch` and `placement` are None for `fsdp2`."""

    name: str
    dispatch: str | None
    placement: str | None
    max_devices_per_token: int | None = None
    max_nodes_per_token: int | None = None

    @property
    def family(self) -> str:
        """Whose dispatcher and kernels run it: "transformers" or "occult"."""
        return "transformers" if self.name == "transformers_ep" else "occult"


def parse_method(name: str) -> Method:
    """The `Method` of `name`; a bad name is an error that says which part is wrong and what is valid."""
    if name == "transformers_ep":
        return Method(name, "per_expert", "contiguous")
    if name == "fsdp2":
        return Method(name, None, None)
    parts = name.split("+")
    usage = f"method {name!r}: expected <dispatch>+<placement>[+Nd=<n>][+Nn=<n>] or one of {', '.join(BASELINES)}"
    if len(parts) < 2:
        raise ValueError(usage)
    dispatch, placement, *limits = parts
    if dispatch not in DISPATCHES:
        raise ValueError(f"{usage}; dispatch {dispatch!r} is not one of {', '.join(DISPATCHES)}")
    if placement not in PLACEMENTS:
        raise ValueError(f"{usage}; placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    found: dict[str, int] = {}
    for limit in limits:
        match = _LIMIT.match(limit)
        if match is None or match.group(1) in found or int(match.group(2)) < 1:
            raise ValueError(f"{usage}; {limit!r} is not Nd=<n> or Nn=<n> with n >= 1 (each at most once)")
        found[match.group(1)] = int(match.group(2))
    return Method(name, dispatch, placement, found.get("Nd"), found.get("Nn"))


__all__ = ["BASELINES", "DEFAULT_METHODS", "Method", "PLACEMENTS", "parse_method"]
