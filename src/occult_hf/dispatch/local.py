"""`LocalDispatcher` ("local"): one process computes every expert; `num_devices` logical devices.

Nothing is exchanged and every size is static (`R = T` rows in "dedup", `T * k` in "per_expert";
`N = T * k` pairs), so a forward reads nothing on the host: the block costs route + layout + experts
+ combine. The rows and pairs per logical device (the CT statistics) are computed on the device, the
same numbers `num_devices` real ranks would send (`plan.device_match`'s counts: no atomics); with one
device they are static (T or T * k rows, T * k pairs: no kernel), and with the experts in their own order
(`local_index_E` the identity) the routing ids are the local slots themselves (no gather).

With one device the tokens are the rows ("dedup"), so where the experts can compute straight from the top-k
(`LocalExperts.computes_topk`: an eager decode step) `run` skips the layout altogether.
"""

from __future__ import annotations

import torch

from occult_hf.kernels.expert_mlp_reference import summing_dtype
from occult_hf.kernels.layout import ExpertSegments, topk_kernel_applies
from .base import DispatchPlan, Dispatched, TokenDispatcher, dispatch_format, register_dispatcher, stage
from .plan import device_match, local_pairs, routing_width


@register_dispatcher
class LocalDispatcher(TokenDispatcher):
    name = "local"
    priority = 100  # the only choice, and the right one, without a process group
    graph_capturable = True

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return not ep.is_distributed

    def run(self, x_TH: torch.Tensor, routing, experts, concurrent=None):
        """`TokenDispatcher.run`; with one device in "dedup" mode and experts that compute this call straight from the
        top-k (`ExpertsFn`'s optional `computes_topk`, which `LocalExperts` has), no layout: the experts' `forward_topk`,
        then the shared experts."""
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        if (
            torch.compiler.is_compiling()  # first: a compiled forward then guards on none of the rest
            or self.mode != "dedup"
            or not hasattr(type(experts), "computes_topk")  # the class's: PEFT's wrappers apply their adapters in `forward`
            or not (self.ep.num_devices == 1 and self.layout.identity_slots)
            or not experts.computes_topk(x_TH, ids_Tk, weights_Tk)
        ):
            return super().run(x_TH, routing, experts, concurrent)
        with stage("experts"):
            out_TH = experts.forward_topk(x_TH, ids_Tk, weights_Tk)
        if concurrent is not None:
            with stage("concurrent"):
                concurrent()
        return out_TH, self._plan(x_TH, routing, self._one_device_counts(ids_Tk.shape[0], ids_Tk.numel(), ids_Tk.device))

    def dispatch(self, x_TH: torch.Tensor, routing) -> Dispatched:
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        num_tokens, top_k = ids_Tk.shape
        one_device = self.ep.num_devices == 1 and self.layout.identity_slots
        if one_device:
            local_Tk = ids_Tk.long()
            counts_D2 = self._one_device_counts(num_tokens if self.mode == "dedup" else num_tokens * top_k, num_tokens * top_k, ids_Tk.device)
        else:
            dest_Tk, local_Tk = self.destinations_of(routing)
            counts_D2 = device_match(dest_Tk, self.ep.num_devices, self.mode).counts_D2
        if one_device and self.mode == "dedup" and topk_kernel_applies(local_Tk, self.num_local_experts):
            # the pairs are the top-k itself: its Triton layout (elsewhere received_pairs' 8-bit-key sort)
            segments, pair_weight_N = ExpertSegments.from_topk(local_Tk, weights_Tk, self.num_local_experts)
        else:
            segments, pick_N = local_pairs(local_Tk, self.num_local_experts, self.mode)
            pair_weight_N = weights_Tk.reshape(-1)[pick_N]
        # "dedup": the tokens are the rows; "per_expert": row t*k + j is token t's copy for its slot j
        x_RH = x_TH if self.mode == "dedup" else x_TH[:, None].expand(-1, top_k, -1).reshape(-1, x_TH.shape[1])
        return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=pair_weight_N, plan=self._plan(x_TH, routing, counts_D2))

    def _plan(self, x_TH: torch.Tensor, routing, counts_D2: torch.Tensor) -> DispatchPlan:
        num_tokens, top_k = routing.topk_ids_Tk.shape
        row_format = dispatch_format(x_TH.shape[1], x_TH.dtype, routing_width(self.mode, top_k), routing.topk_weights_Tk.dtype)
        return DispatchPlan(
            mode=self.mode,
            num_tokens=num_tokens,
            counts_D2=counts_D2,
            row_bytes=row_format.row_bytes,
            ep=self.ep,
            layer=self.layer,
            num_pairs=num_tokens * top_k,
        )

    def _one_device_counts(self, rows: int, pairs: int, device) -> torch.Tensor:
        """`[1, 2]` int64 `(rows, pairs)` on `device`, kept for the last (rows, pairs) seen (read only: the
        counters add it); made by two fills (no host-to-device copy, so also inside a CUDA graph capture,
        where it is not kept)."""
        if torch.compiler.is_compiling():  # a traced graph makes its own (and keeps no tensor of a trace)
            return torch.tensor([[rows, pairs]], dtype=torch.int64, device=device)
        key = (rows, pairs, torch.device(device))
        cached = self.__dict__.get("_counts")
        if cached is not None and cached[0] == key:
            return cached[1]
        counts_D2 = torch.empty(1, 2, dtype=torch.int64, device=device)
        counts_D2[:, 0].fill_(rows)
        counts_D2[:, 1].fill_(pairs)
        if not (counts_D2.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._counts = (key, counts_D2)
        return counts_D2

    def combine(self, out_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        if plan.mode == "dedup":  # one row per token: the expert kernel already summed its k experts
            return out_RH
        num_tokens, hidden = plan.num_tokens, out_RH.shape[1]
        top_k = plan.num_pairs // num_tokens if num_tokens else 1
        return out_RH.reshape(num_tokens, top_k, hidden).sum(1, dtype=summing_dtype(out_RH.dtype)).to(out_RH.dtype)


__all__ = ["LocalDispatcher"]
