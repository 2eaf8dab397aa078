"""The statistics of a layer's exchange, for every front end and the callback.

Shape legend (docs/conventions.md): T tokens, k experts per token, D devices; here X the D + 1 rows of the tally.

- `ExchangeStats`: what a layer's dispatches sent, per destination device (rows, the (token, expert) pairs
  they carried, their bytes), and the forwards counted; accumulated on the device in one buffer with no host
  read (one kernel a compiled forward), read when a report asks. `OccultMoE` and transformers' EP adapter
  (`OccultEP`) each keep one per layer.
- `RoutingMeter`: the callback's per-window sums of the routing a layer actually dispatched: CT, remote
  copies and tokens x experts per device, from the devices that served each pair.

Both only add into their own buffers (integers, or under `no_grad`); reductions across ranks and decisions happen in the
callback or the CLI, never in a forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dispatch.plan import destinations
from .metrics import ct_and_remote_T, device_hits_TD, token_ranks_T


class ExchangeStats(nn.Module):
    """Per-destination counters of one layer's dispatches since `reset()`.

    One buffer holds them all, so a forward adds to it in one kernel (one guarded tensor a layer in a compiled
    forward): `tally_X2` is `[D + 1, 2]` int64, row d < D the (rows, pairs) sent to device d, row D (forwards,
    forwards). `rows_sent`, `pairs_sent` and `forwards` are views of it, and `bytes_sent` is made from it when
    read. The row size is the first forward's; a forward with rows of another size (another activation dtype)
    adds the difference of its bytes to `bytes_offset_D` itself (two kernels more), so a CUDA graph that
    captured it replays that too. All buffers are non-persistent: they are not part of a checkpoint.
    """

    def __init__(self, num_devices: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("tally_X2", torch.zeros(num_devices + 1, 2, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("bytes_offset_D", torch.zeros(num_devices, dtype=torch.int64, device=device), persistent=False)
        self._row_bytes = 0

    def record(self, counts_D2: torch.Tensor, row_bytes: int) -> None:
        """Add one dispatch: its `[D, 2]` int64 (rows, pairs) per device and the bytes of one of its rows.

        Integer tensors never join autograd, so no `no_grad` is needed; a compiled forward would guard on the
        decorator's closure, and its guards are re-checked before every call."""
        if not self._row_bytes:
            self._row_bytes = row_bytes
        elif row_bytes != self._row_bytes:
            self.bytes_offset_D.add_(counts_D2[:, 0] * (row_bytes - self._row_bytes))
        self.tally_X2.add_(F.pad(counts_D2, (0, 0, 0, 1), value=1))  # the padded row counts the forward

    @property
    def sent_D2(self) -> torch.Tensor:
        """`[D, 2]` int64 (a view of `tally_X2`): rows and pairs sent to each device."""
        return self.tally_X2[:-1]

    @property
    def rows_sent(self) -> torch.Tensor:
        """`[D]` int64 (a view of `tally_X2`): rows sent to each device."""
        return self.sent_D2[:, 0]

    @property
    def pairs_sent(self) -> torch.Tensor:
        """`[D]` int64 (a view of `tally_X2`): (token, expert) pairs those rows carried."""
        return self.sent_D2[:, 1]

    @property
    def forwards(self) -> torch.Tensor:
        """`[]` int64 (a view of `tally_X2`): forwards recorded."""
        return self.tally_X2[-1, 0]

    @property
    def bytes_sent(self) -> torch.Tensor:
        """`[D]` int64: bytes of those rows (activations and routing metadata), made when read."""
        return self.bytes_offset_D + self.rows_sent * self._row_bytes

    @torch.no_grad()
    def reset(self) -> None:
        for buffer in (self.tally_X2, self.bytes_offset_D):
            buffer.zero_()

    def buffer_names(self) -> list[str]:
        """The buffers' names relative to this module (rank-local state that DDP must leave alone)."""
        return [name for name, _ in self.named_buffers()]


class RoutingMeter:
    """On-device sums over one layer's training forwards since the last `pop()` (no host read).

    `update(module)` reads what the layer's last forward dispatched: `last_topk_ids_Tk`, its dispatcher's
    `last_destinations_Tk` (the device that served each pair, replicas included: under
    `replica_choice="load_aware"` only the dispatch knows it) and the tokens' devices under pruning.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self._sums = None  # float64 [2 + D]: CT sum, remote-copies sum, then tokens x experts per device

    @torch.no_grad()
    def update(self, module) -> None:
        """Add the last forward of `module` (an `OccultMoE`, or an `OccultEP` under transformers' EP) if it was a training
        forward."""
        ids_Tk = module.last_topk_ids_Tk
        if ids_Tk is None or not module.training:  # evaluation forwards are not training traffic
            return
        num_tokens = ids_Tk.shape[0]
        dispatcher = module.dispatcher
        num_devices = dispatcher.layout.num_devices
        device_Tk = dispatcher.last_destinations_Tk
        if device_Tk is None or device_Tk.shape != ids_Tk.shape:  # the one-device path plans no destinations
            device_Tk, _ = destinations(ids_Tk, dispatcher.layout.to(ids_Tk.device), module.last_devices_TD)
        hits_TD = device_hits_TD(device_Tk, num_devices)
        if module.ep.is_distributed:
            home_T = torch.full((num_tokens,), module.ep.rank, dtype=torch.int64, device=ids_Tk.device)
        else:  # contiguous equal chunks of the batch, as EP's data-parallel sharding
            home_T = token_ranks_T(num_tokens, num_devices, ids_Tk.device)
        ct_T, remote_T = ct_and_remote_T(hits_TD, home_T)
        load_D = hits_TD.sum(0)  # tokens x experts per device
        sums = torch.cat([torch.stack([ct_T.sum(), remote_T.sum()]), load_D]).double()
        self._sums = sums if self._sums is None else self._sums + sums
        self.tokens += num_tokens

    def pop(self, num_devices: int, device: torch.device) -> torch.Tensor:
        """`[3 + D]` float64: tokens, CT sum, remote-copies sum, load per device; then reset."""
        sums = self._sums if self._sums is not None else torch.zeros(2 + num_devices, dtype=torch.float64)
        out = torch.cat([torch.tensor([float(self.tokens)], dtype=torch.float64), sums.cpu()]).to(device)
        self.tokens, self._sums = 0, None
        return out


__all__ = ["ExchangeStats", "RoutingMeter"]
