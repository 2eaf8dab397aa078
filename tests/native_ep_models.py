"""Models and checks shared by the tests of transformers' own expert parallelism with occult_hf (`ep_implementation=
"occult"`): the ranks' batches, a placement that moves experts across ranks, the EP load of a tiny checkpoint, a
similarity-pruning profile, and the relative error the exactness tests hold to."""

from __future__ import annotations

import numpy as np
import torch

from tiny_models import MOE_LAYERS, tiny_batch

#: relative error of the exactness tests (fp32)
TOLERANCE = 1e-5
#: routed experts of the tiny checkpoints these tests build
NUM_EXPERTS = 8


def rel_err(actual, expected: torch.Tensor) -> float:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def rank_batch(rank: int) -> torch.Tensor:
    return tiny_batch(seed=700 + rank)


def shuffled_placement(family: str, num_devices: int = 2, devices_per_node: int | None = None):
    """An equal-capacity placement that moves experts across devices in every MoE layer."""
    from occult_hf import Placement

    base = np.arange(NUM_EXPERTS) * num_devices // NUM_EXPERTS
    maps = {layer: np.random.default_rng(31 + layer).permutation(base).tolist() for layer in MOE_LAYERS[family]}
    return Placement(NUM_EXPERTS, num_devices, maps, {"method": "shuffled"}, devices_per_node=devices_per_node)


def load_ep(path, **distributed):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(ep_implementation="occult", **distributed)
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32)


def similarity_profile(path, out):
    """A routing profile (router-logit Gram matrices for the similarity table) of the checkpoint's model."""
    from transformers import AutoModelForCausalLM

    from occult_hf import RoutingProfile

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, occult_config=None)
    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(2)]
    RoutingProfile.collect(model, documents, progress=False).save(out)
    return out
