"""bf16 models under `torch.autocast`, as `Trainer(bf16=True)` runs them on a GPU, reproduced on CPU
(`cuda_autocast.cuda_autocast_on_cpu`: CUDA's autocast policy for `sum` and the Triton kernels' dtype rule).

The paper bench's first GPU run (issue 19) found both gaps: the occult fine-tuning rows failed with
"gate_up_proj dtype torch.bfloat16 differs from x_RH dtype torch.float32". The combine's per-token sum ran in
fp32 under CUDA autocast, so a bf16 model's MoE block returned fp32 (the stock block returns its input's
dtype) and the next layer's rows reached the bf16 experts in fp32. Both are checked against the stock
transformers block here; tests/test_bench_paper.py runs the bench's bf16 fine-tuning rows on 2 ranks.
"""

import copy

import pytest
import torch
from cuda_autocast import cuda_autocast_on_cpu
from tiny_models import tiny_model


def test_the_emulation_reproduces_cuda_autocast_and_the_triton_dtype_rule():
    """What the other checks rely on: without the emulation a CPU run cannot fail the way the GPU did."""
    from occult_hf.dispatch.base import sum_token_rows
    from occult_hf.experts import local_experts
    from occult_hf.kernels.layout import ExpertSegments

    rows_OH = torch.randn(4, 3, dtype=torch.bfloat16)
    with cuda_autocast_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.sum(rows_OH[None], dim=1).dtype == torch.float32  # CUDA autocast's sum
        # the combine's per-token sum keeps the rows' dtype (it returned fp32 on the GPU)
        assert sum_token_rows(rows_OH, torch.tensor([[0, 1], [2, 3]])).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.sum(rows_OH[None], dim=1).dtype == torch.bfloat16  # the registration is gone again
    segments = ExpertSegments(pair_row=torch.tensor([0, 1]), expert_offsets=torch.tensor([0, 1, 2]), num_rows=2)
    gate_up, down = torch.randn(2, 8, 3, dtype=torch.bfloat16), torch.randn(2, 3, 4, dtype=torch.bfloat16)
    with cuda_autocast_on_cpu(), pytest.raises(ValueError, match="gate_up_proj dtype torch.bfloat16 differs from x_RH dtype torch.float32"):
        local_experts(torch.randn(2, 3), segments, torch.ones(2), gate_up, down, backend="torch")  # outside autocast


def test_moe_block_under_autocast_takes_fp32_rows_to_bf16_experts_as_transformers_does():
    """fp32 hidden states (a norm that autocast runs in fp32) into a bf16 MoE block under autocast: transformers'
    grouped_mm experts cast the rows to the weights' dtype and return the input's dtype; occult_hf's block too
    (the Triton kernels refused the fp32 rows)."""
    from occult_hf import OccultConfig, apply_occult

    model = tiny_model("olmoe", seed=0).to(torch.bfloat16)
    stock = copy.deepcopy(model.model.layers[0].mlp)
    apply_occult(model, OccultConfig(num_devices=1, expert_backend="torch"))
    block = model.model.layers[0].mlp
    assert type(block).__name__ == "OccultMoE" and model.config._experts_implementation == "grouped_mm"
    x_BSH = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs, grads = [], []
    for module in (stock, block):
        x = x_BSH.clone().requires_grad_()
        with cuda_autocast_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
            out_BSH = module(x)
        out_BSH.float().square().sum().backward()
        outputs.append(out_BSH)
        grads.append(x.grad)
    (stock_out, occult_out), (stock_grad, occult_grad) = outputs, grads
    assert stock_out.dtype == occult_out.dtype == torch.float32
    # the same bf16 products, summed in fp32 in another order: bf16 rounding apart at most
    assert (occult_out - stock_out).abs().max() <= 1e-2 * stock_out.abs().max()
    assert (occult_grad - stock_grad).abs().max() <= 2e-2 * stock_grad.abs().max()
    expert_grads = [m.experts.gate_up_proj.grad if hasattr(m.experts, "gate_up_proj") else None for m in (stock, block)]
    assert all(g is not None and g.dtype == torch.bfloat16 for g in expert_grads)
