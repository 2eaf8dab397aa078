"""Routing collection: forward hooks on a model's own router modules.

`ProfileCollector` hooks every MoE router that the model family's adapter names and feeds what
each router decided to one `LayerAccumulator` per layer. It works around any forward you run
(profiling text, evaluation, training batches) without changing the model's outputs. Padding
is excluded through the 2-D `attention_mask` the forward receives, or under `generate` the one that
`generate` holds (a static cache has it hand the forward a 4-D mask). `collect_routing` drives it over
a text file, a list of documents or a `datasets` column, with a tqdm bar. Both give the fields
of a `RoutingProfile` (`RoutingProfile.collect` and `RoutingProfile.from_collector` build it), so
this module does not depend on the profile class.

Shape legend: B batch, S sequence, T = B*S tokens as routers see them, E experts, k top-k.
"""

from __future__ import annotations

import inspect
import itertools
import os
import weakref
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..utils.text_files import read_utf8
from .stats import LayerAccumulator

DEFAULT_SAMPLE_SIZE = 8192


class ProfileCollector:
    """Accumulate a routing profile from the forwards of `module` while attached.

        with ProfileCollector(model) as collector:
            model(input_ids=ids_BS, attention_mask=mask_BS)   # any number of forwards
        profile = RoutingProfile.from_collector(collector, source="my data")

    Counting rules: a token counts when the forward's 2-D `attention_mask` is 1 for it (no mask: every
    token counts) and, under `module.generate` (greedy or sampling), its sequence has not stopped yet
    (`_FinishedRows`: attach to the model whose `generate` you call). There the padding mask is the 2-D one
    `generate` prepared the forward from, so a static cache (`cache_implementation="static"`, whose forwards get a
    4-D mask) counts the tokens a dynamic one does; outside `generate` a forward's mask must be 2-D. Each MoE layer
    counts once per forward of `module`, so routers re-run outside it (activation-checkpoint recomputation during
    backward, direct calls of sub-modules) are not counted twice; a forward counts only once it has
    returned, so one that raised partway (an out-of-memory error in a later layer, an interrupt)
    leaves no layer with tokens the others lack. Run forwards through `module` itself.

    Under `torch.compile` a hook only keeps what its router decided (the tensors leave the graph as outputs);
    the accumulation (a growing sample with keys drawn on the host) runs in eager code, the next time the
    statistics are read or an eager forward counts (`flush`), in the order the forwards ran. Until then the kept
    tensors pile up, and each compiled forward guards on how many there are: it compiles again every forward, so
    under `fullgraph=True` (where dynamo's recompile limit, 8, is an error) call `flush()` at least every 8 compiled
    forwards (`OccultCallback` reads its window every `check_every` steps). Under `generate` it is flushed before
    every forward `generate` prepares, so a compiled decoding step compiles once.

    Args:
        module: a supported transformers model (`*ForCausalLM` or its base model).
        sample_size: tokens kept per layer in the uniform top-k sample (0: none).
        seed: seed of that sample; the same token stream and seed give the same profile.
        training_only: count only forwards that `module` runs in training mode (`OccultCallback`'s window is the
            fine-tuning's tokens, not those of the evaluations between its steps).
    """

    def __init__(
        self, module: nn.Module, sample_size: int = DEFAULT_SAMPLE_SIZE, seed: int = 0, training_only: bool = False
    ) -> None:
        from occult_hf.patches.base import adapter_for

        self.module = module
        self.config = module.config
        self.adapter = adapter_for(self.config)
        num_experts, top_k = self.adapter.num_experts(self.config), self.adapter.top_k(self.config)
        self._routers = {index: self.adapter.router(block) for index, _, block in self.adapter.iter_moe_blocks(module)}
        if not self._routers:
            raise ValueError(
                f"found no MoE blocks in {type(module).__name__} (model_type {self.config.model_type!r}) "
                f"through the {self.adapter.name!r} adapter"
            )
        self.accumulators = {
            index: LayerAccumulator(num_experts, top_k, sample_size=sample_size, seed=seed) for index in self._routers
        }
        self.sample_size, self.seed, self.training_only = sample_size, seed, training_only
        self._forward_signature = inspect.signature(module.forward)
        self._handles: list = []
        self._in_forward = False
        self._attention_mask_BS: torch.Tensor | None = None
        self._finished_B: torch.Tensor | None = None
        self._generation: _GenerationWatch | None = None  # the rows that `generate` has stopped, while attached
        self._counted_this_forward: set[int] = set()
        self._this_forward: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    # ----- hooks --------------------------------------------------------------------------
    def attach(self) -> "ProfileCollector":
        if self._handles:
            raise RuntimeError("ProfileCollector is already attached")
        self._handles.append(self.module.register_forward_pre_hook(self._on_forward_start, with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(self._on_forward_returned))
        self._handles.append(self.module.register_forward_hook(self._on_forward_end, always_call=True))
        for index, router in self._routers.items():
            # first among the router's hooks: it records the router's own decisions, before a pruning hook
            # (`apply_occult_ep`'s) rewrites them
            self._handles.append(router.register_forward_hook(self._router_hook(index), prepend=True))
        if not self.training_only:
            self._generation = _GenerationWatch.on(self)
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._in_forward = False
        if self._generation is not None:
            self._generation.release(self)
            self._generation = None

    def __enter__(self) -> "ProfileCollector":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _on_forward_start(self, module, args, kwargs) -> None:
        self._in_forward = module.training or not self.training_only
        self._counted_this_forward = set()
        self._this_forward = []
        if not self._in_forward:  # a forward it does not count may take any mask the model takes
            return
        bound = self._forward_signature.bind_partial(*args, **kwargs).arguments
        mask = bound.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            mask = self._generate_padding_mask(mask)
        self._attention_mask_BS = mask
        self._finished_B = None if self._generation is None else self._generation.finished_B()

    def _generate_padding_mask(self, mask) -> torch.Tensor | None:
        """The 2-D padding mask `generate` prepared this forward from, for a forward whose own `mask` is not one (a
        static cache has `generate` build a 4-D mask, or one for the cache's attention, from it)."""
        prepared, padding_mask_BL = (False, None) if self._generation is None else self._generation.padding_mask_BL()
        if not prepared:
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"ProfileCollector needs a 2-D [batch, seq] attention_mask to leave out padding, got {shape}: pass "
                f"the padding mask itself (1 = token, 0 = padding); only under the model's `generate` does it read "
                f"the 2-D mask `generate` holds"
            )
        return padding_mask_BL

    def _on_forward_returned(self, module, args, output) -> None:
        """The forward returned: what its routers decided counts (`_on_forward_end` runs after it, also on errors)."""
        self._pending.extend(self._this_forward)
        self._this_forward = []
        if not torch.compiler.is_compiling():
            self.flush()

    def _on_forward_end(self, module, args, output) -> None:
        self._in_forward = False
        self._attention_mask_BS = self._finished_B = None
        self._this_forward = []  # left only by a forward that raised: none of its layers counts

    def _router_hook(self, layer: int):
        def hook(router, inputs, output) -> None:
            if not self._in_forward or layer in self._counted_this_forward:
                return
            self._counted_this_forward.add(layer)
            logits_TE, topk_ids_Tk = self.adapter.observe(router, inputs, output)
            mask_T = _token_mask(self._attention_mask_BS, self._finished_B, topk_ids_Tk.shape[0])
            self._this_forward.append((layer, topk_ids_Tk.detach(), logits_TE.detach(), mask_T))

        return hook

    def flush(self) -> None:
        """Accumulate what the hooks of compiled forwards kept (see the class docstring)."""
        pending, self._pending = self._pending, []
        for layer, topk_ids_Tk, logits_TE, mask_T in pending:
            self.accumulators[layer].update(topk_ids_Tk, logits_TE, mask_T)

    # ----- result -------------------------------------------------------------------------
    @property
    def token_count(self) -> int:
        """Tokens counted so far (the same at every layer)."""
        self.flush()
        return next(iter(self.accumulators.values())).token_count

    def routing_fields(self, source: str | None = None, **meta: Any) -> dict[str, Any]:
        """The `RoutingProfile` fields accumulated so far; `source` and `meta` go into its metadata."""
        self.flush()
        first_index, first = next(iter(self.accumulators.items()))
        if first.token_count == 0:
            raise ValueError("ProfileCollector has counted no tokens: run forwards through the module while attached")
        others = [index for index, acc in self.accumulators.items() if acc.token_count != first.token_count]
        if others:  # the layers' statistics would describe different tokens (and a layer without any cannot load)
            raise ValueError(
                f"ProfileCollector has counted {first.token_count} tokens at MoE layer {first_index} but "
                f"{[self.accumulators[i].token_count for i in others]} at layers {others}: its forwards did not run "
                f"every MoE layer"
            )
        return dict(
            num_experts=first.num_experts,
            top_k=first.top_k,
            layers={index: acc.to_layer_routing() for index, acc in self.accumulators.items()},
            model_type=self.config.model_type,
            meta={
                "source": source,
                "model": getattr(self.config, "_name_or_path", "") or type(self.module).__name__,
                "sample_size": self.sample_size,
                "seed": self.seed,
                **meta,
            },
        )


