"""Local expert computation (docs/design.md §3 step 5) with a backend switch, and the module holding the weights.

Shape legend: R received rows, N (row, local expert) pairs, L local experts, H hidden, I expert width.

`local_experts()` computes, for every received row, the weighted sum of its local experts' outputs
(gather -> gate/up GEMM -> act(gate) * up -> down GEMM -> * routing weight -> fp32 scatter-add). It
only sees local tensors and the `ExpertSegments` layout that `dispatch()` produced. Backends
(`register_expert_backend`, names in `expert_backend_names()`; each takes the same arguments,
`ExpertBackend`):

- ``torch``: `grouped_mm` (one grouped GEMM per projection over the contiguous expert segments)
  where PyTorch has a kernel for the dtype and device (CUDA, compute capability >= 8.0, bf16,
  16-byte aligned rows), else the portable reference `expert_mlp_reference` (one GEMM per expert;
  under `torch.compile` its custom operator, `expert_mlp_reference_op`, for the activations it names,
  `occult_hf.kernels.activations.ACTIVATIONS`; another activation leaves the reference to eager, a graph break).
- ``triton``: `occult_hf.kernels.triton_expert_mlp.expert_mlp_triton` (fused gather/scatter; the
  model's activation passed by name, for the activations the kernels implement:
  `occult_hf.kernels.activations.ACTIVATIONS`, SiLU and GELU-tanh; any other is refused by name;
  imported on first use).
- ``grouped_mm_fused``: `occult_hf.kernels.grouped_mm_fused.expert_mlp_grouped_mm_fused`: PyTorch's
  grouped GEMMs (CUTLASS) for the projections and their gradients, Triton kernels for the gather, the
  activation and the per-row sums (the `triton` backend's activations; where PyTorch's grouped GEMM has a
  kernel: CUDA, bf16, 16-byte rows).
- ``auto``: on CUDA, when Triton imports and the kernels implement the activation: ``triton`` where the
  segments average fewer than `AUTO_TRITON_BELOW` pairs per expert for a forward alone, or fewer than
  `AUTO_TRITON_TRAIN_BELOW` when a gradient is needed; ``grouped_mm_fused`` otherwise where PyTorch's
  grouped GEMM has a kernel (bf16), else ``triton``; ``torch`` off CUDA. On the H200 (docs/kernels.md,
  "Which backend `auto` picks") the Triton kernels' 16- and 32-row tiles stream the expert weights faster
  than CUTLASS's tiles at short segments, and CUTLASS's GEMMs are the faster ones at long segments.

`torch.compile(fullgraph=True)` traces `local_experts` and `LocalExperts` forward and backward: every backend's
kernels are custom operators (namespace `occult`, see docs/kernels.md), the choice of backend is made on shapes,
dtypes and devices, and with a dynamic token count only `auto`'s pair-count threshold is a guard (crossing it
compiles once more, for the other backend).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from occult_hf.kernels.activations import activation_name, triton_supports
from occult_hf.kernels.expert_mlp_reference import (
    expert_mlp_grouped_mm,
    expert_mlp_reference,
    expert_mlp_reference_op,
    grouped_mm_op,
)
from occult_hf.kernels.layout import ExpertSegments, check_expert_shapes
from occult_hf.kernels.triton_support import require_triton, triton_importable, triton_runs_on

from .registry import EXPERT_BACKENDS

#: `(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic) -> [R, H]`
ExpertBackend = Callable[..., torch.Tensor]

def register_expert_backend(name: str, backend: ExpertBackend) -> ExpertBackend:
    """Register an expert backend under `name` in `occult_hf.registry.EXPERT_BACKENDS` ("auto" picks among them)."""
    return EXPERT_BACKENDS.register(name, backend)


def expert_backend_names() -> tuple[str, ...]:
    """What `OccultConfig.expert_backend` accepts: "auto" and every registered backend."""
    return ("auto", *EXPERT_BACKENDS.names())


def local_experts(
    x_RH: torch.Tensor,
    segments: ExpertSegments,
    pair_weight_N: torch.Tensor,
    gate_up_proj_L2IH: torch.Tensor,
    down_proj_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    backend: str = "auto",
    deterministic: bool = False,
) -> torch.Tensor:
    """`[R, H]` in `x_RH.dtype`: `out[r] = sum over pairs p of row r of w_p * MLP_{expert(p)}(x[r])`.

    Args:
        x_RH: `[R, H]` received rows.
        segments: pairs grouped by local expert (see `ExpertSegments`).
        pair_weight_N: `[N]` routing weights in segment order (any float dtype; multiplied in fp32).
        gate_up_proj_L2IH: `[L, 2I, H]` (gate rows first), `down_proj_LHI`: `[L, H, I]`.
        act_fn: the experts' activation.
        backend: "auto" or a registered backend (`expert_backend_names()`: "triton", "torch").
        deterministic: Triton only: fixed-order (atomic-free) reduction.

    Under `torch.autocast`, rows in another dtype than the weights (fp32 rows from a norm that autocast
    runs in fp32, bf16 weights) are cast to the weights' dtype and the result back to the rows' dtype,
    as transformers' grouped_mm experts do: autocast covers neither grouped GEMMs nor Triton kernels.
    Outside autocast differing dtypes are the caller's error (the backends say so).
    """
    if x_RH.dtype != gate_up_proj_L2IH.dtype and torch.is_autocast_enabled(x_RH.device.type):
        out_RH = local_experts(
            x_RH.to(gate_up_proj_L2IH.dtype), segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, backend, deterministic
        )
        return out_RH.to(x_RH.dtype)
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x_RH, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI))
        backend = _auto_backend(x_RH, segments, gate_up_proj_L2IH, down_proj_LHI, act_fn, needs_grad)
    return EXPERT_BACKENDS.get(backend)(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic)


def _torch_backend(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic):
    """PyTorch's grouped GEMM where it has a kernel, else the portable reference (`deterministic` is Triton's); under
    `torch.compile` the reference's operator where it knows the activation, else the reference left to eager. Eager
    calls check the inputs' shapes first (compiled ones meet the operators' fake implementations)."""
    compiling = torch.compiler.is_compiling()
    if not compiling:
        check_expert_shapes(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI)
    if grouped_mm_supported(x_RH, gate_up_proj_L2IH, down_proj_LHI):
        return expert_mlp_grouped_mm(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn)
    if not compiling:
        with torch.autocast(x_RH.device.type, enabled=False):  # as its operator and the grouped GEMMs: no autocast
            return expert_mlp_reference(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn)
    if triton_supports(act_fn):
        activation = activation_name(act_fn)
        return expert_mlp_reference_op(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, activation)
    return _eager_reference(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn)


#: the reference for an activation its operator does not name: its host read of the offsets cannot be traced
_eager_reference = torch.compiler.disable(
    expert_mlp_reference, reason="the expert activation is none of occult_hf.kernels.activations.ACTIVATIONS"
)


def _triton_backend(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic):
    """The fused Triton kernels, given the model's activation by name."""
    activation = activation_name(act_fn)  # ValueError naming an activation the kernels lack
    expert_mlp_triton = _triton_expert_mlp()  # ImportError naming triton when it is missing
    _check_on_cuda("triton", x_RH)
    return expert_mlp_triton(
        x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, deterministic=deterministic, activation=activation
    )


