"""HF `Trainer` checkpoints and `resume_from_checkpoint` for occult models, with or without a callback.

Under expert parallelism each rank holds only its experts, while the Trainer writes the model, the
optimizer and the scheduler from rank 0 alone. The `Trainer` methods that every rank runs at a
save, a resume or the end's load of the best model are wrapped (by `hf.apply.install()`, through
`hf.compat.wrap_when_imported`, so importing occult_hf is enough; for a model without
occult_hf applied the wrappers only call the original):

- `create_optimizer`: the grad-norm carriers are made trainable first (peft freezes them), so the optimizer holds
  them and a GradScaler unscales and checks them on every rank.
- `save_model` (every rank, at each checkpoint and in the user's final `trainer.save_model()`):
  first `snapshot_experts` gathers all experts to rank 0 (collective), so that rank 0's
  `save_pretrained` writes the vanilla checkpoint; for a PEFT model with rank-local expert adapters,
  `peft_support.snapshot_adapters` gathers every rank's expert adapters (also collective), which rank
  0's `PeftModel.save_pretrained` inside the Trainer's save writes. This hooks the save itself, so callback order does not matter (a
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
- `_load_best_model` (`load_best_model_at_end`): the best checkpoint is loaded as a resume loads one. transformers
  reads its safetensors under the saved keys, whose experts are the converted per-expert ones, so (for stock models
  too) the experts would keep their last values.

One process (logical devices) uses the same files with `r=0, D=1` (its experts are all experts).

**Pushes to the Hub** (`push_to_hub`, `_push_from_checkpoint` and `create_model_card` are wrapped for models of
either front end): the Trainer uploads its output folder whole, so a killed save's staging folder is removed first,
the repository's weight files the new save replaced are deleted after the upload (as `hf.hub` does for
`model.push_to_hub`), and a push during training (`hub_strategy`) carries occult_hf's files and the card's section,
and, for `hub_strategy="checkpoint"`, a checkpoint already marked complete.

**A checkpoint is complete before anything is rotated.** `_save_checkpoint` (every rank) is wrapped too:
the checkpoint's first file is `occult_checkpoint.json` saying it is incomplete; the Trainer's own
rotation of old checkpoints is held back while the files are written; then every EP rank reports its
rank file (`agreement.arrive`, bounded by `OCCULT_SAVE_TIMEOUT_S`: rank 0 may still be writing the
model), and only then does rank 0 mark the checkpoint complete and rotate, counting complete
checkpoints only. A rank that fails, stalls or dies before reporting leaves the checkpoint marked
incomplete and the others raise naming it, so the older complete checkpoints are never rotated away
for it. The complete status lists each rank file with its size, so a rank file removed or truncated
after the save makes the checkpoint unusable too, and so does a status file that cannot be read or is
malformed. `train(resume_from_checkpoint=True)` resumes from the last whole checkpoint, saying which ones
it skipped and why; resuming from an unusable one by path is an error naming what is missing or changed.
Each rank file records the step it was saved at: one copied from another checkpoint, or one that
`torch.load` cannot read, is an error at the resume naming the file and the checkpoint.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .state import BLOCKS, STATE_ATTR
from .compat import checkpoint_key_renamer, unwrap_when_imported, wrap_when_imported
from .ddp import enable_grad_norm_carriers
from .checkpointing import (
    PROFILE_FILENAME, STAGING_PREFIX, describe_in_card, replaced_weight_files, snapshot_experts, weight_files,
)
from .hub import remove_replaced_weights
from .peft_support import snapshot_adapters
from ..distributed.agreement import SAVE_TIMEOUT_ENV, announce_failure, arrive, save_timeout_s
from ..moe import OccultMoE
from ..placement import PLACEMENT_FILENAME
from ..utils.atomic import atomic_torch_save, atomic_write_json
from ..utils.logging import get_logger
from ..utils.strict_json import json_kind, read_json_file

logger = get_logger(__name__)

RANK_FILE = "occult_rank{rank}-of-{world}.pt"
#: a Trainer checkpoint's completeness: `{"complete": false, "ranks": D}` while it is written, then `"complete": true`
CHECKPOINT_STATUS_FILE = "occult_checkpoint.json"


def _occult_model(model) -> nn.Module | None:
    """The transformers model whose blocks `apply_occult` replaced, inside `model` (a DDP/accelerate/PEFT wrapper or
    itself); None otherwise (transformers' own EP, `apply_occult_ep`, checkpoints through its own Trainer support)."""
    model = _configured_model(model)
    return model if model is not None and vars(model)[STATE_ATTR].front_end == BLOCKS else None


def _configured_model(model) -> nn.Module | None:
    """The transformers model occult_hf configured (either front end) inside `model` (a wrapper or itself), else None."""
    seen = 0
    while model is not None and seen < 8:
        if STATE_ATTR in vars(model):
            return model
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


def _held_experts(model: nn.Module) -> dict[str, list[int]]:
    """Every `OccultMoE`'s local experts (the global id in each slot): what a rank file's tensors are of."""
    return {path: module.local_experts.expert_ids.tolist() for path, module in model.named_modules() if isinstance(module, OccultMoE)}


def _rank_file(directory: str, model: nn.Module) -> str:
    rank, world = _ep_rank_world(model)
    return os.path.join(directory, RANK_FILE.format(rank=rank, world=world))


# ----- saving ---------------------------------------------------------------------------------------


def _save_model(original, trainer, output_dir=None, _internal_call=False):
    model = _occult_model(trainer.model)
    if model is None:
        return original(trainer, output_dir, _internal_call)
    if model is trainer.model:  # collective under EP; a no-op in one process
        snapshot_experts(model)
    else:  # a PEFT model saves its adapters alone: every rank's expert adapters, no expert gather
        snapshot_adapters(trainer.model)
    return original(trainer, output_dir, _internal_call)


def _save_optimizer_and_scheduler(original, trainer, output_dir):
    result = original(trainer, output_dir)
    model = _occult_model(trainer.model)
    if model is None:
        return result
    os.makedirs(output_dir, exist_ok=True)
    # a PEFT model's weights resume from its (gathered) adapter files; its optimizer state is per rank too
    experts = _expert_state(model) if model is trainer.model else {}
    payload = {"experts": experts, "optimizer": trainer.optimizer.state_dict(), "world": _ep_rank_world(model),
               "held_experts": _held_experts(model), "global_step": trainer.state.global_step}  # fmt: skip
    atomic_torch_save(payload, _rank_file(output_dir, model))
    return result


def _save_checkpoint(original, trainer, model, trial=None):
    """The Trainer's checkpoint, marked incomplete until every EP rank's files are in; rotation only after."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    occult = _occult_model(trainer.model)
    if occult is None:
        return original(trainer, model, trial)
    run_dir = trainer._get_output_dir(trial=trial)
    output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    rank, world = _ep_rank_world(occult)
    if trainer.args.should_save:
        _write_status(output_dir, {"complete": False, "ranks": world, "rank_files": not trainer.args.save_only_model})
    limit, trainer.args.save_total_limit = trainer.args.save_total_limit, None  # no rotation until it is complete
    push, trainer.args.push_to_hub = trainer.args.push_to_hub, False  # no push of it either
    try:
        result = original(trainer, model, trial)
    except Exception as error:  # the other ranks stop at once instead of waiting for this rank's report
        _announce(occult, error, f"the Trainer checkpoint {os.path.basename(output_dir)}")
        raise
    finally:
        trainer.args.save_total_limit, trainer.args.push_to_hub = limit, push
    rank_files = _reports(occult, output_dir)
    if trainer.args.should_save:
        _write_status(output_dir, {"complete": True, "ranks": world, "rank_files": rank_files})
    if push:  # `hub_strategy="checkpoint"` uploads the checkpoint too: a resume from it needs the complete status
        trainer._push_from_checkpoint(output_dir)
    if trainer.args.should_save:
        _rotate(run_dir, limit, trainer.state.best_model_checkpoint)
    return result


def _reports(model, output_dir: str) -> dict[str, int]:
    """Collective (EP): `{rank file: bytes}` of every EP rank's file of this checkpoint (empty without optimizer
    state), once every rank has written its own; an error naming the ranks that do not report in time."""
    path = _rank_file(output_dir, model)
    own = {os.path.basename(path): os.path.getsize(path)} if os.path.isfile(path) else {}
    state = vars(model)[STATE_ATTR]
    if not state.ep.is_distributed:
        return own
    name = os.path.basename(output_dir)
    reports = arrive(
        state.ep.group, f"the Trainer checkpoint {name}", save_timeout_s(), SAVE_TIMEOUT_ENV, own,
        advice=f"{name} stays marked incomplete ({CHECKPOINT_STATUS_FILE}); no older checkpoint was rotated away, and "
        f"resume_from_checkpoint=True resumes from the last complete one",
    )  # fmt: skip
    return {file: size for report in reports.values() for file, size in report.items()}


def _announce(model, error: Exception, operation: str) -> None:
    """Tell the other EP ranks, waiting at `operation`'s meeting, that this rank failed at it (no-op in one process)."""
    state = vars(model)[STATE_ATTR]
    if state.ep.is_distributed:
        announce_failure(error, operation, state.ep.group)


