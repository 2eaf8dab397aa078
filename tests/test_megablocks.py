"""The MegaBlocks rows' wrapper (`occult_hf.benchmarks.megablocks`) on CPU: transformers' fused expert
weights mapped into MegaBlocks' GLU layout compute the transformers experts' output (MegaBlocks' own
kernels need CUDA: tests/test_gpu_runtime.py (its MegaBlocks test) runs the whole wrapped model), and without MegaBlocks the
row says what is missing."""

import pytest
import torch
from tiny_models import tiny_model

from occult_hf.benchmarks.megablocks import megablocks_expert_weights, megablocks_missing
from occult_hf.patches import adapter_for


def _grouped_glu(x_TH, w1_IH, v1_IH, w2_IH, act):
    """MegaBlocks' `GroupedGLU` for one expert: `(act(x @ w1.T) * (x @ v1.T)) @ w2`."""
    return (act(x_TH @ w1_IH.T) * (x_TH @ v1_IH.T)) @ w2_IH


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek"])
def test_megablocks_layout_computes_the_transformers_experts(family):
    model = tiny_model(family, seed=3)
    adapter = adapter_for(model)
    _, _, block = next(iter(adapter.iter_moe_blocks(model)))
    gate_up_E2IH, down_EHI = adapter.expert_weights(block)
    num_experts, hidden = gate_up_E2IH.shape[0], gate_up_E2IH.shape[2]
    x_TH = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
    first, count = 2, num_experts - 3  # a rank's contiguous share, not starting at expert 0
    w1_LIH, v1_LIH, w2_LIH = megablocks_expert_weights(gate_up_E2IH, down_EHI, first, count)
    assert w1_LIH.shape == v1_LIH.shape == w2_LIH.shape == (count, gate_up_E2IH.shape[1] // 2, hidden)
    with torch.no_grad():
        for local in range(count):
            ids_Tk = torch.full((5, 1), first + local, dtype=torch.int64)
            expected_TH = adapter.experts_module(block)(x_TH, ids_Tk, torch.ones(5, 1))
            actual_TH = _grouped_glu(x_TH, w1_LIH[local], v1_LIH[local], w2_LIH[local], adapter.act_fn(block))
            torch.testing.assert_close(actual_TH, expected_TH, rtol=1e-5, atol=1e-6)


def test_megablocks_layout_rejects_experts_out_of_range_and_unfused_shapes():
    gate_up_E2IH, down_EHI = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    with pytest.raises(ValueError, match=r"experts 3\.\.4 are not among the 4 experts"):
        megablocks_expert_weights(gate_up_E2IH, down_EHI, 3, 2)
    with pytest.raises(ValueError, match=r"\[E, 2I, H\] and \[E, H, I\]"):
        megablocks_expert_weights(gate_up_E2IH, torch.zeros(4, 8, 4), 0, 2)


def test_megablocks_missing_names_what_to_build():
    try:
        import megablocks  # noqa: F401
    except ImportError:
        reason = megablocks_missing()
        assert reason.startswith("the megablocks package is not importable") and "megablocks_src" in reason
    else:
        pytest.skip("megablocks is installed here: the GPU test covers it")