def _check_on_cuda(backend: str, x_RH: torch.Tensor) -> None:
    """A Triton backend's rows off CUDA (outside the interpreter) are an error naming the setting to change."""
    if not x_RH.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"OccultConfig.expert_backend={backend!r} runs on CUDA, but the experts are on {x_RH.device.type}: use "
            f"expert_backend='auto' (PyTorch off CUDA) or 'torch' (TRITON_INTERPRET=1 runs the kernels on CPU, slowly, "
            f"for tests)"
        )


def _grouped_mm_fused_backend(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic):
    """PyTorch's grouped GEMMs with the Triton kernels around them (both reductions fixed-order: repeatable
    whatever `deterministic` says)."""
    activation = activation_name(act_fn)  # ValueError naming an activation the kernels lack
    _triton_expert_mlp("grouped_mm_fused")  # ImportError naming triton when it is missing
    _check_on_cuda("grouped_mm_fused", x_RH)
    if x_RH.is_cuda and not grouped_mm_supported(x_RH, gate_up_proj_L2IH, down_proj_LHI):
        raise ValueError(
            f"expert_backend='grouped_mm_fused' needs PyTorch's grouped GEMM kernel: CUDA with compute capability "
            f">= 8.0, bfloat16 rows and weights, hidden and expert width multiples of 8; got {x_RH.dtype} rows, "
            f"hidden {down_proj_LHI.shape[1]}, width {down_proj_LHI.shape[2]}: use expert_backend='triton' or 'torch'"
        )
    if not x_RH.is_cuda and any(size * x_RH.element_size() % 16 for size in down_proj_LHI.shape[1:]):
        raise ValueError(
            f"expert_backend='grouped_mm_fused' off CUDA (TRITON_INTERPRET=1) needs PyTorch's grouped GEMM on 16-byte "
            f"rows: hidden and expert width multiples of {16 // x_RH.element_size()} in {x_RH.dtype}; got hidden "
            f"{down_proj_LHI.shape[1]}, width {down_proj_LHI.shape[2]}: use expert_backend='triton' or 'torch'"
        )
    from occult_hf.kernels.grouped_mm_fused import expert_mlp_grouped_mm_fused

    return expert_mlp_grouped_mm_fused(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, activation=activation)