def _write_status(checkpoint: str, status: dict) -> None:
    os.makedirs(checkpoint, exist_ok=True)
    atomic_write_json(os.path.join(checkpoint, CHECKPOINT_STATUS_FILE), status)


def unusable_because(checkpoint: str) -> str | None:
    """Why a checkpoint cannot be resumed ("its save did not finish: it lacks ...", "its rank files changed after
    the save: ..." or "its status file ..." when that cannot be read or is malformed), None when it is whole or was
    not written under occult_hf's hooks (no `occult_checkpoint.json`). Never raises: a damaged checkpoint is one
    that `resume_from_checkpoint=True` skips, not one that stops it from finding the last whole one."""
    path = os.path.join(checkpoint, CHECKPOINT_STATUS_FILE)
    if not os.path.lexists(path):
        return None
    try:
        status = read_json_file(path, "status file")
    except (OSError, ValueError) as error:  # unreadable, not a file, not JSON (JSONInputError is a ValueError)
        return f"its status file cannot be read: {error}"
    problem = _status_problem(status)
    if problem is not None:
        return f"its status file {CHECKPOINT_STATUS_FILE} is malformed: {problem}"
    if status["complete"]:
        changed = _changed_since_saved(checkpoint, status.get("rank_files"))
        return f"its rank files changed after the save: {', '.join(changed)}" if changed else None
    present = set(os.listdir(checkpoint))
    ranks = status["ranks"] if status.get("rank_files") is not False else 0
    missing = [name for name in (RANK_FILE.format(rank=r, world=ranks) for r in range(ranks)) if name not in present]
    if "trainer_state.json" not in present:
        missing.append("trainer_state.json")
    if not present & {"model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"}:
        missing.append("the model weights")
    missing = missing or ["the ranks' confirmation that every file was written (a rank stopped during the save)"]
    return f"its save did not finish: it lacks {', '.join(missing)}"


