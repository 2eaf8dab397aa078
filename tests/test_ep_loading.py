"""Per-rank expert loading on the `occult_config` path (`occult_hf.hf.loading`).

On 2 gloo ranks, `from_pretrained(path, occult_config=...)` must give the same model as the eager
single-process load (logits, every local expert weight bit for bit) while each rank reads only the
experts its placement puts on it (replicas included) and the full expert tensors stay on the meta
device; both checkpoint layouts (per-expert keys as `save_pretrained` and published checkpoints
store them, Mixtral's `block_sparse_moe.experts.{e}.w1` renamed by transformers at load included;
transformers 5's fused `gate_up_proj`/`down_proj`), with and without a `device_map` that puts the model
on one device (`"cpu"`, `{"": "cpu"}`: the experts are read onto it). A checkpoint it cannot read per rank
(`.bin`) falls back to the full load with a reason, and is still exact.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from distributed import run_world
from tiny_models import tiny_batch, tiny_checkpoint

CASES = [  # (family, checkpoint layout, placement kind, loaded per rank, device_map)
    ("olmoe", "per_expert", "contiguous", True, None),
    ("qwen2_moe", "fused", "replicated", True, {"": "cpu"}),  # shared experts; replicas read on both holders
    ("mixtral", "per_expert", "contiguous", True, None),  # w1/w3/w2 under block_sparse_moe, renamed by transformers
    ("deepseek_v3", "fused", "shuffled", True, "cpu"),  # dense first layer, group-limited router, shared experts
    ("olmoe", "bin", "contiguous", False, None),  # not safetensors: falls back
]


def _fuse_checkpoint(directory) -> None:
    """Rewrite a per-expert `model.safetensors` as transformers 5's fused layout (gate then up)."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    per_expert = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    grouped: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    fused = {}
    for key, value in tensors.items():
        match = per_expert.fullmatch(key)
        if match is None:
            fused[key] = value
        else:
            grouped.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})[match.group(3)] = value
    for prefix, experts in grouped.items():
        order = sorted(experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        fused[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    save_file(fused, path, metadata={"format": "pt"})


def _placement(model, kind: str, num_devices: int):
    from occult_hf import Placement
    from occult_hf.patches import adapter_for

    adapter = adapter_for(model)
    layers = [layer for layer, _, _ in adapter.iter_moe_blocks(model)]
    num_experts = adapter.num_experts(model.config)
    if kind == "contiguous":
        return Placement.contiguous(num_experts, num_devices, layers)
    base = np.arange(num_experts) * num_devices // num_experts
    maps = {layer: np.random.default_rng(7 + layer).permutation(base).tolist() for layer in layers}
    if kind == "shuffled":
        return Placement(num_experts, num_devices, maps, {"method": "shuffled"})
    replicas = {layer: {e: [(maps[layer][e] + 1) % num_devices] for e in range(2)} for layer in layers}
    return Placement(num_experts, num_devices, maps, {"method": "replicated"}, replicas=replicas)


def _world(rank: int, world_size: int, directories: list[str]) -> list[dict]:
    import occult_hf
    from occult_hf.hf.apply import occult_modules, unapply_occult
    from transformers import AutoModelForCausalLM

    results = []
    for (family, _, kind, per_rank, device_map), directory in zip(CASES, directories):
        eager = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, occult_config=None)
        placement = _placement(eager, kind, world_size)
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, occult_config=occult_hf.OccultConfig(placement=placement), device_map=device_map
        )
        report = model.occult_load_report
        ids = tiny_batch(seed=300 + rank)
        with torch.no_grad():
            want, got = eager(ids).logits, model(ids).logits
        eager_params = dict(eager.named_parameters())
        weights_equal, meta_only, local_bytes = True, True, 0
        for path, module in occult_modules(model).items():
            layer = module.layer_idx
            ids_L = module.local_experts.expert_ids.tolist()
            assert ids_L == placement.experts_on(layer, rank), (family, layer, ids_L)
            gate_up, down = module.adapter.expert_weights(eager.get_submodule(path))
            weights_equal &= torch.equal(module.local_experts.gate_up_proj, gate_up[ids_L])
            weights_equal &= torch.equal(module.local_experts.down_proj, down[ids_L])
            local_bytes += sum(p.numel() * p.element_size() for p in (gate_up[ids_L], down[ids_L]))
            meta_only &= all(p.is_meta for p in module.original_block.experts.parameters())
            assert not module.local_experts.gate_up_proj.is_meta
        expert_prefixes = tuple(f"{path}.experts." for path in occult_modules(model))  # checked above
        dense_equal = all(
            torch.equal(param, eager_params[name])
            for name, param in model.named_parameters()
            if name in eager_params and not name.startswith(expert_prefixes)
        )
        saved_report = None
        if family == "olmoe" and per_rank:  # a checkpoint saved under EP stores its occult_config: read per rank without the keyword
            model.save_pretrained(f"{directory}_ep")  # collective; rank 0 writes
            torch.distributed.barrier()
            reloaded = AutoModelForCausalLM.from_pretrained(f"{directory}_ep", dtype=torch.float32)
            with torch.no_grad():
                reloaded_err = float((reloaded(ids).logits - want).abs().max())
            saved_report = (reloaded.occult_load_report.fallback_reason, reloaded.occult_load_report.experts_read, reloaded_err)
            del reloaded
        unapply_occult(model)  # collective: every rank gets the full original blocks back
        with torch.no_grad():
            restored_err = float((model(ids).logits - want).abs().max())
        results.append(
            dict(
                restored_err=restored_err,
                saved_report=saved_report,
                family=family,
                max_err=float((got - want).abs().max()),
                weights_equal=bool(weights_equal),
                dense_equal=dense_equal,
                meta_only=bool(meta_only),
                fallback=report.fallback_reason,
                experts_read=report.experts_read,
                want_read={layer: placement.experts_on(layer, rank) for layer in report.experts_read},
                bytes_read=report.expert_bytes_read,
                local_bytes=local_bytes,
            )
        )
    return results