class _FinishedRows(StoppingCriteriaList):
    """`generate`'s stopping criteria, keeping which rows have stopped (`finished_B`, None before the first step, and
    throughout beam search, which runs the criteria on candidate beams, not on the rows it feeds: `fed_rows` False).

    In batch generation a row that has stopped (emitted EOS) goes on being fed pad tokens until every row has, under
    an attention mask that transformers extends with ones for every row; those positions are no text, and only the
    criteria's results tell them apart. A row's own last token is not fed back, as when it is generated alone.

    It lives as long as its `generate`, so the watch also keeps here the columns of the 2-D padding mask that
    `generate` last prepared a forward from which that forward feeds (`[B, S]`, None: no padding; `prepared`: once
    it has).
    """

    def __init__(self, criteria: StoppingCriteriaList, fed_rows: bool) -> None:
        super().__init__(criteria)
        self.fed_rows, self.finished_B = fed_rows, None
        self.prepared, self.padding_mask_BL = False, None

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        done_B = super().__call__(input_ids, scores, **kwargs)
        if self.fed_rows:
            self.finished_B = done_B if self.finished_B is None else self.finished_B | done_B
        return done_B


#: the `GenerationMixin` methods whose results `ProfileCollector` records: the stopping criteria, and the inputs of
#: each forward (the 2-D padding mask they are prepared from)
STOPPING_CRITERIA, PREPARE_INPUTS = "_get_stopping_criteria", "prepare_inputs_for_generation"


