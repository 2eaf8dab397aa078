"""The expert activations the Triton kernels implement, and the map from a model's `act_fn` to them.

Kept apart from the kernels so that choosing a backend (`occult_hf.experts`) never imports triton. The same names
select the activation of the reference's custom operator (`expert_mlp_reference.expert_mlp_reference_op`), which
takes a name where eager code takes the model's function: `TORCH_ACTIVATIONS` gives each name's function and its
derivative as PyTorch's own backward kernels compute it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: activation names the Triton kernels implement, forward and derivative (their constexpr code is the
#: position here: `triton_expert_mlp_kernels.apply_activation`)
ACTIVATIONS = ("silu", "gelu_tanh")

#: name -> (the activation, its backward: (grad of the output, input) -> grad of the input), by PyTorch's kernels
TORCH_ACTIVATIONS = {
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "gelu_tanh": (
        functools.partial(F.gelu, approximate="tanh"),
        functools.partial(torch.ops.aten.gelu_backward, approximate="tanh"),
    ),
}

_SILU_CLASSES = ("SiLU", "SiLUActivation")
# transformers' classes that compute GELU with the tanh approximation (the same function, rounded differently)
_GELU_TANH_CLASSES = ("PytorchGELUTanh", "GELUTanh", "NewGELUActivation", "FastGELUActivation")


def activation_name(act_fn) -> str:
    """The `ACTIVATIONS` name of a model's expert activation (a torch function or module, or one of
    transformers' activation classes); ValueError naming the activation when the kernels lack it."""
    if act_fn is F.silu or isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ in _SILU_CLASSES:
        return "silu"
    if (isinstance(act_fn, torch.nn.GELU) and act_fn.approximate == "tanh") or type(act_fn).__name__ in _GELU_TANH_CLASSES:
        return "gelu_tanh"
    name = getattr(act_fn, "__name__", None) or type(act_fn).__name__
    raise ValueError(
        f"the Triton expert kernels implement the activations {ACTIVATIONS}, not this model's expert "
        f"activation {name}; use expert_backend='torch' (or 'auto', which falls back to it)"
    )


def triton_supports(act_fn) -> bool:
    """Whether `activation_name(act_fn)` succeeds."""
    try:
        activation_name(act_fn)
    except ValueError:
        return False
    return True


__all__ = ["ACTIVATIONS", "TORCH_ACTIVATIONS", "activation_name", "triton_supports"]