def _status_problem(status) -> str | None:
    """What in a parsed status file is not as `_save_checkpoint` writes it (a hand edit, a damaged copy), else None:
    `{"complete": bool, "ranks": D >= 1, "rank_files": {file: bytes}}` once complete, with `rank_files` a bool (rank
    files expected) while incomplete; `rank_files` may be absent (older occult_hf listed no sizes)."""
    if not isinstance(status, dict):
        return f"it holds {json_kind(status)}, not an object"
    complete, ranks, rank_files = status.get("complete"), status.get("ranks"), status.get("rank_files")
    if not isinstance(complete, bool):
        return f'"complete" is {_field(status, "complete")}, not true or false'
    if type(ranks) is not int or ranks < 1:
        return f'"ranks" is {_field(status, "ranks")}, not a positive number of EP ranks'
    if not complete:
        expected = rank_files is None or isinstance(rank_files, bool)
        return None if expected else f'"rank_files" is {_field(status, "rank_files")}, not true or false'
    if "rank_files" not in status:
        return None
    if not isinstance(rank_files, dict):
        return f'"rank_files" is {_field(status, "rank_files")}, not an object of rank files and their bytes'
    for name, size in rank_files.items():
        if type(size) is not int or size < 0:
            return f'"rank_files" gives {name} {_field(rank_files, name)} bytes, not a number of bytes'
    return None


