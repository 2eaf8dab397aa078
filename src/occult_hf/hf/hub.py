"""Pushing an occult model to the Hugging Face Hub with everything a save of it writes.

transformers pushes a model two ways, and both end in the model's `_upload_modified_files(working_dir, repo_id,
...)`: `push_to_hub(repo_id)` saves into a temporary folder, `save_pretrained(dir, push_to_hub=True)` into `dir`,
and each then writes a model card of its own (the Hub repository's, else a template) over `README.md`. So:

- `upload_described`, bound on the model as `_upload_modified_files` by both front ends, first puts a pruned model's
  description back into the folder (`checkpointing.add_pruning_files`: the pruning section above the card
  transformers wrote, `occult_pruning` in `config.json`, the similarity profile). Under EP only the rank that wrote
  the files uploads: `push_to_hub` is collective there, like the save inside it, and the other ranks' folders hold
  nothing but the card. After the upload it deletes from the repository the weight files the save replaced, which
  transformers leaves there (an earlier single `model.safetensors` loads before a new sharded save).
- the `occult_config` path's `save_pretrained` (`checkpointing.save_pretrained`) writes through a staging folder,
  which transformers would push under the staging folder's name before the description is added: `save_and_push`,
  bound on the model as its `save_pretrained`, saves with `push_to_hub` taken out, then pushes the published
  directory as transformers would have, except that a card the directory already held is pushed where the Hub
  repository has none (transformers' template would replace it, in the directory too).
- `Trainer.push_to_hub` writes the Trainer's card and uploads the output folder itself: `hf.trainer` puts the
  section back after the Trainer's `create_model_card`.
"""

from __future__ import annotations

import inspect
import os

import torch.distributed as dist

from .checkpointing import add_pruning_files, replaced_weight_files, save_pretrained, weight_files
from .compat import PUSH_UPLOAD_METHOD, files_timestamps, push_upload
from .model_card import CARD_FILENAME
from .state import BLOCKS, OccultState, state_of

#: `save_pretrained(push_to_hub=True)`'s keywords for the push itself (the rest of the ones `save_pretrained` does not
#: know, e.g. `private`, go to `create_repo`, as in transformers)
PUSH_KEYWORDS = ("repo_id", "commit_message", "create_pr")


def writes_files(state: OccultState) -> bool:
    """Whether this rank is the one a save of the model writes from: EP rank 0 on the `occult_config` path (the
    experts are gathered to it), transformers' writer (global rank 0) inside transformers' EP; one process: yes."""
    if state.front_end == BLOCKS:
        return not state.ep.is_distributed or state.ep.rank == 0
    return not (dist.is_initialized() and dist.get_rank() != 0)


def upload_described(model, working_dir, repo_id, *args, **kwargs):
    """`model._upload_modified_files`: a pruned model's description is put back into `working_dir` (over the card
    transformers just wrote), then transformers uploads; on a rank that wrote no files, nothing is uploaded."""
    state = state_of(model)
    if not writes_files(state):
        return None
    working_dir = os.fspath(working_dir)
    add_pruning_files(state, working_dir, working_dir)
    commit = push_upload(model, working_dir, repo_id, *args, **kwargs)
    remove_replaced_weights(working_dir, repo_id, commit, kwargs.get("token"), kwargs.get("revision"))
    return commit


def remove_replaced_weights(working_dir: str, repo_id: str, commit, token, revision) -> None:
    """Delete from the Hub repository, in a commit after the upload, the weight files the pushed save replaces
    (`checkpointing.replaced_weight_files`), as the save removes them from a local directory: an earlier push's
    `model.safetensors` beside a new sharded save loaded in its place (transformers prefers it to an index), and an
    earlier save's shards beside a new index were dead weight. On the pull request the upload opened, if it did."""
    from huggingface_hub import CommitOperationDelete
    from transformers.utils.hub import hf_api

    api, target = hf_api(), getattr(commit, "pr_revision", None) or revision
    remote = [name for name in api.list_repo_files(repo_id, revision=target, token=token) if "/" not in name]
    stale = replaced_weight_files(weight_files(working_dir), remote)
    if stale:
        api.create_commit(
            repo_id=repo_id, operations=[CommitOperationDelete(path_in_repo=name) for name in stale], token=token,
            commit_message=f"Remove the weight files this upload replaced: {', '.join(stale)}", revision=target,
        )  # fmt: skip


def save_and_push(model, save_directory, *args, **kwargs):
    """`save_pretrained` of the `occult_config` path, `push_to_hub=True` included: the save (`checkpointing`), then,
    on the rank that wrote it, a push of the directory's new files to `repo_id` (default: the directory's name) with
    the card transformers writes for a push."""
    push = _take_push_keywords(model, kwargs)
    if push is None:
        return save_pretrained(model, save_directory, *args, **kwargs)
    save_directory = os.fspath(save_directory)
    before = files_timestamps(model, save_directory) if os.path.isdir(save_directory) else {}
    result = save_pretrained(model, save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True) and writes_files(state_of(model)):
        _push(model, save_directory, before, **push)
    return result


def _take_push_keywords(model, kwargs: dict) -> dict | None:
    """Pop `save_pretrained(push_to_hub=True, ...)`'s push out of `kwargs`: None without one, else `_push`'s keywords
    (`PUSH_KEYWORDS`, `token`, and for `create_repo` the keywords `save_pretrained` does not have)."""
    if not kwargs.pop("push_to_hub", False):
        return None
    push = {name: kwargs.pop(name) for name in PUSH_KEYWORDS if name in kwargs}
    known = inspect.signature(type(model).save_pretrained).parameters
    push["repo_kwargs"] = {name: kwargs.pop(name) for name in list(kwargs) if name not in known}
    push["token"] = kwargs.get("token")
    return push


def _push(model, save_directory: str, timestamps: dict, repo_id=None, commit_message=None, create_pr=False,
          token=None, repo_kwargs=None):
    """Upload the files of `save_directory` that changed since `timestamps`, as transformers'
    `save_pretrained(push_to_hub=True)` does after its save. The card is the Hub repository's, else the one the
    directory held before the save (yours, or the Trainer's), else transformers' template; tagged as transformers
    tags it."""
    from transformers.utils.hub import create_and_tag_model_card, hf_api

    repo_id = repo_id or os.path.basename(os.path.normpath(save_directory))
    repo_id = hf_api().create_repo(repo_id, exist_ok=True, token=token, **repo_kwargs).repo_id
    card = os.path.join(save_directory, CARD_FILENAME)
    source = card if CARD_FILENAME in timestamps and not _hub_has_card(repo_id, token) else repo_id
    create_and_tag_model_card(source, model.model_tags, token=token).save(card)
    upload = getattr(model, PUSH_UPLOAD_METHOD)  # the instance's: `upload_described`
    return upload(save_directory, repo_id, timestamps, commit_message=commit_message, token=token, create_pr=create_pr)


def _hub_has_card(repo_id: str, token) -> bool:
    """Whether the Hub repository `repo_id` has a model card (`ModelCard.load`, as transformers' push asks)."""
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    try:
        ModelCard.load(repo_id, token=token)
    except EntryNotFoundError:
        return False
    return True


__all__ = ["save_and_push", "upload_described", "remove_replaced_weights", "writes_files"]
