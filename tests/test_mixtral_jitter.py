"""Mixtral's training-time `router_jitter_noise` trains through the replacement block as through the stock one.

Its block scales its input by uniform noise before routing and the experts; occult_hf refused training with it (and
the error's advice, setting `config.router_jitter_noise=0`, did not reach a built block). The adapter's `block_input`
now draws the same noise with the same call, so with the same seed the loss and every gradient equal stock's.
"""

from __future__ import annotations

import copy

import torch

from tiny_models import tiny_batch, tiny_model


def _loss_and_grads(model, ids):
    torch.manual_seed(7)  # the noise's draw
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_jitter_noise_trains_as_in_stock():
    from occult_hf import OccultConfig, apply_occult

    stock = tiny_model("mixtral", seed=5, router_jitter_noise=0.2).train()
    occult = apply_occult(copy.deepcopy(stock), OccultConfig(num_devices=2)).train()
    ids = tiny_batch(seed=6)
    loss, grads = _loss_and_grads(stock, ids)
    occult_loss, occult_grads = _loss_and_grads(occult, ids)
    assert torch.allclose(occult_loss, loss, rtol=1e-6)
    assert set(occult_grads) == set(grads)
    for name, grad in grads.items():
        assert torch.allclose(occult_grads[name], grad, rtol=1e-4, atol=1e-7), name
    torch.manual_seed(8)
    noisy_again = occult(input_ids=ids, labels=ids).loss.detach()
    assert not torch.equal(noisy_again, occult_loss)  # the noise is drawn anew each forward: it is applied