def _field(parsed: dict, key: str) -> str:
    """`parsed[key]` as the file spells it, cut short (a message quotes a field, not the whole file), or "missing"."""
    if key not in parsed:
        return "missing"
    text = json.dumps(parsed[key])
    return text if len(text) <= 60 else f"{text[:60]}..."


def _changed_since_saved(checkpoint: str, rank_files) -> list[str]:
    """The rank files a complete checkpoint's status lists (`{file: bytes}`) that are gone or of another size now:
    removed or truncated after the save, they would fail the resume half-way."""
    changed = []
    for name, size in (rank_files or {}).items():
        file = os.path.join(checkpoint, name)
        if not os.path.isfile(file):
            changed.append(f"{name} is gone (the save wrote {size} bytes)")
        elif os.path.getsize(file) != size:
            changed.append(f"{name} has {os.path.getsize(file)} bytes (the save wrote {size})")
    return changed


def last_complete_checkpoint(output_dir: str) -> tuple[str | None, dict[str, str]]:
    """`(the last whole checkpoint-N of output_dir or None, {unusable checkpoint: why})`."""
    from transformers.trainer_utils import sort_checkpoints

    unusable, last = {}, None
    for checkpoint in sort_checkpoints(output_dir):  # by step, oldest first
        why = unusable_because(checkpoint)
        if why is None:
            last = checkpoint
        else:
            unusable[checkpoint] = why
    return last, unusable


def _rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    """transformers' rotation (`trainer_utils.rotate_checkpoints`: keep the newest `limit`, the newest and the best
    always) over the complete checkpoints only; an incomplete one is neither counted nor removed."""
    from transformers.trainer_utils import sort_checkpoints

    if limit is None or limit <= 0:
        return
    complete = [c for c in sort_checkpoints(run_dir, use_mtime=True) if unusable_because(c) is None]
    protected = {complete[-1], *([str(Path(best))] if best else [])} if complete else set()
    remaining = len(complete)
    for checkpoint in complete:
        if remaining <= max(limit, len(protected)):
            break
        if checkpoint not in protected:
            shutil.rmtree(checkpoint, ignore_errors=True)
            remaining -= 1


# ----- resuming -------------------------------------------------------------------------------------


def _train(original, trainer, resume_from_checkpoint=None, *args, **kwargs):
    """`resume_from_checkpoint=True` resumes from the last complete checkpoint (transformers takes the last one)."""
    if resume_from_checkpoint is True and _occult_model(trainer.model) is not None:
        last, unusable = last_complete_checkpoint(trainer.args.output_dir)
        for checkpoint, why in unusable.items():
            logger.warning("occult_hf: skipping %s: %s", checkpoint, why)
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=True: no complete checkpoint in {trainer.args.output_dir!r}"
                + (f"; {_listing(unusable)}" if unusable else "")
            )
        resume_from_checkpoint = last
    return original(trainer, resume_from_checkpoint, *args, **kwargs)


def _check_complete(checkpoint: str) -> None:
    why = unusable_because(checkpoint)
    if why is not None:
        advice = _resume_instead(checkpoint)
        raise ValueError(f"resume_from_checkpoint={checkpoint!r}: the checkpoint cannot be resumed, {why}; {advice}")