register_expert_backend("triton", _triton_backend)
register_expert_backend("torch", _torch_backend)
register_expert_backend("grouped_mm_fused", _grouped_mm_fused_backend)


def grouped_mm_supported(x_RH: torch.Tensor, gate_up_proj_L2IH: torch.Tensor, down_proj_LHI: torch.Tensor) -> bool:
    """True where PyTorch's grouped GEMM has a kernel: CUDA (SM >= 8.0), bf16 and 16-byte aligned rows."""
    if grouped_mm_op() is None or not x_RH.is_cuda or x_RH.dtype != torch.bfloat16:
        return False
    if gate_up_proj_L2IH.dtype != torch.bfloat16 or down_proj_LHI.dtype != torch.bfloat16:
        return False
    if _capability(x_RH.device.index if x_RH.device.index is not None else torch.cuda.current_device()) < (8, 0):
        return False
    hidden, width = down_proj_LHI.shape[1], down_proj_LHI.shape[2]
    return hidden % 8 == 0 and width % 8 == 0  # 16-byte rows in bf16


@torch.compiler.assume_constant_result
def _capability(device_index: int) -> tuple[int, int]:
    """The GPU's compute capability (a constant to torch.compile, which cannot trace the query)."""
    return torch.cuda.get_device_capability(device_index)