@pytest.mark.world_size(2)
def test_each_rank_reads_only_its_experts_and_equals_the_eager_model(tmp_path):
    directories = []
    for family, layout, _, _, _ in CASES:
        directory = tiny_checkpoint(family, tmp_path / f"{family}_{layout}")
        if layout == "fused":
            _fuse_checkpoint(directory)
        if layout == "bin":
            from safetensors.torch import load_file

            torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
            (directory / "model.safetensors").unlink()
        directories.append(str(directory))
    for rank, results in enumerate(run_world(_world, 2, directories)):
        for (family, layout, kind, per_rank, _), result in zip(CASES, results):
            case = json.dumps(result, default=str)
            assert result["max_err"] <= 1e-5 and result["restored_err"] <= 1e-5 and result["weights_equal"] and result["dense_equal"], case
            if per_rank:  # read exactly this rank's experts (replicas included), never the full tensors
                assert result["fallback"] is None and result["meta_only"], case
                assert result["experts_read"] == result["want_read"] and result["experts_read"], case
                assert result["bytes_read"] == result["local_bytes"], case
                if family == "olmoe":
                    fallback, read, err = result["saved_report"]
                    assert fallback is None and read == result["want_read"] and err <= 1e-5, case
            else:  # a layout it does not know: the full load, with the reason logged
                assert result["fallback"] and not result["meta_only"] and not result["experts_read"], case
    # the save under EP keeps the layout it was loaded from (the published per-expert keys), as one process does: it
    # was written fused, transformers' expert conversions being dropped when occult_hf read the experts' keys
    assert _tensor_shapes(f"{directories[0]}_ep") == _tensor_shapes(directories[0])


def _tensor_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    from pathlib import Path

    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