def _resume_instead(checkpoint: str) -> str:
    """What to do when `checkpoint` cannot be resumed: resume from the last complete checkpoint beside it (another
    one: a checkpoint whose status is whole can still hold a rank file that is not its own)."""
    from transformers.trainer_utils import sort_checkpoints

    output_dir = os.path.dirname(os.path.abspath(checkpoint))
    own = os.path.realpath(checkpoint)
    complete = [c for c in sort_checkpoints(output_dir) if os.path.realpath(c) != own and unusable_because(c) is None]
    if not complete:
        return "its folder holds no other complete checkpoint"
    return f"resume from {complete[-1]!r}, the last complete one"


def _listing(unusable: dict[str, str]) -> str:
    return "; ".join(f"{os.path.basename(c)}: {why}" for c, why in list(unusable.items())[:8])


def _read_rank_file(checkpoint: str, model: nn.Module) -> dict:
    path = _rank_file(checkpoint, model)
    if not os.path.isfile(path):
        present = sorted(name for name in os.listdir(checkpoint) if name.startswith("occult_rank") and name.endswith(".pt"))
        rank, world = _ep_rank_world(model)
        layout = f"-of-{world}.pt"
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r}: no {os.path.basename(path)} for EP rank {rank} of {world}; "
            + (f"the checkpoint holds {present}: rank {rank}'s save of it did not finish" if any(p.endswith(layout) for p in present) else
               f"the checkpoint holds {present} (written by another EP layout)" if present else
               "the checkpoint was saved without optimizer state (save_only_model=True) or without occult_hf")
        )  # fmt: skip
    payload = _load_rank_payload(path, checkpoint)
    _check_step(path, checkpoint, payload)
    held, saved = _held_experts(model), payload.get("held_experts")
    if saved != held:  # its experts' weights and optimizer state would load into other experts' slots
        layer = next((path for path in held if (saved or {}).get(path) != held[path]), None)
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} was written with another placement: at {layer} this rank held experts "
            f"{None if saved is None else saved.get(layer)} and now holds {held.get(layer)}; resume with the checkpoint's "
            f"own occult_config (its config.json), or start a new run from its weights (from_pretrained)"
        )
    return payload


def _load_rank_payload(path: str, checkpoint: str) -> dict:
    """A rank file's payload. A file that torch.load cannot read (damaged in a copy, of the size the status lists) or
    that holds something else is an error naming the file and the checkpoint: torch's own names neither, and for
    some damage advises `weights_only=False`, which runs whatever the file holds."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a damaged file raises RuntimeError, EOFError, IndexError, KeyError...
        problem = f"torch.load cannot read it ({_torch_error(error)})"
    else:
        if isinstance(payload, dict) and {"experts", "optimizer"} <= payload.keys():
            return payload
        kind = "dict without 'experts' and 'optimizer'" if isinstance(payload, dict) else type(payload).__name__
        problem = f"it holds a {kind}, not the experts and optimizer state of an EP rank"
    raise ValueError(
        f"resume_from_checkpoint={checkpoint!r}: rank file {os.path.basename(path)} is damaged: {problem}; "
        f"{_resume_instead(checkpoint)}"
    )


def _torch_error(error: Exception) -> str:
    """The error's type and its first sentence, which is dropped where it is about `weights_only` (the file is damaged,
    loading it unsafely is no cure)."""
    first = str(error).split(". ")[0].splitlines()[0][:160] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}" if first and "weights_only" not in first else type(error).__name__


def _check_step(path: str, checkpoint: str, payload: dict) -> None:
    """A rank file holds the step it was saved at; the checkpoint's `trainer_state.json` the step the Trainer resumes
    at. A rank file copied from another checkpoint of the run (a hand sync, a partial rsync) has a plausible size
    and placement, and would resume another step's experts and optimizer state, silently. Rank files saved without
    a step (older occult_hf) and checkpoints without a trainer_state.json (the Trainer then restarts at step 0) are
    not compared."""
    saved, step = payload.get("global_step"), _checkpoint_step(checkpoint)
    if saved is not None and step is not None and saved != step:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r}: rank file {os.path.basename(path)} belongs to another checkpoint: "
            f"it holds step {saved}'s experts and optimizer state, the checkpoint is step {step} (trainer_state.json); "
            f"put back {os.path.basename(os.path.normpath(checkpoint))}'s own {os.path.basename(path)}, or "
            f"{_resume_instead(checkpoint)}"
        )


def _checkpoint_step(checkpoint: str) -> int | None:
    """The `global_step` of the checkpoint's `trainer_state.json`, the step the Trainer resumes at; None without one
    (the Trainer then starts at step 0 and the Trainer's own load reports a malformed one)."""
    path = os.path.join(checkpoint, "trainer_state.json")
    state = read_json_file(path, "trainer state") if os.path.isfile(path) else None
    return state.get("global_step") if isinstance(state, dict) else None


def _vanilla_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint's safetensors weights (one file or an index of shards)."""
    from safetensors.torch import load_file

    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"resume_from_checkpoint={checkpoint!r} holds no model.safetensors(.index.json)")
    shards = sorted(set(read_json_file(index, "checkpoint index")["weight_map"].values()))
    weights = {}
    for shard in shards:
        weights.update(load_file(os.path.join(checkpoint, shard)))
    return weights


