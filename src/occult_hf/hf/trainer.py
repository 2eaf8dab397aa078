"""HF `Trainer` checkpoints and `resume_from_checkpoint` for occult models, with or without a callback.

Under expert parallelism each rank holds only its experts, while the Trainer writes the model, the
optimizer and the scheduler from rank 0 alone. Three `Trainer` methods that every rank runs at a
save or a resume are wrapped (by `hf.apply.install()`, through
`hf.compat.wrap_trainer_methods`, so importing occult_hf is enough; for a model without
occult_hf applied the wrappers only call the original):

- `save_model` (every rank, at each checkpoint and in the user's final `trainer.save_model()`):
  first `snapshot_experts` gathers all experts to rank 0 (collective), so that rank 0's
  `save_pretrained` writes the vanilla checkpoint; for a PEFT model with rank-local expert adapters,
  after the Trainer's own save `peft_support.save_peft_model` rewrites the adapter with every rank's
  experts (also collective). This hooks the save itself, so callback order does not matter (a
  callback keyed on `control.should_save` ran before `DefaultFlowCallback` had set it).
- `_save_optimizer_and_scheduler` (every rank, checkpoints only, not with `save_only_model`): after
  the Trainer's files, every rank writes `occult_rank{r}-of-{D}.pt` beside them: its rank-local
  expert weights (the vanilla `model.safetensors` holds all experts, but resuming must restore each
  rank's own in its own slots) and its optimizer state (`optimizer.pt` is rank 0's: its expert
  moments are rank 0's experts'). For a PEFT model only the optimizer state: its weights resume
  from the gathered adapter files (cut to each rank's experts by `peft_support`'s load hooks).
- `_load_from_checkpoint` and `_load_optimizer_and_scheduler` (every rank, on
  `resume_from_checkpoint`): the model's non-expert weights come from the vanilla checkpoint, the
  experts and the optimizer state from this rank's file; the scheduler is the Trainer's own (it is
  the same on every rank). A checkpoint written by a different number of EP ranks is an error.

One process (logical devices) uses the same files with `r=0, D=1` (its experts are all experts).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .state import BLOCKS, STATE_ATTR
from .compat import unwrap_trainer_methods, wrap_trainer_methods
from .checkpointing import snapshot_experts
from ..moe import OccultMoE

RANK_FILE = "occult_rank{rank}-of-{world}.pt"
_WRAPPED = ("save_model", "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler")


def _occult_model(model) -> nn.Module | None:
    """The transformers model whose blocks `apply_occult` replaced, inside `model` (a DDP/accelerate/PEFT wrapper or
    itself); None otherwise (transformers' own EP, `apply_occult_ep`, checkpoints through its own Trainer support)."""
    seen = 0
    while model is not None and seen < 8:
        if STATE_ATTR in vars(model):
            return model if vars(model)[STATE_ATTR].front_end == BLOCKS else None
        model = getattr(model, "module", None) or _peft_base(model)
        seen += 1
    return None


def _peft_base(model):
    get_base_model = getattr(type(model), "get_base_model", None)
    return get_base_model(model) if callable(get_base_model) else None


def _ep_rank_world(model) -> tuple[int, int]:
    state = vars(model)[STATE_ATTR]
    return (state.ep.rank, state.ep.num_devices) if state.ep.is_distributed else (0, 1)


def _expert_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent rank-local tensors of every `OccultMoE`'s experts (state-dict names of `model`)."""
    state = {}
    for path, module in model.named_modules():
        if isinstance(module, OccultMoE):
            for name, tensor in module.experts.state_dict(prefix=f"{path}.experts.").items():
                state[name] = tensor.detach().cpu().clone()
    return state


def _rank_file(directory: str, model: nn.Module) -> str:
    rank, world = _ep_rank_world(model)
    return os.path.join(directory, RANK_FILE.format(rank=rank, world=world))


# ----- saving ---------------------------------------------------------------------------------------


def _save_model(original, trainer, output_dir=None, _internal_call=False):
    from .peft_support import has_distributed_expert_adapters, save_peft_model

    model = _occult_model(trainer.model)
    if model is None:
        return original(trainer, output_dir, _internal_call)
    if model is trainer.model:  # a PEFT model saves its adapters alone: no expert gather
        snapshot_experts(model)  # collective under EP; a no-op in one process
    result = original(trainer, output_dir, _internal_call)
    if model is not trainer.model and has_distributed_expert_adapters(trainer.model):
        save_peft_model(trainer.model, output_dir if output_dir is not None else trainer.args.output_dir)
    return result


def _save_optimizer_and_scheduler(original, trainer, output_dir):
    result = original(trainer, output_dir)
    model = _occult_model(trainer.model)
    if model is None:
        return result
    os.makedirs(output_dir, exist_ok=True)
    path = _rank_file(output_dir, model)
    # a PEFT model's weights resume from its (gathered) adapter files; its optimizer state is per rank too
    experts = _expert_state(model) if model is trainer.model else {}
    payload = {"experts": experts, "optimizer": trainer.optimizer.state_dict(), "world": _ep_rank_world(model)}
    temporary = f"{path}.tmp{os.getpid()}"
    torch.save(payload, temporary)
    os.replace(temporary, path)
    return result


# ----- resuming -------------------------------------------------------------------------------------


def _read_rank_file(checkpoint: str, model: nn.Module) -> dict:
    path = _rank_file(checkpoint, model)
    if not os.path.isfile(path):
        present = sorted(name for name in os.listdir(checkpoint) if name.startswith("occult_rank"))
        rank, world = _ep_rank_world(model)
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r}: no {os.path.basename(path)} for EP rank {rank} of {world}; "
            + (f"the checkpoint holds {present} (written by another EP layout)" if present else
               "the checkpoint was saved without optimizer state (save_only_model=True) or without occult_hf")
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def _vanilla_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint's safetensors weights (one file or an index of shards)."""
    from safetensors.torch import load_file

    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"resume_from_checkpoint={checkpoint!r} holds no model.safetensors(.index.json)")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights = {}
    for shard in shards:
        weights.update(load_file(os.path.join(checkpoint, shard)))
    return weights


