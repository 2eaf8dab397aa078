"""transformers' weight initialisation reaches the routed experts after `apply_occult` as it reaches stock's.

Before, `model.apply(model._init_weights)` (a re-initialisation) left the routed experts of every family with
their old values, and Qwen3-Next's routers too (its init names the block class); `hf.weight_init` fixes both
while `init_weights()` on an initialised model still leaves every weight alone, as stock does.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import FAMILIES, tiny_model

MARK = 7.0


def _untouched_after(family: str, occult: bool, how: str) -> list[str]:
    """The parameters still all `MARK` after `how` re-initialises a model whose parameters are all `MARK`."""
    from occult_hf import OccultConfig, apply_occult

    model = tiny_model(family, seed=1)
    if occult:
        apply_occult(model, OccultConfig(num_devices=2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(MARK)
    if how != "init_weights of an initialised model":  # forget transformers' marks of what is initialised
        for tensor_or_module in [*model.parameters(), *model.modules()]:
            tensor_or_module.__dict__.pop("_is_hf_initialized", None)
    if how == "apply(_init_weights)":
        model.apply(model._init_weights)
    else:
        model.init_weights()
    return sorted(name for name, p in model.named_parameters() if bool((p == MARK).all()))


@pytest.mark.parametrize("how", ["apply(_init_weights)", "init_weights", "init_weights of an initialised model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reinitialisation_reaches_what_it_reaches_in_stock(family, how):
    stock = _untouched_after(family, occult=False, how=how)
    assert _untouched_after(family, occult=True, how=how) == stock
    if how == "init_weights of an initialised model":
        assert any(".experts." in name for name in stock)  # the case where the experts must be left alone
    else:
        assert not [name for name in stock if ".experts." in name or ".gate." in name]


def test_unapply_takes_the_init_weights_off():
    from occult_hf import OccultConfig, apply_occult, unapply_occult

    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=2))
    assert "_init_weights" in vars(model) and "_init_weights" in vars(model.model)
    unapply_occult(model)
    assert "_init_weights" not in vars(model) and "_init_weights" not in vars(model.model)
