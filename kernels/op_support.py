"""The custom operators of the expert computation (`torch.library`, namespace `occult`), one pair per backend.

Every backend (`triton_expert_mlp`, `grouped_mm_fused`, `expert_mlp_reference`) becomes two operators of the same
form, so that `torch.compile` traces the expert computation without a graph break while the kernels stay opaque:

    occult::<name>           (x_RH, pair_weight_N, gate_up_L2IH, down_LHI, *layout, *statics, save) -> (out_RH, gu_N2I)
    occult::<name>_backward  (dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I, *layout, *statics, needs)
                             -> (d x_RH, d pair_weight_N, d gate_up_L2IH, d down_LHI)

`layout` are the layout's tensors (the first is `pair_row_N`, [N]), `statics` the backend's static arguments (the
reduce mode, the activation's name), `save` whether a gradient will be needed, and `gu_N2I` what the forward keeps for
the backward: the pre-activations `[N, 2I]` when `save` (`[0, 2I]` otherwise, and always for a backend that keeps
nothing). An operator returns tensors only, never None, so a gradient nobody needs (`needs`, one bool per
differentiable input) comes back empty, and the autograd formula turns it into None. The fake implementations give
`out_RH` x's shape, `gu_N2I` N rows or none, and each needed gradient its input's shape: shapes from the input shapes
and the static arguments alone, so a dynamic token count stays symbolic.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable

_DIFFERENTIABLE = "Tensor x_RH, Tensor pair_weight_N, Tensor gate_up_L2IH, Tensor down_LHI"


def define_expert_operators(
    name: str, layout: str, statics: str, forward: Callable, backward: Callable, keeps_gu: bool = True
) -> None:
    """Define `occult::<name>` and `occult::<name>_backward` (the module docstring), with their fake implementations
    and the forward's autograd formula.

    Args:
        layout: the schema of the layout's tensors, e.g. "Tensor pair_row_N, Tensor expert_offsets".
        statics: the schema of the static arguments, e.g. "str activation".
        forward: `(x, w, gate_up, down, *layout, *statics, save) -> (out, gu or None)`.
        backward: `(dout, x, w, gate_up, down, gu, *layout, *statics, needs)` -> the four gradients, None where
            `needs` says False.
        keeps_gu: whether the forward keeps the pre-activations when `save` (else `gu_N2I` is always empty).
    """
    num_layout = layout.count(",") + 1

    def run_forward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, *rest):
        out_RH, gu_N2I = forward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, *rest)
        return out_RH, x_RH.new_empty(0, gate_up_L2IH.shape[1]) if gu_N2I is None else gu_N2I

    def fake_forward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, pair_row_N, *rest):
        rows = pair_row_N.shape[0] if keeps_gu and rest[-1] else 0
        return torch.empty_like(x_RH), x_RH.new_empty(rows, gate_up_L2IH.shape[1])

    def run_backward(dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, *rest):
        grads = backward(dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, *rest)
        return tuple(t.new_empty(0) if grad is None else grad for grad, t in zip(grads, (x_RH, pair_weight_N, gate_up_L2IH, down_LHI)))

    def fake_backward(dout_RH, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, *rest):
        inputs = (x_RH, pair_weight_N, gate_up_L2IH, down_LHI)
        return tuple(torch.empty_like(t) if need else t.new_empty(0) for t, need in zip(inputs, rest[-1]))

    forward_op = torch.library.custom_op(
        f"occult::{name}", mutates_args=(), schema=f"({_DIFFERENTIABLE}, {layout}, {statics}, bool save) -> (Tensor, Tensor)"
    )(run_forward)
    backward_op = torch.library.custom_op(
        f"occult::{name}_backward",
        mutates_args=(),
        schema=f"(Tensor dout_RH, {_DIFFERENTIABLE}, Tensor gu_N2I, {layout}, {statics}, bool[] needs) -> (Tensor, Tensor, Tensor, Tensor)",
    )(run_backward)
    forward_op.register_fake(fake_forward)
    backward_op.register_fake(fake_backward)

    def setup_context(ctx, inputs, output):
        differentiable = inputs[:4]
        layout_tensors, ctx.statics = inputs[4 : 4 + num_layout], inputs[4 + num_layout : -1]
        ctx.save_for_backward(*differentiable, output[1], *layout_tensors)

    def formula(ctx, dout_RH, _):
        needs = list(ctx.needs_input_grad[:4])
        grads = backward_op(dout_RH, *ctx.saved_tensors, *ctx.statics, needs)
        return *(grad if need else None for grad, need in zip(grads, needs)), *(None,) * (num_layout + len(ctx.statics) + 1)

    forward_op.register_autograd(formula, setup_context=setup_context)


class EagerExpertFunction(torch.autograd.Function):
    """A backend's `forward` / `backward` as an autograd function for eager calls, without the operator dispatch:
    `forward(*statics, x, w, gate_up, down, save)` and `backward(*statics, dout, x, w, gate_up, down, gu, needs)`,
    `statics` the launch state the backend computed once (its plan). Each backend subclasses it, so that profiles name
    its own autograd node."""

    @staticmethod
    def forward(ctx, forward, backward, statics: tuple, save: bool, x_RH, pair_weight_N, gate_up_L2IH, down_LHI):
        ctx.backward, ctx.statics = backward, statics
        out_RH, gu_N2I = forward(*statics, x_RH, pair_weight_N, gate_up_L2IH, down_LHI, save)
        if save:
            ctx.save_for_backward(x_RH, pair_weight_N, gate_up_L2IH, down_LHI, gu_N2I)
        return out_RH

    @staticmethod
    @once_differentiable  # the kernels' backward has no backward: a double backward is an error, not a silent zero
    def backward(ctx, dout_RH):
        return None, None, None, None, *ctx.backward(*ctx.statics, dout_RH, *ctx.saved_tensors, ctx.needs_input_grad[4:])


__all__ = ["EagerExpertFunction", "define_expert_operators"]