def _load_from_checkpoint(original, trainer, resume_from_checkpoint, model=None):
    target = _occult_model(model if model is not None else trainer.model)
    if target is None or target is not (model if model is not None else trainer.model):
        return original(trainer, resume_from_checkpoint, model)
    saved = _read_rank_file(resume_from_checkpoint, target)
    experts = saved["experts"]
    own = target.state_dict()
    dense = {k: v for k, v in _vanilla_weights(resume_from_checkpoint).items() if k in own and k not in experts and own[k].shape == v.shape}
    missing_experts = sorted(k for k in own if k not in experts and ".experts." in k and k.startswith(_expert_prefixes(target)))
    if missing_experts:
        raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: the rank file lacks {missing_experts[:3]}")
    result = target.load_state_dict({**dense, **experts}, strict=False)
    runtime = _runtime_names(target)
    unexpected_missing = [k for k in result.missing_keys if k not in runtime and k not in dense and k not in experts]
    if unexpected_missing:
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r}: the checkpoint does not hold {unexpected_missing[:5]}"
        )


def _expert_prefixes(model) -> tuple[str, ...]:
    return tuple(f"{path}.experts." for path, module in model.named_modules() if isinstance(module, OccultMoE))


def _runtime_names(model) -> set[str]:
    return {f"{path}.{name}" for path, m in model.named_modules() if isinstance(m, OccultMoE) for name in m.runtime_state_names()}


def _load_optimizer_and_scheduler(original, trainer, checkpoint):
    result = original(trainer, checkpoint)
    model = _occult_model(trainer.model)
    if checkpoint is None or model is None:
        return result
    trainer.optimizer.load_state_dict(_read_rank_file(checkpoint, model)["optimizer"])
    return result


# ----- install ----------------------------------------------------------------------------------------


def install_trainer_hooks() -> None:
    """Wrap the four `Trainer` methods (idempotent; `uninstall_trainer_hooks` puts them back)."""
    wrap_trainer_methods({
        "save_model": _save_model,
        "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
        "_load_from_checkpoint": _load_from_checkpoint,
        "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    })


def uninstall_trainer_hooks() -> None:
    unwrap_trainer_methods(_WRAPPED)


__all__ = ["RANK_FILE", "install_trainer_hooks", "uninstall_trainer_hooks"]