def _load_from_checkpoint(original, trainer, resume_from_checkpoint, model=None):
    loaded = model if model is not None else trainer.model
    target = _occult_model(loaded)
    if target is None or target is not loaded:
        if target is not None:
            _check_complete(resume_from_checkpoint)
        return original(trainer, resume_from_checkpoint, model)
    # every rank reads the whole checkpoint before the meeting: it may wait as long as the ranks' first collective would
    ddp_bound = (float(trainer.args.ddp_timeout), "TrainingArguments.ddp_timeout")
    bound = max((save_timeout_s(), SAVE_TIMEOUT_ENV), ddp_bound)
    _with_the_ranks(target, f"resume_from_checkpoint {os.path.basename(os.path.normpath(resume_from_checkpoint))}",
                    bound, lambda: _load_own_share(resume_from_checkpoint, target))  # fmt: skip


def _with_the_ranks(model: nn.Module, operation: str, bound: tuple[float, str], work) -> None:
    """`work()`, this rank's part of a collective step, then a meeting of the EP ranks (`bound`: its seconds and the
    setting that gives them): a rank whose part failed (an incomplete checkpoint, a rank file written with another
    placement, or missing) is named on every rank at once, where the others would train on into an exchange their
    peer never reaches and die there of a lost connection naming nothing."""
    try:
        work()
    except Exception as error:
        _announce(model, error, operation)
        raise
    state = vars(model)[STATE_ATTR]
    if state.ep.is_distributed:
        arrive(state.ep.group, operation, *bound)


def _load_own_share(resume_from_checkpoint: str, target: nn.Module) -> None:
    """This rank's share of a checkpoint into `target`: the dense weights from the checkpoint's safetensors, its own
    experts from its rank file."""
    _check_complete(resume_from_checkpoint)
    experts = _read_rank_file(resume_from_checkpoint, target)["experts"]
    own = target.state_dict()
    rename = checkpoint_key_renamer(target)  # saved keys are transformers' original names (Mixtral: block_sparse_moe)
    saved = {rename(key): value for key, value in _vanilla_weights(resume_from_checkpoint).items()}
    dense = {k: v for k, v in saved.items() if k in own and k not in experts and own[k].shape == v.shape}
    blocks = {path: module for path, module in target.named_modules() if isinstance(module, OccultMoE)}
    prefixes = tuple(f"{path}.experts." for path in blocks)
    missing_experts = sorted(k for k in own if k not in experts and k.startswith(prefixes))
    if missing_experts:
        raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: the rank file lacks {missing_experts[:3]}")
    result = target.load_state_dict({**dense, **experts}, strict=False)
    runtime = {f"{path}.{name}" for path, module in blocks.items() for name in module.runtime_state_names()}
    unexpected_missing = [k for k in result.missing_keys if k not in runtime and k not in dense and k not in experts]
    if unexpected_missing:
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r}: the checkpoint does not hold {unexpected_missing[:5]}"
        )


