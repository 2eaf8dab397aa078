"""A state dict of the local experts loads only into the placement it was saved with (2 gloo ranks).

Under EP each rank's `experts.gate_up_proj` / `down_proj` hold the experts its placement gives it, in local-slot
order, so two placements with equal capacity give state dicts of the same keys and shapes: before, rank r's
`state_dict()` of one placement loaded into a model of another without a word, every expert's weights in another
expert's slot. `LocalExperts` now records its slot order in the state dict's metadata and refuses another one,
also after `torch.save` / `torch.load`, and a stock model's state dict (experts in original order).
"""

from __future__ import annotations

import io

import pytest

from distributed import run_world
from tiny_models import MOE_LAYERS, tiny_model


def _models_and_loads(rank, world_size):
    import torch

    from occult_hf import OccultConfig, Placement, apply_occult

    swapped = {layer: [1, 0, 0, 1, 1, 0, 1, 0] for layer in MOE_LAYERS["olmoe"]}
    contiguous = apply_occult(tiny_model("olmoe", seed=1), OccultConfig(placement="contiguous"))
    other = apply_occult(tiny_model("olmoe", seed=2), OccultConfig(placement=Placement(8, world_size, swapped)))

    def load(target, state_dict):
        try:
            target.load_state_dict(state_dict)
            return "loaded"
        except RuntimeError as error:
            return str(error)

    def load_assigned(target, state_dict):
        try:
            target.load_state_dict(state_dict, assign=True)
            return "loaded"
        except RuntimeError as error:
            return str(error)

    saved = io.BytesIO()
    torch.save(contiguous.state_dict(), saved)
    saved.seek(0)
    return {
        "same placement": load(contiguous, contiguous.state_dict()),
        "another placement": load(other, contiguous.state_dict()),
        "another placement, through torch.save": load(other, torch.load(saved, weights_only=True)),
        "a stock model's": load(contiguous, tiny_model("olmoe", seed=1).state_dict()),
        "a plain dict (unchecked)": load(contiguous, dict(contiguous.state_dict())),
        "a plain dict with assign=True": load_assigned(other, dict(other.state_dict())),  # torch adds a metadata key
    }


@pytest.mark.world_size(2)
def test_a_state_dict_loads_only_into_its_own_placement():
    for rank, results in enumerate(run_world(_models_and_loads, 2)):
        held = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}[rank]
        other = {0: [1, 2, 5, 7], 1: [0, 3, 4, 6]}[rank]
        assert results["same placement"] == "loaded" and results["a plain dict (unchecked)"] == "loaded", results
        assert results["a plain dict with assign=True"] == "loaded", results
        for case in ("another placement", "another placement, through torch.save"):
            assert (
                f"model.layers.0.mlp.experts: the state dict was saved with another placement: its local slots held "
                f"experts {held}, this model's hold {other}; load it into a model with the same placement" in results[case]
            ), (rank, case, results[case])
        assert (
            "model.layers.0.mlp.experts: the state dict holds routed experts in their original order (a model without "
            f"occult_hf's blocks?) but this model's local slots hold experts {held}" in results["a stock model's"]
        ), results["a stock model's"]
