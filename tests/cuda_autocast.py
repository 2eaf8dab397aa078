"""CUDA's bf16 autocast as the expert-parallel path meets it, reproduced on CPU (no GPU needed).

Two things differ between `torch.autocast("cuda")` and `torch.autocast("cpu")` that matter to occult_hf,
and a CPU test sees neither:
- CUDA autocast runs `sum` without an explicit dtype in fp32 (its `fp32_set_opt_dtype` list); CPU
  autocast leaves `sum` alone. A bf16 model whose MoE block reduced with a bare `sum` returned fp32 on
  GPU only.
- On CUDA the experts run in the Triton kernels, which take rows and weights of one dtype and raise
  otherwise ("gate_up_proj dtype torch.bfloat16 differs from x_RH dtype torch.float32"); on CPU the
  "torch" backend's reference calls `F.linear`, which autocast casts, so a mismatch passes unseen.

`cuda_autocast_on_cpu()` registers CUDA's policy for `aten::sum.dim_IntList` under the AutocastCPU key and
wraps the "torch" expert backend with the Triton kernels' dtype rule, for the duration of the context
(the registration is removed at its end). It found the bf16 fine-tuning failure of the paper bench's first
GPU run (issue 19) on CPU.
"""

from __future__ import annotations

import contextlib

import torch


def _sum_as_cuda_autocast(x, dim, keepdim=False, dtype=None):
    """`sum.dim_IntList` under CUDA autocast: fp32 unless the caller gave a dtype."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        if dtype is None and x.is_floating_point():
            dtype = torch.float32
        return torch.ops.aten.sum.dim_IntList(x, dim, keepdim, dtype=dtype)


@contextlib.contextmanager
def cuda_autocast_on_cpu():
    from occult_hf.registry import EXPERT_BACKENDS

    library = torch.library.Library("aten", "IMPL")
    library.impl("sum.dim_IntList", _sum_as_cuda_autocast, "AutocastCPU")
    torch_backend = EXPERT_BACKENDS.unregister("torch")

    def one_dtype_backend(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic):
        for name, tensor in (("gate_up_proj", gate_up_proj_L2IH), ("down_proj", down_proj_LHI)):
            if tensor.dtype != x_RH.dtype:  # the Triton kernels' rule and message
                raise ValueError(f"{name} dtype {tensor.dtype} differs from x_RH dtype {x_RH.dtype}; cast one of them")
        return torch_backend(x_RH, segments, pair_weight_N, gate_up_proj_L2IH, down_proj_LHI, act_fn, deterministic)

    EXPERT_BACKENDS.register("torch", one_dtype_backend)
    try:
        yield
    finally:
        EXPERT_BACKENDS.unregister("torch")
        EXPERT_BACKENDS.register("torch", torch_backend)
        library._destroy()