class LocalExperts(nn.Module):
    """The routed experts this rank computes: `[L, 2I, H]` / `[L, H, I]` in local-slot order.

    Under expert parallelism over `D` ranks each expert's weight gradient collects the contributions
    of all ranks' tokens (through the reverse all-to-all), while DDP averages the gradients of the
    replicated parameters over the ranks. `grad_scale = 1/D` puts the experts on the same footing,
    so EP training equals single-process training on all ranks' batches with the mean of the ranks'
    losses as the loss.

    Attributes:
        gate_up_proj: `[L, 2I, H]` parameter (gate rows first).
        down_proj: `[L, H, I]` parameter.
        expert_ids: `[L]` int64 non-persistent buffer, the global id of each local expert.
        replaced_module: the family's experts module these stand for (not a child), or None; transformers'
            weight initialisation recognises experts by that module's class (`hf.weight_init`).

    The rows of both parameters are experts in this rank's local-slot order, which depends on the placement
    (also in one process): a state dict of another placement has the same shapes and would load its experts
    into the wrong slots without a word. `state_dict()` therefore records the slot order in the state dict's
    metadata (`EXPERT_IDS_METADATA`, kept by `torch.save`), and `load_state_dict` refuses one recorded for
    another order, or a stock experts module's (original order) when the slots are not in original order. A
    state dict without metadata (rebuilt as a plain dict, read from safetensors) cannot be checked.
    """

    def __init__(
        self,
        gate_up_proj_L2IH: nn.Parameter,
        down_proj_LHI: nn.Parameter,
        expert_ids_L: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        backend: str = "auto",
        deterministic: bool = False,
        grad_scale: float = 1.0,
        replaces: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self._replaces = (replaces,)  # a tuple hides the module from nn.Module registration
        self.register_state_dict_post_hook(_record_slot_order)
        if backend != "auto":
            EXPERT_BACKENDS.check(backend)
        if backend in ("triton", "grouped_mm_fused"):
            activation_name(act_fn)  # refuse, naming it, an activation the kernels lack, at build time
        self.gate_up_proj = gate_up_proj_L2IH
        self.down_proj = down_proj_LHI
        self.register_buffer("expert_ids", expert_ids_L.long(), persistent=False)
        self.act_fn = act_fn
        self.backend = backend
        self.deterministic = deterministic
        self.grad_scale = grad_scale

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    @property
    def replaced_module(self) -> nn.Module | None:
        return self._replaces[0]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        mismatch = _slot_order_mismatch(self, state_dict.get(prefix + "gate_up_proj"), local_metadata)
        if mismatch:
            error_msgs.append(f"{prefix[:-1] or 'the experts'}: {mismatch}")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def forward(self, x_RH: torch.Tensor, segments: ExpertSegments, pair_weight_N: torch.Tensor) -> torch.Tensor:
        gate_up_L2IH, down_LHI = self.gate_up_proj, self.down_proj
        if self.grad_scale != 1.0:
            gate_up_L2IH = _ScaleGrad.apply(gate_up_L2IH, self.grad_scale)
            down_LHI = _ScaleGrad.apply(down_LHI, self.grad_scale)
        return local_experts(
            x_RH, segments, pair_weight_N, gate_up_L2IH, down_LHI, self.act_fn, self.backend, self.deterministic
        )

    def computes_topk(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor) -> bool:
        """Whether `forward_topk` serves a call on these tokens: an eager forward without gradient of at most
        `TOPK_PAIRS_PER_EXPERT * L` (token, expert) pairs (a decode step), with a Triton backend ("auto" on CUDA and
        not fp64, or "triton") that implements the activation, x in the weights' dtype with unit stride along H, on CUDA (or fp32
        under the interpreter)."""
        if torch.compiler.is_compiling() or not 0 < topk_ids_Tk.numel() <= TOPK_PAIRS_PER_EXPERT * self.num_local_experts:
            return False
        gate_up, down = self.gate_up_proj, self.down_proj
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x_TH, topk_weights_Tk, gate_up, down)):
            return False
        if self.backend == "auto":
            if not (x_TH.is_cuda and triton_importable()) or x_TH.dtype == torch.float64:
                return False
        elif self.backend != "triton" or not triton_runs_on(x_TH) or not (x_TH.is_cuda or x_TH.dtype == torch.float32):
            return False
        same_dtype = x_TH.dtype == gate_up.dtype == down.dtype
        return same_dtype and x_TH.stride(1) == 1 and triton_supports(self.act_fn)

    def forward_topk(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor) -> torch.Tensor:
        """`[T, H]`: the forward of a call `computes_topk` accepts, straight from the top-k of these experts' local
        ids (`occult_hf.kernels.triton_topk_mlp`: two launches, no layout), the same sum as `forward` of its layout."""
        from occult_hf.kernels.triton_topk_mlp import expert_mlp_topk

        return expert_mlp_topk(
            x_TH, topk_ids_Tk, topk_weights_Tk, self.gate_up_proj, self.down_proj, activation_name(self.act_fn)
        )

    def extra_repr(self) -> str:
        experts, width2, hidden = self.gate_up_proj.shape
        return f"local_experts={experts}, hidden={hidden}, width={width2 // 2}, backend={self.backend!r}, grad_scale={self.grad_scale:g}"


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward (the expert weights' 1/D)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


#: the state-dict metadata entry (per `LocalExperts` prefix) holding the global expert id of each local slot
EXPERT_IDS_METADATA = "occult_expert_ids"


def _record_slot_order(module: LocalExperts, state_dict, prefix: str, local_metadata: dict) -> None:
    if not module.expert_ids.is_meta:
        local_metadata[EXPERT_IDS_METADATA] = module.expert_ids.tolist()


def _slot_order_mismatch(module: LocalExperts, gate_up, local_metadata: dict) -> str | None:
    """Why a state dict whose metadata for this module is `local_metadata` (and whose `gate_up_proj` entry is
    `gate_up`) holds other experts' rows, or None."""
    if "version" not in local_metadata or module.expert_ids.is_meta:  # no module's record (a plain dict; torch's
        return None  # `assign=True` adds a key of its own to it)
    held = module.expert_ids.tolist()
    saved = local_metadata.get(EXPERT_IDS_METADATA)
    if saved is None:  # a module without the record: a family's experts module, all experts in original order
        if gate_up is None or held == list(range(gate_up.shape[0])):
            return None
        return (
            f"the state dict holds routed experts in their original order (a model without occult_hf's blocks?) "
            f"but this model's local slots hold experts {held}; load it into the original model, or use "
            f"from_pretrained(..., occult_config=...), which places them"
        )
    if saved != held:
        return (
            f"the state dict was saved with another placement: its local slots held experts {saved}, this model's "
            f"hold {held}; load it into a model with the same placement (occult_config) and rank"
        )
    return None


#: pairs per local expert up to which an eager forward without gradient goes straight from the top-k
#: (`LocalExperts.computes_topk`): each pair reads its expert's weights, which at these sizes takes less wall time than
#: the grouped path's layout and tuned launches (docs/kernels.md, "Decode sizes in eager", has the measurements)
TOPK_PAIRS_PER_EXPERT = 4
#: mean pairs per expert below which "auto" computes a forward without gradient with the ``triton`` kernels (the
#: module docstring says why; docs/kernels.md, "Which backend `auto` picks", has the measurements)
AUTO_TRITON_BELOW = 1280
#: the same for a forward + backward, whose crossing lies lower (docs/kernels.md, "Which backend `auto` picks")
AUTO_TRITON_TRAIN_BELOW = 128


def _auto_backend(x_RH, segments: ExpertSegments, gate_up_proj_L2IH, down_proj_LHI, act_fn, needs_grad: bool) -> str:
    """What "auto" runs (the module docstring says why); fp64 rows run the PyTorch reference, which sums in fp64."""
    if x_RH.dtype == torch.float64 or not (x_RH.is_cuda and triton_supports(act_fn) and triton_importable()):
        return "torch"
    if not grouped_mm_supported(x_RH, gate_up_proj_L2IH, down_proj_LHI):
        return "triton"
    below = AUTO_TRITON_TRAIN_BELOW if needs_grad else AUTO_TRITON_BELOW
    return "triton" if segments.num_pairs < below * max(1, segments.num_local_experts) else "grouped_mm_fused"


def _triton_expert_mlp(backend: str = "triton"):
    """The Triton entry point, imported on first use (Triton is optional and slow to import); an ImportError that
    names `backend` and how to install Triton where it is missing."""
    require_triton(f"expert_backend={backend!r} (use expert_backend='torch' without it)")
    from occult_hf.kernels.triton_expert_mlp import expert_mlp_triton

    return expert_mlp_triton


__all__ = ["expert_backend_names", "register_expert_backend", "local_experts", "expert_mlp_grouped_mm", "grouped_mm_supported", "LocalExperts"]
