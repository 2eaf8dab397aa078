"""`LocalDispatcher` ("local"): one process computes every expert; `num_devices` logical devices.

Nothing is exchanged and every size is static (`R = T` rows in "dedup", `T * k` in "per_expert";
`N = T * k` pairs), so a forward reads nothing on the host: the block costs route + layout + experts
+ combine. The rows and pairs per logical device (the CT statistics) are computed on the device, the
same numbers `num_devices` real ranks would send.
"""

from __future__ import annotations

import torch

from .base import DispatchPlan, Dispatched, TokenDispatcher, dispatch_format, register_dispatcher
from .plan import device_counts, local_pairs, routing_width


@register_dispatcher
class LocalDispatcher(TokenDispatcher):
    name = "local"
    priority = 100  # the only choice, and the right one, without a process group
    graph_capturable = True

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return not ep.is_distributed

    def dispatch(self, x_TH: torch.Tensor, routing) -> Dispatched:
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        num_tokens, top_k = ids_Tk.shape
        dest_Tk, local_Tk = self.destinations_of(routing)
        counts_D2 = device_counts(dest_Tk, self.ep.num_devices, self.mode, [(0, num_tokens)])[0]
        segments, pick_N = local_pairs(local_Tk, self.num_local_experts, self.mode)
        pair_weight_N = weights_Tk.reshape(-1)[pick_N]
        # "dedup": the tokens are the rows; "per_expert": row t*k + j is token t's copy for its slot j
        x_RH = x_TH if self.mode == "dedup" else x_TH[:, None].expand(-1, top_k, -1).reshape(-1, x_TH.shape[1])
        row_format = dispatch_format(x_TH.shape[1], x_TH.dtype, routing_width(self.mode, top_k), weights_Tk.dtype)
        plan = DispatchPlan(
            mode=self.mode,
            num_tokens=num_tokens,
            counts_D2=counts_D2,
            row_bytes=row_format.row_bytes,
            ep=self.ep,
            layer=self.layer,
            num_pairs=num_tokens * top_k,
        )
        return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=pair_weight_N, plan=plan)

    def combine(self, out_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        if plan.mode == "dedup":  # one row per token: the expert kernel already summed its k experts in fp32
            return out_RH
        num_tokens, hidden = plan.num_tokens, out_RH.shape[1]
        top_k = plan.num_pairs // num_tokens if num_tokens else 1
        return out_RH.reshape(num_tokens, top_k, hidden).float().sum(1).to(out_RH.dtype)


__all__ = ["LocalDispatcher"]
