"""`ExpertParallelGroup`: the devices that hold a layer's experts (real ranks or logical devices)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


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

    @property
    def is_distributed(self) -> bool:
        return self.group is not None

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
            if num_devices is not None and num_devices != size:
                raise ValueError(
                    f"OccultConfig.num_devices ({num_devices}) must equal the expert-parallel group size "
                    f"({size}): every rank of the group holds the experts of one device"
                )
            return cls(num_devices=size, group=group, rank=dist.get_rank(group))
        return cls(num_devices=1 if num_devices is None else int(num_devices))


__all__ = ["ExpertParallelGroup"]
