"""The tiny models every family-driven test uses: one per registered family, and fit for a 1e-5 comparison.

The exactness tests compare fp32 gradients at relative error 1e-5 against transformers' model; that
only tests occult_hf if the tiny model's gradients do not themselves amplify fp32 rounding (any
reordering of the same sums, which expert parallelism does, moves its inputs by about 1e-7).
"""

from __future__ import annotations

import pytest
import torch

from occult_hf.patches import registered_adapters
from tiny_models import FAMILIES, TINY_FAMILIES, tiny_batch, tiny_model

INPUT_CHANGE = 1e-7
# half the exactness tests' tolerance: what rounding in the model's input may move a gradient by
GRADIENT_CHANGE_BOUND = 5e-6


def test_every_registered_family_has_a_tiny_config():
    assert set(FAMILIES) == set(registered_adapters()) == set(TINY_FAMILIES)


def _gradients(model, ids_BS: torch.Tensor, input_scale: float) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    hook = model.get_input_embeddings().register_forward_hook(lambda _module, _inputs, embedded: embedded * input_scale)
    model(input_ids=ids_BS, labels=ids_BS).loss.backward()
    hook.remove()
    return {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_do_not_amplify_rounding_in_the_input(family):
    """A 1e-7 relative change of the input embeddings moves every gradient by < 5e-6 relative (max-abs)."""
    for seed in range(3):
        model = tiny_model(family, seed=seed).train()
        for batch_seed in range(3):
            ids_BS = tiny_batch(seed=500 + batch_seed)
            exact = _gradients(model, ids_BS, 1.0)
            nudged = _gradients(model, ids_BS, 1.0 + INPUT_CHANGE)
            for name, grad in exact.items():
                change = float((nudged[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30))
                assert change < GRADIENT_CHANGE_BOUND, (
                    f"tiny {family} (seed {seed}, batch {batch_seed}): the gradient of {name} moves by {change:.1e} "
                    f"under a {INPUT_CHANGE:.0e} change of the input; the 1e-5 exactness tests would compare rounding "
                    f"noise: condition its weights in TINY_FAMILIES (tests/tiny_models.py)"
                )