def _load_best_model(original, trainer):
    """`load_best_model_at_end`: transformers loads the best checkpoint's safetensors under their saved keys, which for
    fused experts are the converted per-expert ones, so the experts keep their last values (it only warns about the
    keys). A model with `apply_occult`'s blocks (not a PEFT one: transformers loads its adapter) loads the checkpoint
    as a resume does (`_load_from_checkpoint`): the dense part under the model's names, each rank its experts."""
    if _occult_model(trainer.model) is not trainer.model:
        return original(trainer)
    _load_from_checkpoint(None, trainer, trainer.state.best_model_checkpoint)


def _load_optimizer_and_scheduler(original, trainer, checkpoint):
    result = original(trainer, checkpoint)
    model = _occult_model(trainer.model)
    if checkpoint is None or model is None:
        return result
    trainer.optimizer.load_state_dict(_read_rank_file(checkpoint, model)["optimizer"])
    return result


# ----- the Hub ----------------------------------------------------------------------------------------

def _push_to_hub(original, trainer, *args, **kwargs):
    """`Trainer.push_to_hub` saves into the output folder and uploads all of it (`upload_folder`, which skips only
    `_*` and `checkpoint-*`). Before it, the staging folders a killed save left there are removed (an upload would carry
    them, weights and all); after the upload, the repository's weight files the save replaced are deleted, as
    `model.push_to_hub` deletes them (`hf.hub`): an earlier push's `model.safetensors` loads before a new index."""
    if _configured_model(trainer.model) is None:
        return original(trainer, *args, **kwargs)
    call = inspect.signature(original).bind(trainer, *args, **kwargs)
    call.apply_defaults()
    if trainer.is_world_process_zero():
        _remove_leftover_staging(trainer.args.output_dir)
    result = original(*call.args, **call.kwargs)
    if result is None:  # a rank that does not push
        return result
    token = call.arguments["token"] if call.arguments["token"] is not None else trainer.args.hub_token
    revision = call.arguments["revision"] or trainer.args.hub_revision
    cleanup = (trainer.args.output_dir, trainer.hub_model_id, token, revision)
    if call.arguments["blocking"]:
        return _after_upload(result, *cleanup)
    from transformers.utils.hub import hf_api

    return hf_api().run_as_future(_after_upload, result, *cleanup)  # the Hub client's one worker: after the upload


def _after_upload(upload, output_dir: str, repo_id: str, token, revision):
    """The upload's commit (`upload`: it, or the future of a non-blocking upload), once the weight files it replaced
    are deleted from the repository."""
    commit = upload.result() if hasattr(upload, "result") else upload
    remove_replaced_weights(output_dir, repo_id, commit, token, revision)
    return commit