def test_device_maps_that_put_the_model_on_one_device_are_read_per_rank():
    from occult_hf.hf.loading import device_of_map

    for device_map, device in ((None, None), ("cpu", "cpu"), ({"": "cpu"}, "cpu"), ({"": "cuda:1"}, "cuda:1"), (1, "cuda:1"),
                               ({"model": "cpu", "lm_head": "cpu"}, "cpu"), (torch.device("cpu"), "cpu"), ({"": 0}, "cuda:0")):  # fmt: skip
        found, reason = device_of_map(device_map)
        assert reason is None and (found is None if device is None else found == torch.device(device)), device_map
    for device_map in ("auto", "balanced", {"model": "cpu", "lm_head": "disk"}, {"model": 0, "lm_head": 1}):
        found, reason = device_of_map(device_map)
        assert found is None and "does not put the whole model on one device" in reason and "cuda:<local rank>" in reason


def test_allocator_warmup_leaves_out_the_routed_experts(monkeypatch):
    """With a device_map on a GPU, transformers first allocates one block the size of every parameter the map
    puts there (`caching_allocator_warmup`); under per-rank loading the routed experts are left out of it."""
    import transformers.modeling_utils as modeling_utils
    from tiny_models import tiny_model

    from occult_hf.hf.compat import skip_allocator_warmup_for
    from occult_hf.hf.loading import _routed_expert_filter

    seen = []
    monkeypatch.setattr(modeling_utils, "caching_allocator_warmup", lambda model, device_map, quantizer: seen.append(device_map))
    model = tiny_model("qwen2_moe")  # shared experts and a dense layer: only the routed experts are left out
    names = dict.fromkeys((name for name, _ in model.named_parameters()), "cuda:0")
    with skip_allocator_warmup_for(_routed_expert_filter()):
        modeling_utils.caching_allocator_warmup(model, names, None)
    modeling_utils.caching_allocator_warmup(model, names, None)  # put back after the block
    routed = {name for name in names if ".mlp.experts." in name}
    assert routed and set(seen[0]) == set(names) - routed and seen[1] == names
    assert any("shared_expert" in name for name in seen[0])


def _base_model_and_stored_count(rank: int, world_size: int, head_checkpoint: str, one_process_save: str) -> dict:
    import occult_hf  # noqa: F401  (from_pretrained takes occult_config=)
    from transformers import AutoModel

    base = AutoModel.from_pretrained(head_checkpoint, dtype=torch.float32, occult_config={"num_devices": world_size})
    eager = AutoModel.from_pretrained(head_checkpoint, dtype=torch.float32, occult_config=None)
    ids = tiny_batch(seed=40 + rank)
    with torch.no_grad():
        err = float((base(ids).last_hidden_state - eager(ids).last_hidden_state).abs().max())
    report = base.occult_load_report
    try:
        AutoModel.from_pretrained(one_process_save, dtype=torch.float32)
        stored_error = None
    except ValueError as error:
        stored_error = str(error)
    return dict(fallback=report.fallback_reason, read=report.experts_read, err=err, stored_error=stored_error)


@pytest.mark.world_size(2)
def test_a_base_model_reads_per_rank_and_a_stored_device_count_is_checked_first(tmp_path):
    """`AutoModel` (the base model, whose module paths lack the head's `model.` prefix) of a `*ForCausalLM`
    checkpoint reads only this rank's experts (it had read every expert, reporting "0 per-expert tensors"); a
    checkpoint saved in one process (stored num_devices 1) loaded on 2 ranks is refused before any expert is read,
    naming the stored config and the way out (it had failed in apply_occult after every rank read every expert)."""
    from occult_hf import OccultConfig, apply_occult
    from tiny_models import tiny_model

    head = tiny_checkpoint("olmoe", tmp_path / "olmoe")
    apply_occult(tiny_model("olmoe", seed=1), OccultConfig()).save_pretrained(tmp_path / "one_process")
    for rank, result in enumerate(run_world(_base_model_and_stored_count, 2, str(head), str(tmp_path / "one_process"))):
        assert result["fallback"] is None and result["read"] == {0: [4 * rank + e for e in range(4)], 1: [4 * rank + e for e in range(4)]}, result
        assert result["err"] <= 1e-5, result
        assert "the occult_config the checkpoint stores (config.json) has num_devices (1) must equal the expert-parallel group size (2)" in result["stored_error"], result
        assert "occult_config=None" in result["stored_error"], result