class _GenerationWatch:
    """On the model whose `generate` runs (the `GenerationMixin` in a collector's module: the module itself, or the
    transformers model inside a peft model), `_get_stopping_criteria` returns its criteria as `_FinishedRows`, which
    every collector attached there reads, and `prepare_inputs_for_generation` keeps there the 2-D padding mask it
    prepares each forward from (with a static cache the forward itself gets a 4-D mask). One per model, whatever the
    number of collectors (each would otherwise wrap the last one's wrapper, and the inner one's rows would never be
    called); gone when the last detaches.

    Before each forward it prepares, the collectors accumulate what compiled forwards kept (`flush`): the compiled
    decoding step of a static cache would otherwise guard on their growing pile, and on a mask one column longer each
    step, and compile again every step (an error past dynamo's recompile limit under `fullgraph=True`)."""

    ATTR = "_occult_generation_watch"

    def __init__(self, generator: nn.Module) -> None:
        self.generator, self.collectors, self._rows = generator, [], None
        self._replaced = {name: generator.__dict__.get(name) for name in (STOPPING_CRITERIA, PREPARE_INPUTS)}
        get_stopping_criteria = getattr(generator, STOPPING_CRITERIA)
        prepare_inputs = getattr(generator, PREPARE_INPUTS)

        def recording(generation_config, *args, **kwargs):
            criteria = get_stopping_criteria(generation_config, *args, **kwargs)
            rows = _FinishedRows(criteria, fed_rows=getattr(generation_config, "num_beams", 1) in (None, 1))
            self._rows = weakref.ref(rows)  # dead once `generate` returns
            return rows

        def preparing(*args, **kwargs):
            for collector in self.collectors:
                collector.flush()
            model_inputs = prepare_inputs(*args, **kwargs)
            rows = self._current()
            if rows is not None:  # `generate` passes its model kwargs, the 2-D mask among them, by name
                rows.prepared, rows.padding_mask_BL = True, _fed_columns(kwargs.get("attention_mask"), model_inputs)
            return model_inputs

        self._wrappers = {STOPPING_CRITERIA: recording, PREPARE_INPUTS: preparing}
        generator.__dict__.update(self._wrappers)
        generator.__dict__[self.ATTR] = self

    @classmethod
    def on(cls, collector: ProfileCollector) -> "_GenerationWatch | None":
        """The watch of the model whose `generate` runs the forwards of `collector`'s module, `collector` among its
        collectors; None where the module holds no `GenerationMixin` (a base model: its parent's `generate` is not
        seen)."""
        generator = next((m for m in collector.module.modules() if isinstance(m, GenerationMixin)), None)
        if generator is None or not hasattr(generator, STOPPING_CRITERIA):
            return None
        watch = generator.__dict__.get(cls.ATTR) or cls(generator)
        watch.collectors.append(collector)
        return watch

    def _current(self) -> _FinishedRows | None:
        """The criteria of the `generate` under way; None outside one."""
        return self._rows() if self._rows is not None else None

    def finished_B(self) -> torch.Tensor | None:
        """`[B]` the rows the `generate` under way has stopped; None outside one (or before its first step)."""
        rows = self._current()
        return None if rows is None else rows.finished_B

    def padding_mask_BL(self) -> tuple[bool, torch.Tensor | None]:
        """Whether the `generate` under way has prepared a forward, and the 2-D padding mask it prepared it from
        (None: no padding)."""
        rows = self._current()
        return (False, None) if rows is None else (rows.prepared, rows.padding_mask_BL)

    def release(self, collector: ProfileCollector) -> None:
        """`collector` detached; the last puts back what the model had (a wrapper that something else replaced since,
        as peft replaces `prepare_inputs_for_generation` around it, stays replaced)."""
        self.collectors.remove(collector)
        if not self.collectors:
            del self.generator.__dict__[self.ATTR]
            for name, replaced in self._replaced.items():
                if self.generator.__dict__.get(name) is not self._wrappers[name]:
                    continue
                if replaced is None:
                    del self.generator.__dict__[name]
                else:
                    self.generator.__dict__[name] = replaced


