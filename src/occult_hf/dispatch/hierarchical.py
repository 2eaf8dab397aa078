"""`HierarchicalDispatcher` ("hierarchical"): the two-level exchange of an EP group that spans nodes.

Shape legend: see `occult_hf.dispatch.plan`; in addition, local to this file, Q nodes of the group, K devices of one
node (`ExpertParallelGroup.devices_per_node`), X the entries of one rank's count message (`3 + K`).

The flat exchange sends one row per (token, destination device), also over the inter-node link, about 9x slower
than NVLink (400 Gb/s InfiniBand, about 50 GB/s per GPU). Here a token crosses to another node once, as DeepEP's
internode kernels send it:

1. **Inter-node hop**, over this rank's *rail* (the ranks of its local index on every node,
   `ExpertParallelGroup.rail_group`): one row per (token, node) to the rank of the same local index there
   ("per_expert": one per (token, expert)). The row carries the token's activations and, for each of its k routing
   slots served on that node, the serving device's index in the node and the expert's slot there (one int32 code,
   `device * E + slot`; -1 for a slot served on another node) and the routing weight. The copy to the token's own node
   stays on this rank.
2. **Intra-node hop**, over the node's ranks (`ExpertParallelGroup.node_group`): the rank that received a node row
   forwards one row per (node row, device of the node that serves one of its slots) in the flat exchange's format;
   the experts consume them as they consume the flat exchange's rows.

On the way back each device's experts are summed on the device (the expert kernels' weighted sum), the node's devices
are summed on the forwarding rank (fp32, rounded once to the rows' dtype), and that one row per (token, node) returns
over the inter-node link, where the token's nodes are summed (fp32, rounded once). The backward runs the same hops in
reverse: each hop is the flat exchange's autograd pair (`all_to_all._DispatchExchange` and `_CombineExchange`) over
its subgroup, so inputs, routing weights and experts get their gradients through both hops.

**One count exchange.** Every split size of both hops is known after one host read per layer, as in the flat
exchange: one all-to-all over the whole group of a `[D, X]` message (`_NodeCountMessage`) in which each rank tells
each device its flat (rows, pairs) there, its rows to that device's node, and its rows to each device of that node.
A forwarder learns what to forward from the senders on its rail, a receiver what arrives from its node's ranks.

The layer's statistics (`DispatchPlan.counts_D2`, `OccultMoE.stats`) count the (token, device) rows as the flat
exchange does: they are the rows each device receives. The rows each hop moved are the plan's
(`HierarchicalPlan.to_nodes`, `to_devices`; `rows_across_nodes`), which `metrics.node_traffic` predicts.

It runs in one chunk (`OccultConfig.dispatch_chunks` pipelines the flat exchange only). Under `torch.compile` it
takes, as "all_to_all" does, the static-capacity flat exchange of "padded" (the split sizes read on the host would
end the graph at every layer). "auto" takes it whenever the group spans nodes (`dispatch.auto`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .all_to_all import AllToAllDispatcher, _Chunk, _CombineExchange, weights_to_send
from .base import DispatchPlan, Dispatched, register_dispatcher, stage
from .group import ExpertParallelGroup
from .plan import device_match, packed_rows, received_pairs

#: a hop's name in error messages
INTER_NODE, INTRA_NODE = "inter-node ", "intra-node "


@dataclass(frozen=True)
class HierarchicalPlan(DispatchPlan):
    """`DispatchPlan` of "hierarchical": `counts_D2` counts the (token, device) rows, which each device receives
    (through its node's forwarders); the rows of each hop are in its chunk.

    Attributes (beyond `DispatchPlan`):
        to_nodes: the inter-node hop: this rank's tokens, one row per (token, node) over its rail; its
            `send_splits`/`recv_splits` are indexed by node.
        to_devices: the intra-node hop: the node rows this rank received, one row per (node row, device of this
            node); its splits are indexed by the device's index in the node.
    """

    to_nodes: _Chunk | None = None
    to_devices: _Chunk | None = None

    @property
    def rows_across_nodes(self) -> int:
        """Rows this rank sent over the inter-node link (its copies to other nodes; `NodeTraffic.sent_cross_hierarchical_D`)."""
        own = self.ep.rank // self.ep.devices_per_node
        return sum(rows for node, rows in enumerate(self.to_nodes.send_splits) if node != own)


@dataclass(frozen=True)
class _HopSplits:
    """Both hops' split sizes on this rank (host ints), read from the one count exchange.

    Attributes:
        node_send: rows to each node (its rank on this rank's rail).
        node_recv: rows from each node's rank on this rank's rail.
        device_send: rows forwarded to each device of this node.
        device_recv: rows received from each device of this node.
        num_pairs: (row, local expert) pairs this rank computes.
    """

    node_send: tuple[int, ...]
    node_recv: tuple[int, ...]
    device_send: tuple[int, ...]
    device_recv: tuple[int, ...]
    num_pairs: int


class _NodeCountMessage:
    """The count exchange of both hops: `[2, D, X]` int64 (what this rank sends to each device, then what it receives
    from each), `X = 3 + K + S`. To device d a rank sends `[0:2]` its flat (rows, pairs) on d (what reaches d through
    its node's forwarders: d's receive splits and pair count), `[2]` its rows to d's node (read by its rail's rank
    there: that rank's inter-node receive split), `[3:3 + K]` its rows to each device of d's node (read by its rail's
    rank there: what that rank forwards) and last its row format's stamp (`stamped`, as in the flat exchange's
    message)."""

    def __init__(self, ep: ExpertParallelGroup, stamped: tuple[tuple[int, ...], torch.Tensor]) -> None:
        self.ep = ep
        self.stamp, stamp_S = stamped
        width = len(self.stamp)
        self.both_2DX = torch.empty(2, ep.num_devices, 3 + ep.devices_per_node + width, dtype=torch.int64, device=stamp_S.device)
        self.both_2DX[0, :, -width:] = stamp_S

    @property
    def flat_counts_D2(self) -> torch.Tensor:
        """The `[D, 2]` slot of the flat counts in the send half (written by `plan.device_match`)."""
        return self.both_2DX[0, :, 0:2]

    def fill(self, node_rows_Q: torch.Tensor) -> None:
        """Write the node entries of the send half from `[Q]` rows per node and the flat counts already written."""
        send_DX, per_node = self.both_2DX[0], self.ep.devices_per_node
        send_DX[:, 2] = node_rows_Q.repeat_interleave(per_node)
        send_DX[:, 3 : 3 + per_node] = send_DX[:, 0].reshape(self.ep.num_nodes, per_node).repeat_interleave(per_node, dim=0)

    def splits(self, both: list) -> _HopSplits:
        """This rank's `_HopSplits` from the host copy of the exchanged message."""
        send, recv = both
        per_node, nodes = self.ep.devices_per_node, range(self.ep.num_nodes)
        local = self.ep.rank % per_node
        rail = [node * per_node + local for node in nodes]  # this rank's rail: the ranks of its local index
        return _HopSplits(
            node_send=tuple(send[d][2] for d in rail),
            node_recv=tuple(recv[d][2] for d in rail),
            device_send=tuple(sum(recv[d][3 + j] for d in rail) for j in range(per_node)),
            device_recv=tuple(sum(recv[node * per_node + j][0] for node in nodes) for j in range(per_node)),
            num_pairs=sum(row[1] for row in recv),
        )


@register_dispatcher
class HierarchicalDispatcher(AllToAllDispatcher):
    """The flat exchange's transport and autograd, twice: over the rail between nodes, then inside the node."""

    name = "hierarchical"
    overlaps_chunks = False
    priority = 20  # above "all_to_all": where the group spans nodes (only there it serves) "auto" takes it
    requires = (
        "an expert-parallel group that spans nodes: OccultConfig.devices_per_node (or $LOCAL_WORLD_SIZE under "
        "torchrun) smaller than the group, dividing it"
    )

    def __init__(self, ep, layout, settings, label=None) -> None:
        if not self.supports(ep):
            raise ValueError(
                f"dispatcher 'hierarchical' needs {self.requires}; this group of {ep.num_devices} devices "
                f"{'is one node' if ep.is_distributed else 'is one process'} (devices_per_node={ep.devices_per_node})"
            )
        super().__init__(ep, layout, settings, label)
        self.chunks = 1  # the hops are not pipelined (`overlaps_chunks`)

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return ep.is_distributed and ep.spans_nodes

    def dispatch(self, x_TH: torch.Tensor, routing, concurrent=None) -> Dispatched:
        """Both hops (see the module docstring); `concurrent` (see `TokenDispatcher.run`) is issued behind the count
        exchange, as in "all_to_all"."""
        ep, num_experts = self.ep, self.layout.num_experts
        per_node = ep.devices_per_node
        weights_Tk = routing.topk_weights_Tk
        with stage("plan"):
            dest_Tk, local_Tk = self.destinations_of(routing)
            node_Tk = torch.div(dest_Tk, per_node, rounding_mode="floor")
            row_format = self._row_format(x_TH, routing)
            message = _NodeCountMessage(ep, self._stamp(row_format, dest_Tk.device))
            counts_D2 = device_match(dest_Tk, ep.num_devices, self.mode, counts_D2=message.flat_counts_D2).counts_D2
            node_match = device_match(node_Tk, ep.num_nodes, self.mode)
            message.fill(node_match.counts_D2[:, 0])
        splits = self._read_counts(message, concurrent)

        # inter-node hop: one row per (token, node), each slot's serving device in the node and slot there as one code
        with stage("plan"):
            code_Tk = (dest_Tk - node_Tk * per_node) * num_experts + local_Tk
            rows = packed_rows(node_match, code_Tk, weights_Tk, sum(splits.node_send))
            to_nodes = _Chunk(
                0, dest_Tk.shape[0], rows.token_O, rows.slot_OW, rows.weight_OW, rows.row_TJ, splits.node_send,
                splits.node_recv, num_pairs=None, dest_Tk=node_Tk, group=ep.rail_group, hop=INTER_NODE,
            )  # fmt: skip
        weights, direct = weights_to_send(to_nodes, weights_Tk, self.mode, ep.num_nodes)
        node_x_RH, code_RW, node_weight_RW = self._send_rows(x_TH, to_nodes, row_format, weights, direct)

        # intra-node hop: the received node rows as the tokens, one row per (node row, device of this node)
        with stage("plan"):
            device_RW = torch.where(code_RW >= 0, torch.div(code_RW, num_experts, rounding_mode="floor"), -1)
            match = device_match(device_RW, per_node, self.mode)  # a slot served on another node (-1) matches none
            rows = packed_rows(match, code_RW.remainder(num_experts), node_weight_RW, sum(splits.device_send))
            to_devices = _Chunk(
                0, node_x_RH.shape[0], rows.token_O, rows.slot_OW, rows.weight_OW, rows.row_TJ, splits.device_send,
                splits.device_recv, num_pairs=splits.num_pairs, group=ep.node_group, hop=INTRA_NODE,
            )  # fmt: skip
        x_RH, slot_RW, weight_RW = self._send_rows(node_x_RH, to_devices, row_format, to_devices.weight_OW, direct=False)
        with stage("received layout"):
            segments, pick_N = received_pairs(slot_RW, splits.num_pairs, self.num_local_experts)
            pair_weight_N = torch.take(weight_RW, pick_N)
        plan = HierarchicalPlan(
            mode=self.mode, num_tokens=dest_Tk.shape[0], counts_D2=counts_D2, row_bytes=row_format.row_bytes, ep=ep,
            layer=self.layer, num_pairs=splits.num_pairs, to_nodes=to_nodes,
            to_devices=to_devices,
        )  # fmt: skip
        return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=pair_weight_N, plan=plan)

    def combine(self, out_RH: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
        """The device rows back to their forwarders, summed per node row (the node's devices), then the node rows back
        over the inter-node link, summed per token (its nodes)."""
        node_out_RH = _CombineExchange.apply(out_RH, self, plan.to_devices)
        return _CombineExchange.apply(node_out_RH, self, plan.to_nodes)


__all__ = ["HierarchicalDispatcher", "HierarchicalPlan"]
