"""Every reach of occult_hf into transformers internals, in one place.

transformers offers no plugin hook for any of these, so each is the smallest reversible change that
works; when transformers changes, this is the file to read.

- `install_loading_hooks(on_load, config_value)`: `PreTrainedModel.from_pretrained` raises
  `TypeError` on unknown keywords and has no loading hook a plugin can register, so a thin, reversible
  wrapper of that classmethod pops `occult_config=`, calls the original and hands the loaded model to
  `on_load` (`hf.apply.install` registers the function that applies the config), inside an
  optional `load_scope` context. A second
  wrapper, of `PreTrainedConfig.from_dict`, stores `config_value(occult_config, stored)` (JSON-native) when
  the Auto classes pass the keyword to the config. A third, of `PreTrainedModel._from_config` (what
  `from_config` calls), builds the model on `plain_config(config)`: a converted model's config describes its
  occult setup, which a model built from that config does not run. `uninstall_loading_hooks()` puts the
  originals back.
- `intercept_state_dict_loading(intercept)`: for one `from_pretrained`, the lazily opened checkpoint
  state dict passes through `intercept` before transformers loads it (per-rank expert loading,
  `hf.loading`): transformers has no loading filter a plugin can register.
  `skip_allocator_warmup_for(skipped)` leaves the experts another rank holds out of transformers' CUDA
  allocator warmup (it would allocate the full model on a `device_map` device).
- `check_distributed_checkpoint_loading(check)`: for one `from_pretrained`, `check(model, directory)` runs before
  transformers reads a distributed checkpoint (the rank shards of `save_pretrained(distributed_checkpoint=True)`)
  into the model (`hf.loading.check_rank_shards`): transformers has no hook there either.
- `wrap_when_imported(module, class, hooks)`: methods of a class whose module is costly to import are wrapped so
  that `hook(original, self, ...)` runs instead, once that module is imported: the `Trainer` methods that every
  rank runs at a save or a resume (some of them private: `_save_optimizer_and_scheduler`,
  `_load_from_checkpoint`, ...; `hf.trainer` provides the hooks) and peft's `PeftModel.save_pretrained` /
  `load_adapter` (`hf.peft_support`); `unwrap_when_imported(module, class, names)` puts them back.
- `checkpoint_key_renamer(model)`: a saved checkpoint's keys as the model names them (transformers' renamings, which
  `save_pretrained` reverts), for the Trainer resume hook that reads a checkpoint's safetensors itself.
- `push_upload(model, ...)` and `files_timestamps(model, directory)`: transformers' push path
  (`PushToHubMixin._upload_modified_files`, `_get_files_timestamps`, both private) has no hook between the card it
  writes and the upload: `hf.hub` binds a method of the upload's name on the instance, which describes the folder
  and then calls `push_upload`, and pushes a published save the way `save_pretrained(push_to_hub=True)` does.
- `cache_need(model, args, kwargs)` (with `given_generation_config` and `with_max_cache_len`): what the cache of a `generate(*args, **kwargs)` call must hold, by generate's
  own rule (the prompt, and the new tokens: `max_new_tokens`, or the generation config's `max_length` less the
  prompt), its generation config given by keyword or second positional argument, and whether generate allocates a
  static cache or was handed one of a fixed size: EP ranks decode in lockstep until the last is done, so each
  rank's cache must hold the longest prompt and the most new tokens of any rank.

One reach lives beside the family adapters instead, since the runtime's pruner (below this wing) needs it:
`occult_hf.patches.base.replace_recorded_router_logits` swaps collaboration pruning's logits into
transformers' private per-forward `router_logits` record
(`transformers.utils.output_capturing._active_collector`), which the auxiliary loss reads.

Every wrapper keeps the original as `__occult_original__`, which is how "installed" is recognised.
This module imports nothing else from occult_hf but `utils.after_import`: what to do is passed in by
the caller.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from typing import Any, Callable

import torch

from ..utils.after_import import cancel, when_imported

#: `from_pretrained` was called without `occult_config=` (None means: load the vanilla model)
UNSET: Any = object()


# ----- from_pretrained ------------------------------------------------------------------------------


def install_loading_hooks(
    on_load: Callable[[Any, Any, str], Any],
    config_value: Callable[[Any, Any], Any],
    plain_config: Callable[[Any], Any],
    load_scope: Callable[[Any, dict, type, Any], Any] | None = None,
) -> None:
    """Let `PreTrainedModel.from_pretrained` take `occult_config=`; idempotent.

    Three classmethods are wrapped: `PreTrainedModel.from_pretrained` (pops the keyword, `UNSET` when
    absent, calls the original and returns `on_load(model, occult_config, subfolder)`),
    `PreTrainedConfig.from_dict`, and `PreTrainedModel._from_config` (builds on `plain_config(config)`).
    The Auto classes load the config first and hand it every keyword that names one of its attributes, so
    for a checkpoint that occult_hf saved, `occult_config=<OccultConfig>` lands on the config, which
    transformers then JSON-dumps (its "Model config ..." log line, `save_pretrained`). The second wrapper
    stores `config_value(occult_config, stored)` there instead (`stored`: what the checkpoint's config
    held): the caller turns its object into a JSON-native dict, as transformers does for
    `quantization_config`. `load_scope(occult_config, kwargs, cls, checkpoint)`, when given, returns the context
    manager the original `from_pretrained` runs in (per-rank expert loading); what it
    enters as, when callable, is called with the loaded model before `on_load` (the load's own report).
    """
    from transformers import PreTrainedConfig, PreTrainedModel

    if loading_hooks_installed():
        return

    def from_pretrained(original, cls, *args, **kwargs):
        occult_config = kwargs.pop("occult_config", UNSET)
        checkpoint = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        scope = contextlib.nullcontext() if load_scope is None else load_scope(occult_config, kwargs, cls, checkpoint)
        with scope as finish:
            loaded = original(cls, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True: (model, info)
        if callable(finish):
            finish(model)
        model = on_load(model, occult_config, kwargs.get("subfolder") or "")
        return (model, *loaded[1:]) if isinstance(loaded, tuple) else model

    def from_dict(original, cls, *args, **kwargs):
        if "occult_config" in kwargs:
            stored = args[0].get("occult_config") if args and isinstance(args[0], dict) else None
            kwargs["occult_config"] = config_value(kwargs["occult_config"], stored)
        return original(cls, *args, **kwargs)

    def from_config(original, cls, config, *args, **kwargs):
        return original(cls, plain_config(config), *args, **kwargs)

    _wrap_classmethod(PreTrainedModel, "from_pretrained", from_pretrained)
    _wrap_classmethod(PreTrainedConfig, "from_dict", from_dict)
    _wrap_classmethod(PreTrainedModel, "_from_config", from_config)


@contextlib.contextmanager
def intercept_state_dict_loading(intercept: Callable[[Any, dict], tuple[dict, Any]]):
    """Within the block, transformers' loading of a checkpoint's tensors into a model goes through `intercept`.

    transformers opens the safetensors files lazily (`{key: safe_open(...).get_slice(key)}`) and
    hands that dict to `modeling_utils.convert_and_load_state_dict_in_model`, with no hook to filter
    it; this swaps that module-level name for the block's duration. `intercept(model, state_dict,
    rename)` (`rename(key)`: the checkpoint key after transformers' key renamings for this model, such
    as Mixtral's `block_sparse_moe` -> `mlp`, but before its weight converters) returns `(state_dict to load, after)`; `after(model, loading_info)`, unless None, runs once that
    load returns, while the files are still open (the slices are readable), before transformers
    allocates and initialises the keys still in `loading_info.missing_keys`.
    """
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.convert_and_load_state_dict_in_model

    def wrapped(*, model, state_dict, **kwargs):
        state_dict, after = intercept(model, state_dict, _renamer(kwargs.get("load_config")))
        loading_info, disk_offload_index = original(model=model, state_dict=state_dict, **kwargs)
        if after is not None:
            after(model, loading_info)
        return loading_info, disk_offload_index

    modeling_utils.convert_and_load_state_dict_in_model = wrapped
    try:
        yield
    finally:
        modeling_utils.convert_and_load_state_dict_in_model = original


def keep_expert_conversions(model) -> None:
    """Add the model's routed-expert weight converters (per-expert checkpoint keys -> fused `experts.gate_up_proj` /
    `experts.down_proj`) to those transformers keeps for `save_pretrained` to revert (`model._weight_conversions`).

    transformers keeps only the conversions that matched a key it read; on the per-rank path the experts' keys are
    read by occult_hf instead, so without this a checkpoint loaded in the published per-expert layout was saved
    fused, where one process saves it as it was loaded."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    kept = list(getattr(model, "_weight_conversions", None) or [])
    known = {(tuple(c.source_patterns), tuple(c.target_patterns)) for c in kept}
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        patterns = (tuple(conversion.source_patterns), tuple(conversion.target_patterns))
        fuses_experts = any(t.endswith(("experts.gate_up_proj", "experts.down_proj")) for t in conversion.target_patterns)
        if isinstance(conversion, WeightConverter) and fuses_experts and patterns not in known:
            kept.append(conversion)
            known.add(patterns)
    model._weight_conversions = kept


@contextlib.contextmanager
def skip_allocator_warmup_for(skipped: Callable[[Any, str], bool]):
    """Within the block, transformers' CUDA caching-allocator warmup leaves out the parameters for which
    `skipped(model, name)` is true.

    With a `device_map` on an accelerator, `from_pretrained` first allocates (and frees into the caching
    allocator) one block the size of every parameter the device map puts there
    (`modeling_utils.caching_allocator_warmup`), the full routed experts included: a load that reads only
    this rank's experts would still peak at the whole model on the device. This swaps that module-level
    name for the block's duration.
    """
    import transformers.modeling_utils as modeling_utils

    def wrap(original):
        def wrapped(model, expanded_device_map, *args, **kwargs):
            kept = {name: device for name, device in expanded_device_map.items() if not skipped(model, name)}
            return original(model, kept, *args, **kwargs)

        return wrapped

    with _swapped(modeling_utils, "caching_allocator_warmup", wrap):  # absent: a transformers without the warmup
        yield


@contextlib.contextmanager
def check_distributed_checkpoint_loading(check: Callable[[Any, str], None]):
    """Within the block, transformers' load of a distributed checkpoint's rank shards into a model calls
    `check(model, directory)` first.

    `from_pretrained` of a directory that holds rank shards builds the model, materialises it and reads every
    `.safetensors` file of the directory through torch DCP (`distributed.mixin._load_model_checkpoint_distributed`),
    with no hook in between; this swaps that module-level name for the block's duration. A transformers without
    distributed checkpoints leaves the block unchanged.
    """
    try:
        import transformers.distributed.mixin as mixin
    except ImportError:
        mixin = None

    def wrap(original):
        def wrapped(model, checkpoint_dir, *args, **kwargs):
            check(model, str(checkpoint_dir))
            return original(model, checkpoint_dir, *args, **kwargs)

        return wrapped

    with _swapped(mixin, "_load_model_checkpoint_distributed", wrap):
        yield


@contextlib.contextmanager
def _swapped(module, name: str, wrap: Callable[[Callable], Callable]):
    """Within the block `module.name` is `wrap(original)`: transformers' module-level functions that a load looks up
    by name when it calls them. A module (or a transformers) without `name` is left as it is."""
    original = getattr(module, name, None)
    if original is None:
        yield
        return
    setattr(module, name, wrap(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _renamer(load_config) -> Callable[[str], str]:
    """`rename(key)`: transformers' `WeightRenaming`s of this load applied to a checkpoint key."""
    return _applying_renamings(getattr(load_config, "weight_mapping", None) or [])


def checkpoint_key_renamer(model) -> Callable[[str], str]:
    """`rename(key)`: a key as `save_pretrained` stores it (transformers reverts its renamings on save: Mixtral's
    router is `block_sparse_moe.gate`) as `model` names it (`mlp.gate`), by the renamings `from_pretrained` applies."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return _applying_renamings(get_model_conversion_mapping(model))


def _applying_renamings(mapping) -> Callable[[str], str]:
    """`rename(key)` by the `WeightRenaming`s of `mapping` (its converters, which merge tensors, are left out)."""
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, [])[0]


def uninstall_loading_hooks() -> None:
    """Undo `install_loading_hooks` (no-op when not installed)."""
    from transformers import PreTrainedConfig, PreTrainedModel

    for owner, name in ((PreTrainedModel, "from_pretrained"), (PreTrainedConfig, "from_dict"), (PreTrainedModel, "_from_config")):
        original = getattr(owner.__dict__[name].__func__, "__occult_original__", None)
        if original is not None:
            setattr(owner, name, original)


def loading_hooks_installed() -> bool:
    from transformers import PreTrainedModel

    return getattr(PreTrainedModel.__dict__["from_pretrained"].__func__, "__occult_original__", None) is not None


def _wrap_classmethod(owner, name: str, wrapper) -> None:
    """Replace `owner.name` (a classmethod) by `wrapper(original_function, cls, ...)`; keep the original."""
    current = owner.__dict__[name]
    original = current.__func__

    @functools.wraps(original)
    def wrapped(cls, *args, **kwargs):
        return wrapper(original, cls, *args, **kwargs)

    wrapped.__occult_original__ = current
    setattr(owner, name, classmethod(wrapped))


# ----- Trainer ----------------------------------------------------------------------------------------


def wrap_when_imported(module_name: str, class_name: str, hooks: dict[str, Callable]) -> None:
    """`wrap_methods` on `<module_name>.<class_name>` once that module is imported (now, if it is: `utils.after_import`),
    not before: importing the Trainer or peft costs seconds, which `import occult_hf` should not."""
    when_imported(module_name, lambda module: wrap_methods(getattr(module, class_name), hooks))


def unwrap_when_imported(module_name: str, class_name: str, names) -> None:
    """Undo `wrap_when_imported`: the original methods back, or, before the module is imported, the wrapping forgotten."""
    cancel(module_name)
    if module_name in sys.modules:
        unwrap_methods(getattr(sys.modules[module_name], class_name), names)


def wrap_methods(owner: type, hooks: dict[str, Callable]) -> None:
    """Make each `owner.<name>` call `hooks[name](original, self, ...)`; idempotent per method."""
    for name, hook in hooks.items():
        current = owner.__dict__[name]
        if getattr(current, "__occult_original__", None) is not None:
            continue

        def wrapped(self, *args, __hook=hook, __original=current, **kwargs):
            return __hook(__original, self, *args, **kwargs)

        functools.update_wrapper(wrapped, current)
        wrapped.__occult_original__ = current
        setattr(owner, name, wrapped)


def unwrap_methods(owner: type, names) -> None:
    """Undo `wrap_methods` for each of `names` (no-op for a method that is not wrapped)."""
    for name in names:
        original = getattr(owner.__dict__[name], "__occult_original__", None)
        if original is not None:
            setattr(owner, name, original)


# ----- the Hub ---------------------------------------------------------------------------------------


#: the method both of transformers' pushes upload a folder through
PUSH_UPLOAD_METHOD = "_upload_modified_files"


def push_upload(model, working_dir, repo_id, *args, **kwargs):
    """transformers' upload of a push's folder (the class's `PUSH_UPLOAD_METHOD`, past the instance's own)."""
    return getattr(type(model), PUSH_UPLOAD_METHOD)(model, working_dir, repo_id, *args, **kwargs)


def files_timestamps(model, directory: str) -> dict[str, float]:
    """The modification times transformers compares a push's folder against (`_get_files_timestamps`)."""
    return model._get_files_timestamps(directory)


# ----- generate --------------------------------------------------------------------------------------


def given_generation_config(args: tuple, kwargs: dict):
    """The `GenerationConfig` a `generate(*args, **kwargs)` call was given (by keyword, or as its second positional
    argument), else None."""
    from transformers import GenerationConfig

    given = kwargs.get("generation_config")
    if given is None and len(args) > 1 and isinstance(args[1], GenerationConfig):
        given = args[1]
    return given


def with_max_cache_len(args: tuple, kwargs: dict, length: int) -> tuple[tuple, dict]:
    """`(args, kwargs)` of a `generate` call whose static cache holds `length` positions: set on a copy of the
    generation config it was given (transformers deprecates `max_cache_len=` beside one), else as a keyword."""
    given = given_generation_config(args, kwargs)
    if given is None:
        return args, {**kwargs, "max_cache_len": length}
    config = copy.deepcopy(given)
    config.max_cache_len = length
    if kwargs.get("generation_config") is given:
        return args, {**kwargs, "generation_config": config}
    return (args[0], config, *args[2:]), kwargs


def cache_need(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, int | bool]:
    """What the cache of `model.generate(*args, **kwargs)` must hold (module docstring): `{"prompt": tokens,
    "new_tokens": at most, "allocates": whether generate allocates a static cache, "at_least": its generation
    config's own `max_cache_len`, "capacity": the length of a fixed-size cache passed as `past_key_values`, else 0}`."""
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

    config = copy.deepcopy(given_generation_config(args, kwargs) or model.generation_config)
    config.update(**{key: value for key, value in kwargs.items() if hasattr(config, key)})
    candidates = (*args[:1], kwargs.get("input_ids"), kwargs.get("inputs"), kwargs.get("inputs_embeds"))
    prompt = next((value for value in candidates if value is not None), None)
    prompt_length = 1 if prompt is None else prompt.shape[1]  # no prompt: generate starts from one BOS token
    new_tokens = config.max_length - prompt_length if config.max_new_tokens is None else config.max_new_tokens
    cache = kwargs.get("past_key_values")
    capacity = cache.get_max_length() if hasattr(cache, "get_max_length") else -1
    return {
        "prompt": prompt_length,
        "new_tokens": max(new_tokens, 0),
        "allocates": cache is None and config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS,
        "at_least": config.max_cache_len or 0,
        "capacity": max(capacity, 0),
    }