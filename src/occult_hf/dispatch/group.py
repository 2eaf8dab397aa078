"""`ExpertParallelGroup`: the devices that hold a layer's experts (real ranks or logical devices), and their nodes.

A group may span nodes: `devices_per_node` G devices each, devices (group ranks) `n*G .. n*G + G - 1` on node n,
as torchrun numbers the ranks of `--nnodes` nodes of `--nproc-per-node` G. `resolve_devices_per_node` says which
layout a model runs with; `with_node_groups` makes the two families of subgroups the hierarchical exchange
(`dispatch.hierarchical`) moves rows in: each node's G ranks, and each *rail*, the ranks of one local index on
every node (the inter-node links of one GPU each).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from ..utils.checks import check_devices_per_node


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The devices that hold a layer's experts.

    Attributes:
        num_devices: `D`. With `group` set, the EP ranks (group rank d is device d); without, logical
            devices of a single process.
        group: the `torch.distributed` process group of the EP ranks, or None in one process.
        rank: this process's rank in `group` (0 in one process).
        host_group: a gloo group of the same ranks for host-to-host agreement without a device synchronisation
            (the static dispatchers' token count, `static.StaticDispatcher.group_tokens`), or None.
    """

    num_devices: int
    group: Any = None
    rank: int = 0
    host_group: Any = None
    devices_per_node: int | None = None
    node_group: Any = None
    rail_group: Any = None

    def __deepcopy__(self, memo) -> "ExpertParallelGroup":
        """Itself in one process (it is frozen). Under torch.distributed a copy of the model would share the process
        groups and the per-backward gradient-norm exchange of the original: an error naming what to do instead, not
        pickle's "cannot pickle 'ProcessGroup'" from deep inside."""
        if self.is_distributed:
            raise TypeError(
                f"copy.deepcopy of a model whose experts are spread over an expert-parallel group of {self.num_devices} "
                f"ranks is not supported: load a second model for a reference or EMA copy (from_pretrained(..., "
                f"occult_config=...)), or call occult_hf.unapply_occult first"
            )
        return self

    @property
    def is_distributed(self) -> bool:
        return self.group is not None

    @property
    def num_nodes(self) -> int:
        return 1 if self.devices_per_node is None else self.num_devices // self.devices_per_node

    @property
    def spans_nodes(self) -> bool:
        """Whether the ranks sit on several nodes and the node and rail groups exist (`with_node_groups`)."""
        return self.node_group is not None

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The world rank of each group rank, in group order (one process: the logical devices 0..D-1)."""
        if not self.is_distributed:
            return tuple(range(self.num_devices))
        return tuple(dist.get_global_rank(self.group, r) for r in range(self.num_devices))

    def with_node_groups(self, devices_per_node: int | None, every_group=None) -> "ExpertParallelGroup":
        """This group with its node layout; under torch.distributed, with `devices_per_node` < D, also its node and
        rail subgroups (collective: every rank of the world calls it, in the same order). One node: itself.

        `every_group`: the global ranks of every EP group of the world, this one among them, where the world holds
        several (transformers' `dp_replicate_size`): each rank makes every group's subgroups, as `new_group` is
        collective over the world, and keeps its own. None: this group is the only one."""
        if devices_per_node is None or devices_per_node >= self.num_devices:
            return self
        devices_per_node = check_devices_per_node(devices_per_node, self.num_devices, "OccultConfig.devices_per_node")
        if not self.is_distributed:
            return replace(self, devices_per_node=devices_per_node)
        size, nodes = devices_per_node, self.num_devices // devices_per_node
        groups = [list(self.global_ranks)] if every_group is None else [list(ranks) for ranks in every_group]
        node_group, _ = dist.new_subgroups_by_enumeration([ranks[n * size : (n + 1) * size] for ranks in groups for n in range(nodes)])
        rail_group, _ = dist.new_subgroups_by_enumeration([ranks[g::size] for ranks in groups for g in range(size)])
        return replace(self, devices_per_node=devices_per_node, node_group=node_group, rail_group=rail_group)

    @staticmethod
    def process_group(group=None):
        """`group`, else the default group when `torch.distributed` is initialised, else None."""
        if group is None and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return group

    @classmethod
    def resolve(cls, group=None, num_devices: int | None = None) -> "ExpertParallelGroup":
        """The EP group for a model: `group`, else the default group when `torch.distributed` is initialised.

        A group of size > 1 must have exactly `num_devices` ranks (None: take its size). Without a
        group, or with a group of one rank, the devices are logical: `num_devices` (None: 1).
        """
        group = cls.process_group(group)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if group is None and launched > 1:
            raise RuntimeError(
                f"this process was launched as one of WORLD_SIZE={launched} ranks but torch.distributed is not "
                f"initialised yet; call torch.distributed.init_process_group() before loading the model (or pass "
                f"group=) so that its experts are spread over the ranks"
            )
        size = dist.get_world_size(group) if group is not None else 1
        if size > 1:
            check_group_size(num_devices, size)
            return cls(num_devices=size, group=group, rank=dist.get_rank(group))
        return cls(num_devices=1 if num_devices is None else int(num_devices))


def check_group_size(num_devices: int | None, size: int, setting: str = "OccultConfig.num_devices", fix: str = "") -> None:
    """Under EP every rank of a group of `size` > 1 ranks holds the experts of one device: a device count `setting`
    other than `size` (None: take the group's) is an error, ending with `fix` (how to get past it)."""
    if size > 1 and num_devices not in (None, size):
        raise ValueError(
            f"{setting} ({num_devices}) must equal the expert-parallel group size ({size}): every rank of the group "
            f"holds the experts of one device{fix}"
        )


#: the launchers' variable for the processes of one node (torchrun's --nproc-per-node)
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


def resolve_devices_per_node(
    explicit: int | None, num_devices: int, distributed: bool, planned: int | None, ranks=None
) -> int | None:
    """The node layout a model runs with, None for one node: `OccultConfig.devices_per_node` when set (a warning
    when the launcher's `$LOCAL_WORLD_SIZE` says otherwise); under torch.distributed the layout `$LOCAL_WORLD_SIZE`
    gives the group's ranks (`_launch_layout`); else the placement's recorded layout (`planned`,
    `Placement.devices_per_node`; in one process the logical devices' nodes). A layout of fewer devices than
    `num_devices` must divide it; one of as many or more is one node. `ranks`: the group's global ranks in group order
    (`ExpertParallelGroup.global_ranks`; None: the world, 0..D-1)."""
    launched = _launched_per_node() if distributed else None
    ranks = range(num_devices) if ranks is None else ranks
    if explicit is not None:
        value, setting = explicit, "OccultConfig.devices_per_node"
        if launched is not None:
            _warn_if_not_launched_so(explicit, num_devices, launched, ranks)
    elif launched is not None:
        return _launch_layout(launched, ranks)
    else:
        value, setting = planned, "the placement's devices_per_node"
    if value is None or value >= num_devices:
        return None
    return check_devices_per_node(value, num_devices, setting)


def _launched_per_node() -> int | None:
    """`$LOCAL_WORLD_SIZE` as an integer, None where it is unset or empty; anything else is an error naming it (a
    value that is no number had been taken for one node, silently)."""
    text = os.environ.get(LOCAL_WORLD_SIZE_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${LOCAL_WORLD_SIZE_ENV}={os.environ[LOCAL_WORLD_SIZE_ENV]!r} is not an integer (the processes of one node)") from None


def _warn_if_not_launched_so(explicit: int, num_devices: int, launched: int, ranks) -> None:
    """Say when `OccultConfig.devices_per_node` describes other nodes than the launcher ran: it is used (it is how a
    user overrides the launch layout), but rows then cross the slow link where the plan thought they would not, and
    `max_nodes_per_token` limits other groups of devices than the machines."""
    try:
        launch = _launch_layout(launched, ranks)
    except ValueError:  # a launch layout occult cannot use: the explicit one is the way around it
        return
    if (None if explicit >= num_devices else explicit) != launch:
        warnings.warn(
            f"OccultConfig.devices_per_node={explicit} differs from the launch (${LOCAL_WORLD_SIZE_ENV}={launched}: "
            f"{'all' if launch is None else launch} of the group's {num_devices} ranks per node); the configured layout "
            f"is used",
            stacklevel=2,
        )


def _launch_layout(per_node_launched: int, ranks) -> int | None:
    """How many of a group's ranks share a node when the launcher ran `per_node_launched` processes on every node
    (`$LOCAL_WORLD_SIZE`; global rank g on node g // it), None when they all do. `ranks`: the group's global ranks in
    group order; they must sit on their nodes in equal, consecutive runs (torchrun's numbering gives that to the
    world, and to transformers' `ep` mesh dimension, whose ranks are consecutive)."""
    ranks = list(ranks)
    setting = f"${LOCAL_WORLD_SIZE_ENV}"
    if per_node_launched < 1:
        return check_devices_per_node(per_node_launched, len(ranks), setting)
    nodes = [rank // per_node_launched for rank in ranks]
    value = nodes.count(nodes[0])
    if value >= len(ranks):
        return None
    if value != per_node_launched:
        setting = f"the group's ranks on one node under ${LOCAL_WORLD_SIZE_ENV}={per_node_launched}"
    check_devices_per_node(value, len(ranks), setting)
    runs = [nodes[start : start + value] for start in range(0, len(ranks), value)]
    if any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
        raise ValueError(
            f"${LOCAL_WORLD_SIZE_ENV}={per_node_launched} puts the expert-parallel group's ranks (global ranks {ranks}) "
            f"on nodes {nodes}: the two-level exchange and max_nodes_per_token need as many of them on every node, "
            f"consecutive in group order; set OccultConfig.devices_per_node for another layout"
        )
    return value


__all__ = ["ExpertParallelGroup", "LOCAL_WORLD_SIZE_ENV", "check_devices_per_node", "resolve_devices_per_node"]