def _push_from_checkpoint(original, trainer, checkpoint_folder):
    """`hub_strategy` "every_save"/"checkpoint"/"all_checkpoints": transformers copies the checkpoint's config and
    weights into the output folder and uploads that folder. What it does not copy or remove is put right first:
    occult_hf's files (`occult_placement.json`, the similarity profile that `config.json` names: without it the
    repository does not load), the card's pruning section, the output folder's weight files the checkpoint's replace
    (an older `model.safetensors` beside copied shards loads in their place), and a killed save's staging folders.
    The repository's replaced weight files are deleted after the upload, in the same queue."""
    configured = _configured_model(trainer.model)
    if configured is None or not _pushes_now(trainer):
        return original(trainer, checkpoint_folder)
    output_dir = trainer.args.output_dir
    for folder in (output_dir, checkpoint_folder):
        _remove_leftover_staging(folder)
    for name in replaced_weight_files(weight_files(checkpoint_folder), weight_files(output_dir)):
        os.remove(os.path.join(output_dir, name))
    for name in (PLACEMENT_FILENAME, PROFILE_FILENAME):
        if os.path.isfile(os.path.join(checkpoint_folder, name)):
            shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(output_dir, name))
    if configured is trainer.model:  # a PEFT model's card is its adapter's
        describe_in_card(vars(configured)[STATE_ATTR].occult_config, output_dir, output_dir)
    running = trainer.push_in_progress
    earlier = [] if running is None or running.is_done() else list(running.jobs)
    result = original(trainer, checkpoint_folder)
    from transformers.utils.hub import hf_api

    upload = next(job for job in trainer.push_in_progress.jobs if job not in earlier)  # the output folder's, first
    args = trainer.args
    cleanup = hf_api().run_as_future(_after_upload, upload, output_dir, trainer.hub_model_id, args.hub_token,
                                     args.hub_revision)  # fmt: skip: only once the upload succeeded
    trainer.push_in_progress.jobs.append(cleanup)
    return result


def _pushes_now(trainer) -> bool:
    """Whether `Trainer._push_from_checkpoint` copies and uploads now: transformers' own condition (process zero, a
    strategy that pushes saves, no push still running unless `hub_always_push`). The output folder must not change
    under an upload still reading it."""
    from transformers.trainer_utils import HubStrategy

    if not trainer.is_world_process_zero() or trainer.args.hub_strategy == HubStrategy.END:
        return False
    running = trainer.push_in_progress is not None and not trainer.push_in_progress.is_done()
    return trainer.args.hub_always_push or not running


def _remove_leftover_staging(directory: str) -> None:
    """Remove the staging folders (`.occult_save-*`) in `directory` that saves killed before their cleanup left: an
    upload of the folder would carry them, and the process's own saves have finished (or not begun) here."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(STAGING_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # one left behind would be uploaded: its error is this push's


def _create_model_card(original, trainer, *args, **kwargs):
    """`Trainer.push_to_hub` writes the Trainer's card over the output folder's `README.md` after the model's save,
    then uploads the folder itself: a pruned model's section goes back above the Trainer's card (`hf.hub`)."""
    result = original(trainer, *args, **kwargs)
    if _configured_model(trainer.model) is trainer.model and trainer.is_world_process_zero():
        config, output_dir = vars(trainer.model)[STATE_ATTR].occult_config, trainer.args.output_dir
        describe_in_card(config, output_dir, output_dir)  # the model's save wrote the rest of its description
    return result


# ----- install ----------------------------------------------------------------------------------------


def _create_optimizer(original, trainer, *args, **kwargs):
    """The optimizer, built once the grad-norm carriers are trainable: peft freezes them with every non-adapter
    parameter, and one the optimizer does not hold is neither unscaled nor checked by a GradScaler."""
    model = _configured_model(trainer.model)
    if model is not None:
        enable_grad_norm_carriers(model)
    return original(trainer, *args, **kwargs)


_HOOKS = {
    "train": _train,
    "create_optimizer": _create_optimizer,
    "_save_checkpoint": _save_checkpoint,
    "save_model": _save_model,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_from_checkpoint": _load_from_checkpoint,
    "_load_best_model": _load_best_model,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "create_model_card": _create_model_card,
    "push_to_hub": _push_to_hub,
    "_push_from_checkpoint": _push_from_checkpoint,
}


def install_trainer_hooks() -> None:
    """Wrap the eleven `Trainer` methods (idempotent; `uninstall_trainer_hooks` puts them back)."""
    wrap_when_imported("transformers.trainer", "Trainer", _HOOKS)


def uninstall_trainer_hooks() -> None:
    unwrap_when_imported("transformers.trainer", "Trainer", _HOOKS)


__all__ = ["RANK_FILE", "CHECKPOINT_STATUS_FILE", "install_trainer_hooks", "last_complete_checkpoint", "unusable_because", "uninstall_trainer_hooks"]