def _fed_columns(attention_mask_BL: torch.Tensor | None, model_inputs: dict) -> torch.Tensor | None:
    """`[B, S]` the columns of `generate`'s padding mask that the prepared forward feeds (its last S, the new
    positions), contiguous: a compiled decoding step reading the whole mask, or a slice of its strides, would be
    compiled again every step."""
    fed = next((model_inputs[key] for key in ("input_ids", "inputs_embeds") if model_inputs.get(key) is not None), None)
    if attention_mask_BL is None or fed is None:
        return attention_mask_BL
    columns_BS = attention_mask_BL[:, attention_mask_BL.shape[1] - fed.shape[1] :]
    return columns_BS.clone(memory_format=torch.contiguous_format)


def _token_mask(
    attention_mask_BS: torch.Tensor | None, finished_B: torch.Tensor | None, num_tokens: int
) -> torch.Tensor | None:
    """`[T]` bool mask of the tokens a router saw, from the forward's `[B, L]` attention mask and the `[B]` rows
    that `generate` has stopped.

    A router sees the `B * S` tokens of this forward; with a KV cache the mask also covers the `L - S`
    cached positions, which are its first columns.
    """
    mask_T = None
    if attention_mask_BS is not None:
        batch, length = attention_mask_BS.shape
        if num_tokens == batch * length:
            mask_T = attention_mask_BS.reshape(-1).bool()
        elif num_tokens % batch == 0 and num_tokens // batch <= length:
            mask_T = attention_mask_BS[:, length - num_tokens // batch :].reshape(-1).bool()
        else:
            raise ValueError(
                f"router saw {num_tokens} tokens, which does not fit the attention_mask of shape [{batch}, {length}]"
            )
    if finished_B is None:
        return mask_T
    running_T = (~finished_B).repeat_interleave(num_tokens // finished_B.shape[0])
    return running_T if mask_T is None else mask_T & running_T


# ----- driving a model over data ------------------------------------------------------------
def collect_routing(
    model: nn.Module,
    data,
    tokenizer=None,
    *,
    batch_size: int = 8,
    max_length: int = 512,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int = 0,
    max_tokens: int | None = None,
    text_column: str = "text",
    separator: str = "\n",
    progress: bool = True,
    source: str | None = None,
) -> dict[str, Any]:
    """The `RoutingProfile` fields of `model`'s routing over `data` (`RoutingProfile.collect` calls this).

    Args:
        model: a supported transformers model; run in eval mode under `torch.no_grad` (its mode is
            restored afterwards). The language-model head is skipped (the base model is run).
        data: a text-file path (documents split by `separator`; blank ones skipped), a `datasets`
            dataset (column `text_column`, holding strings or token-id lists; a token-id column's padding, where
            an `attention_mask` column marks it, is left out), or an iterable of strings or of token-id sequences.
        tokenizer: turns strings into token ids (not needed for token-id data).
        batch_size: sequences per forward.
        max_length: a document longer than this is cut into consecutive windows of `max_length`
            tokens (every token is profiled; none is truncated away).
        sample_size: tokens kept per layer in the uniform top-k sample.
        seed: seed of the sample.
        max_tokens: stop after this many tokens (None: all of `data`).
        progress: show a progress bar (`utils.progress`: HF's switches turn it off too).
        source: what to record as the profile's source (default: a description of `data`).
    """
    from ..utils.progress import progress_bar

    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be None or a positive integer, got {max_tokens!r}")
    documents, total = _documents(data, text_column, separator)
    base = getattr(model, "base_model", model)
    device = next(model.parameters()).device
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    vocab_size = model.get_input_embeddings().num_embeddings
    was_training = model.training
    model.eval()
    collector = ProfileCollector(base, sample_size=sample_size, seed=seed)
    ep = _distributed_ep(model)
    bar = progress_bar(total=total, unit="doc", desc="profiling routing", enabled=progress)
    try:
        with collector, torch.no_grad():
            windows = _windows(documents, tokenizer, max_length, max_tokens, bar, vocab_size, _holder(data, text_column))
            batches, done = _batches(windows, batch_size), 0
            while (batch := _next_batch(batches, ep, done)) is not None:
                input_ids_BS, attention_mask_BS = _pad(batch, pad_id)
                base(input_ids=input_ids_BS.to(device), attention_mask=attention_mask_BS.to(device), use_cache=False)
                bar.set_postfix(tokens=collector.token_count)
                done += 1
    finally:
        bar.close()
        model.train(was_training)
    if collector.token_count == 0:
        raise ValueError(f"the data ({_describe(data, text_column)}) holds no tokens to profile")
    return collector.routing_fields(
        source=source or _describe(data, text_column),
        batch_size=batch_size,
        max_length=max_length,
        max_tokens=max_tokens,
    )


def _distributed_ep(model: nn.Module):
    """The expert-parallel group of `model`'s occult layers when it spans several ranks, else None."""
    from ..dispatch.group import ExpertParallelGroup

    for module in model.modules():
        ep = getattr(module, "ep", None)
        if isinstance(ep, ExpertParallelGroup) and ep.is_distributed:
            return ep
    return None


#: the ranks' meeting before each batch of `collect_routing` under expert parallelism
_NEXT_BATCH = "collect_routing's next batch"


def _next_batch(batches: Iterator, ep, done: int):
    """The next batch, or None after the last. Under expert parallelism every forward is collective, so the ranks
    first meet (`distributed.agreement.arrive`, host to host, bounded by `OCCULT_JOIN_TIMEOUT_S`) and compare whether
    they have one: ranks whose data runs out at different batches raise together, naming them, and a rank whose own
    data fails (a bad token id, a tokenizer error) tells the others, which raise at once, instead of waiting out the
    exchange timeout in a forward no peer joins."""
    from ..distributed.agreement import JOIN_TIMEOUT_ENV, announce_failure, arrive, join_timeout_s

    try:
        batch = next(batches, None)
    except Exception as error:
        if ep is not None:
            announce_failure(error, _NEXT_BATCH, ep.group)
        raise
    if ep is None:
        return batch
    votes = arrive(ep.group, _NEXT_BATCH, join_timeout_s(), JOIN_TIMEOUT_ENV, batch is not None)
    if len(set(votes.values())) > 1:
        out = [rank for rank, has_batch in sorted(votes.items()) if not has_batch]
        raise ValueError(
            f"collect_routing under expert parallelism: ranks {out} have no data after {done} batches while the "
            f"others have more; every forward is collective, so every rank must profile the same number of batches "
            f"(the same documents and batch_size on every rank, or profile in one process)"
        )
    return batch


def _documents(data, text_column: str, separator: str) -> tuple[Iterable, int | None]:
    """The documents of `data` (strings or token-id sequences) and their number when known."""
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file {path!r} is not a file")
        if not isinstance(separator, str) or not separator:
            raise ValueError(f"separator must be a non-empty string, got {separator!r}")
        documents = [doc for doc in read_utf8(path, f"text file {path!r}").split(separator) if doc.strip()]
        if not documents:
            raise ValueError(f"text file {path!r} holds no non-blank document (separator {separator!r})")
        return documents, len(documents)
    column_names = getattr(data, "column_names", None)
    if column_names is not None:  # a datasets.Dataset
        if text_column not in column_names:
            raise KeyError(f"dataset has no column {text_column!r}; its columns are {list(column_names)}")
        if MASK_COLUMN in column_names and text_column != MASK_COLUMN:
            return _unpadded(data[text_column], data[MASK_COLUMN], text_column), len(data)
        return data[text_column], len(data)
    if isinstance(data, torch.Tensor):
        raise TypeError("pass token ids as a list of sequences (e.g. tensor.tolist()), not one tensor")
    return data, (len(data) if hasattr(data, "__len__") else None)


#: the column of a tokenized dataset that marks its padding (0), as a tokenizer writes it
MASK_COLUMN = "attention_mask"


def _unpadded(documents: Iterable, masks: Iterable, text_column: str) -> Iterator:
    """The documents of a tokenized dataset without the positions its `attention_mask` column marks as padding: a
    dataset padded to a fixed length (`padding="max_length"`) would have its pad ids profiled as tokens."""
    for index, (document, mask) in enumerate(zip(documents, masks)):
        if isinstance(document, str):
            yield document
            continue
        if len(mask) != len(document):
            raise ValueError(
                f"row {index}: column {text_column!r} holds {len(document)} token ids but {MASK_COLUMN!r} {len(mask)} entries"
            )
        yield [token for token, keep in zip(document, mask) if keep]


def _windows(
    documents: Iterable, tokenizer, max_length: int, max_tokens: int | None, bar, vocab_size: int, holder: str
) -> Iterator[list[int]]:
    """Token-id windows of at most `max_length`, in document order, stopping at `max_tokens`; every id
    in [0, vocab_size) (ids from another tokenizer would fail inside the embedding, unnamed). `holder` names
    what holds the documents, for errors."""
    remaining = max_tokens
    for index, document in enumerate(documents):
        if isinstance(document, str):
            if tokenizer is None:
                raise ValueError("the data holds text: pass tokenizer= (or give token-id sequences)")
            ids = tokenizer(document, verbose=False)["input_ids"]
        else:
            ids = _token_ids(document, f"document {index} of {holder}")
        if ids and not (0 <= min(ids) and max(ids) < vocab_size):
            position, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < vocab_size)
            raise ValueError(
                f"document {index}: token id {token} at position {position} is outside the model's vocabulary "
                f"[0, {vocab_size}) (token ids of another tokenizer?)"
            )
        for start in range(0, len(ids), max_length):
            window = ids[start : start + max_length]
            if remaining is not None:
                window = window[:remaining]
                remaining -= len(window)
            if window:
                yield window
            if remaining == 0:
                bar.update(1)
                return
        bar.update(1)


def _token_ids(document, name: str) -> list[int]:
    """A document given as token ids, as a list of ints. Only integers are ids: a float would be cut to
    another id, a bool taken for 0 or 1, and a number or None is no sequence at all."""
    values = document.tolist() if isinstance(document, (np.ndarray, torch.Tensor)) else document
    if not isinstance(values, Sequence) or isinstance(values, (bytes, bytearray)):
        raise ValueError(f"{name} is {_shown(document)}; expected a string or a sequence of integer token ids")
    if all(type(value) is int for value in values):
        return list(values)
    for position, value in enumerate(values):
        if type(value) is not int and not isinstance(value, np.integer):
            raise ValueError(
                f"{name} holds {_shown(value)} at position {position}; expected a string or a sequence of integer "
                f"token ids"
            )
    return [int(value) for value in values]


def _shown(value) -> str:
    """`value` for an error: its type and a repr of at most 60 characters."""
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _batches(windows: Iterator[list[int]], batch_size: int) -> Iterator[list[list[int]]]:
    while batch := list(itertools.islice(windows, batch_size)):
        yield batch


def _pad(batch: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `[B, S]` input ids and their attention mask (1 = real token)."""
    length = max(len(ids) for ids in batch)
    input_ids_BS = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention_mask_BS = torch.zeros(len(batch), length, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids_BS[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask_BS[row, : len(ids)] = 1
    return input_ids_BS, attention_mask_BS


def _holder(data, text_column: str) -> str:
    """What holds the documents of `data`, for errors about one of them."""
    return f"column {text_column!r}" if getattr(data, "column_names", None) is not None else "the data"


def _describe(data, text_column: str) -> str:
    if isinstance(data, (str, os.PathLike)):
        return f"text file {os.path.basename(os.fspath(data))}"
    if getattr(data, "column_names", None) is not None:
        name = getattr(getattr(data, "info", None), "dataset_name", None) or "dataset"
        return f"{name} column {text_column!r} ({len(data)} rows)"
    return f"{type(data).__name__} of documents"


__all__ = ["ProfileCollector", "collect_routing", "DEFAULT_SAMPLE_SIZE"]
