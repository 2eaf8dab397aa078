"""`LayerLayout`: one MoE layer's placement as one rank sees it, as tensors, built once.

Shape legend (docs/conventions.md): E routed experts, D devices, L local experts (slots) of this rank,
M most homes of one expert.

The dispatcher, the pruner, the statistics and transformers' EP adapter all read the same object,
so the slot convention of `Placement` is turned into tensors in one place and moved to a device once
(`to`, cached per device). Two views exist:

- **one process** (`rank=None`): the devices are logical; this process computes every expert once, in
  its own slot (`local_index_E[e] = e`, every column of `slot_ED` the identity);
- **one rank of an EP group** (`rank=r`): its slots are the experts with a home on device r
  (primary or replica), in increasing id; `local_index_E` is each expert's slot on its primary device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """One layer's placement for one rank (see the module docstring).

    Attributes:
        layer: the decoder-layer index.
        num_devices: `D`.
        rank: this rank's device, or None in one process (logical devices).
        device_of_E: `[E]` int64 primary device of each expert.
        local_index_E: `[E]` int64 slot of each expert on the rank that serves it without replicas.
        expert_ids_L: `[L]` int64 the experts this rank computes, in slot order.
        home_table_EM: `[E, M]` int64 homes of each expert, increasing, -1 padded; None without replicas.
        slot_ED: `[E, D]` int64 slot of expert e on device d (-1: no home there); None without replicas.
        copy_weight_L: `[L]` float32 one over the homes of each slot's expert (a copy counts once in the global
            gradient norm); all ones in one process.
        replica_slots: int64, the local slots holding a copy of a replicated expert (EP only, else empty).
        replica_rows: int64, beside `replica_slots`: each such slot's expert's row among the layer's replicated
            experts (the rows of the batched gradient sum over the holders, `distributed.collectives`).
        num_replicated: replicated experts of the layer whose copies' gradients are summed (EP only, else 0).
        pin_slack: the load-aware replica rule's pin slack at this layer.
        identity_slots: every expert in its own slot with one home: the routing ids are the local slots themselves.
        num_experts: `E` and num_local_experts: `L`, host ints made once from the tensors' lengths: a forward
            reads them, and a compiled one then guards on an int instead of on a tensor's metadata (dynamo
            re-checks its guards before every call: at batch 1 they are a visible share of a decode step).
    """

    layer: int
    num_devices: int
    rank: int | None
    device_of_E: torch.Tensor
    local_index_E: torch.Tensor
    expert_ids_L: torch.Tensor
    home_table_EM: torch.Tensor | None
    slot_ED: torch.Tensor | None
    copy_weight_L: torch.Tensor
    replica_slots: torch.Tensor
    replica_rows: torch.Tensor
    num_replicated: int
    pin_slack: float
    identity_slots: bool
    _on_device: dict = field(default_factory=dict, repr=False)
    num_experts: int = field(init=False)
    num_local_experts: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_experts", self.device_of_E.numel())
        object.__setattr__(self, "num_local_experts", self.expert_ids_L.numel())
        for tensor in self._tensors().values():  # sizes fixed by the placement: never symbolic in a compiled graph,
            if tensor is not None:  # where `dynamic=True` would tie E to any input size that happened to equal it
                torch._dynamo.mark_static(tensor)

    @classmethod
    def of(cls, placement, layer: int, rank: int | None = None) -> "LayerLayout":
        """Build the layout of `placement` (a `Placement`) at `layer` for `rank` (None: one process)."""
        layer = int(layer)
        homes = placement.homes(layer)
        num_experts, num_devices = placement.num_experts, placement.num_devices
        replicated = placement.has_replicas and any(len(h) > 1 for h in homes)
        if rank is None:
            expert_ids = list(range(num_experts))
            local_index = expert_ids
            slot_ED = torch.arange(num_experts)[:, None].expand(num_experts, num_devices)
            copy_weight = [1.0] * num_experts
            held: list[tuple[int, int]] = []
            num_replicated = 0
        else:
            if not 0 <= rank < num_devices:
                raise ValueError(f"rank {rank} is outside the placement's devices [0, {num_devices})")
            expert_ids = placement.experts_on(layer, rank)
            local_index = placement.local_slot(layer)
            slot_ED = torch.as_tensor(placement.slot_table(layer))
            copy_weight = [1.0 / len(homes[e]) for e in expert_ids]
            replicated_E = [e for e, h in enumerate(homes) if len(h) > 1]
            row_of = {e: i for i, e in enumerate(replicated_E)}
            held = [(slot, row_of[e]) for slot, e in enumerate(expert_ids) if e in row_of]
            num_replicated = len(replicated_E)
        return cls(
            layer=layer,
            num_devices=num_devices,
            rank=rank,
            device_of_E=torch.tensor(placement.device_of(layer), dtype=torch.int64),
            local_index_E=torch.tensor(local_index, dtype=torch.int64),
            expert_ids_L=torch.tensor(expert_ids, dtype=torch.int64),
            home_table_EM=torch.as_tensor(placement.home_table(layer), dtype=torch.int64) if replicated else None,
            slot_ED=slot_ED.to(torch.int64).contiguous() if replicated else None,
            copy_weight_L=torch.tensor(copy_weight, dtype=torch.float32),
            replica_slots=torch.tensor([s for s, _ in held], dtype=torch.int64),
            replica_rows=torch.tensor([r for _, r in held], dtype=torch.int64),
            num_replicated=num_replicated,
            pin_slack=placement.pin_slack_of(layer),
            identity_slots=not replicated and local_index == list(range(num_experts)),
        )

    @property
    def replicated(self) -> bool:
        """Whether some expert of the layer has several homes."""
        return self.home_table_EM is not None

    def primary_devices(self) -> list[int]:
        """`[E]` the primary device of each expert, as host ints."""
        return self.device_of_E.tolist()

    def to(self, device: torch.device | str) -> "LayerLayout":
        """This layout with every tensor on `device` (copied there once, then cached): a copy from pageable
        host memory in every forward would wait for the GPU."""
        device = torch.device(device)
        if self.device_of_E.device == device:
            return self
        moved = self._on_device.get(device)
        if moved is None:
            tensors = {
                name: None if value is None else value.to(device)
                for name, value in self._tensors().items()
            }
            moved = LayerLayout(
                layer=self.layer, num_devices=self.num_devices, rank=self.rank, num_replicated=self.num_replicated,
                pin_slack=self.pin_slack, identity_slots=self.identity_slots, _on_device=self._on_device, **tensors,
            )  # fmt: skip
            self._on_device.setdefault(self.device_of_E.device, self)
            self._on_device[device] = moved
        return moved

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        names = ("device_of_E", "local_index_E", "expert_ids_L", "home_table_EM", "slot_ED", "copy_weight_L",
                 "replica_slots", "replica_rows")  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def __repr__(self) -> str:
        where = "one process" if self.rank is None else f"rank {self.rank}"
        return (
            f"LayerLayout(layer={self.layer}, {where} of {self.num_devices} devices, experts={self.num_experts}, "
            f"local={self.num_local_experts}, replicated={self.replicated}, device={self.device_of_E.device})"
        )


__all__ = ["LayerLayout"]
