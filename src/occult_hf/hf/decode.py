"""Small batches: greedy decoding with one CUDA graph per token, and a check that a step never reads the device.

Shape legend (docs/conventions.md): B sequences, S prompt positions, A attended positions (the static cache
length), N new tokens.

Decoding one token per sequence is latency-bound: at batch 1 a step of a 16-layer MoE model does
little arithmetic but launches hundreds of kernels, each with host work in between. Replaying the
whole step as one CUDA graph removes the launch and host costs; it needs every size static and no
host read of device values:

- the KV cache is a transformers `StaticCache` of length A, and the attention mask a static
  `[B, 1, 1, A]` boolean mask that the step itself extends (transformers takes a 4D mask as is;
  with a 2D mask its mask builder would read the mask on the host);
- under expert parallelism the layers use a static-capacity dispatcher (`occult_hf.dispatch.static`:
  "symm_mem" with NVSHMEM, else "padded" over NCCL), whose buffers are sized from T and whose
  counts stay on the device; `use_dispatcher(model, name)` swaps it in for the decode;
- the step writes its argmax into the next step's input, the token buffer and the position, so N
  replays decode N tokens with no host involvement.

`no_host_sync()` turns any host read of a tensor value (`.item()`, `bool(t)`, `.tolist()`,
data-dependent shapes such as `nonzero`) into an error, also on the CPU, where a CUDA synchronisation
cannot be observed: the tests run the decode step and the one-process MoE layer under it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..dispatch import build_dispatcher
from ..moe import OccultMoE
from ..utils.cuda_graph import capture
from .compat import cache_keyword

#: aten ops whose result needs a device value on the host (a CUDA synchronisation)
_HOST_READS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::bincount",
    "aten::repeat_interleave",
    "aten::item",
}


class HostSyncError(RuntimeError):
    """A region that must not read device values on the host did (see `no_host_sync`)."""


class _NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_READS and not (name == "aten::repeat_interleave" and _static_repeat(args, kwargs)):
            raise HostSyncError(f"{name} reads a device value on the host (a CUDA synchronisation) inside no_host_sync()")
        if func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        ):
            raise HostSyncError("boolean-mask indexing has a data-dependent shape (a CUDA synchronisation) inside no_host_sync()")
        return func(*args, **(kwargs or {}))


def _static_repeat(args, kwargs) -> bool:
    """`repeat_interleave` with an int repeat count or an explicit output size does not read the device."""
    kwargs = kwargs or {}
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return not isinstance(repeats, torch.Tensor) or kwargs.get("output_size") is not None


@contextlib.contextmanager
def no_host_sync():
    """Raise `HostSyncError` where the code inside reads a tensor value on the host."""
    with _NoHostSync():
        yield


# ----- dispatchers for decoding ------------------------------------------------------------------
@contextlib.contextmanager
def use_dispatcher(model: torch.nn.Module, name: str):
    """Give every `OccultMoE` of `model` the dispatcher `name` (same group, layout and settings otherwise) inside
    the block."""
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    before = [layer.dispatcher for layer in layers]
    try:
        for layer, old in zip(layers, before):
            settings = replace(old.settings, dispatcher=name)
            layer.dispatcher = build_dispatcher(settings, old.ep, old.layout, layer.local_experts.gate_up_proj.device)
        yield model
    finally:
        for layer, old in zip(layers, before):
            layer.dispatcher = old


# ----- the decoder -------------------------------------------------------------------------------
@dataclass
class DecodeResult:
    """Greedy tokens `[B, N]` and the time per decoded token (prefill excluded)."""

    tokens: torch.Tensor
    ms_per_token: float
    graphed: bool


class GreedyDecoder:
    """Greedy decoding of `model` (a transformers causal LM) with a static cache; one CUDA graph per step on CUDA.

    Args:
        model: the causal LM (occult_hf applied or not); ranks of an EP group must decode in lockstep
            (same prompt length and token count on every rank).
        batch_size: `B`.
        max_length: `A`, the static cache length (prompt plus new tokens).
        graph: capture the step in a CUDA graph (None: on CUDA devices).
    """

    def __init__(self, model, batch_size: int, max_length: int, graph: bool | None = None) -> None:
        from transformers import StaticCache

        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.graph = (self.device.type == "cuda") if graph is None else graph
        self.max_length = max_length
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        self.ids_B1 = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.pos_1 = torch.zeros(1, dtype=torch.long, device=self.device)
        self.mask_B11A = torch.zeros(batch_size, 1, 1, max_length, dtype=torch.bool, device=self.device)
        self.tokens_BA = torch.zeros(batch_size, max_length, dtype=torch.long, device=self.device)
        self._positions_A = torch.arange(max_length, device=self.device)
        self._cuda_graph = None
        # the auxiliary router loss wants a 2D padding mask and is no use when decoding
        self._extra = {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
        self._cache_keyword = cache_keyword(model)

    @torch.no_grad()
    def prefill(self, prompt_BS: torch.Tensor) -> None:
        """Run the prompt through the model (eager), fill the cache and set the first new token."""
        batch, length = prompt_BS.shape
        if length >= self.max_length:
            raise ValueError(f"prompt length {length} must be below the static cache length max_length={self.max_length}")
        self.cache.reset()
        positions_S = torch.arange(length, device=self.device)
        causal_B1SA = (self._positions_A[None, :] <= positions_S[:, None])[None, None].expand(batch, 1, length, -1)
        logits = self.model(
            input_ids=prompt_BS, **{self._cache_keyword: self.cache}, cache_position=positions_S,
            attention_mask=causal_B1SA.contiguous(), use_cache=True, **self._extra,
        ).logits  # fmt: skip
        self.tokens_BA.zero_()
        self.tokens_BA[:, :length] = prompt_BS
        self.ids_B1.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos_1.fill_(length)
        self.tokens_BA[:, length : length + 1] = self.ids_B1

    def step(self) -> None:
        """One decode step on the static buffers: the token at `pos` in, the next token written at `pos + 1`."""
        self.mask_B11A.copy_((self._positions_A <= self.pos_1)[None, None, None].expand_as(self.mask_B11A))
        logits = self.model(
            input_ids=self.ids_B1, **{self._cache_keyword: self.cache}, cache_position=self.pos_1,
            attention_mask=self.mask_B11A, use_cache=True, **self._extra,
        ).logits  # fmt: skip
        next_B1 = logits[:, -1].argmax(-1, keepdim=True)
        self.ids_B1.copy_(next_B1)
        self.pos_1.add_(1)
        self.tokens_BA.index_copy_(1, self.pos_1.clamp(max=self.max_length - 1), next_B1)

    @torch.no_grad()
    def _capture(self) -> None:
        state = (self.ids_B1.clone(), self.pos_1.clone(), self.tokens_BA.clone())
        graph, _ = capture(self.step, self.device, warmup=3)
        for buffer, saved in zip((self.ids_B1, self.pos_1, self.tokens_BA), state):
            buffer.copy_(saved)
        self._cuda_graph = graph

    @torch.no_grad()
    def generate(self, prompt_BS: torch.Tensor, new_tokens: int) -> DecodeResult:
        """`new_tokens` greedy tokens after `prompt_BS` (the first comes from the prefill); times the steps."""
        length = prompt_BS.shape[1]
        if length + new_tokens > self.max_length:
            raise ValueError(
                f"prompt length {length} + new_tokens {new_tokens} exceeds the static cache length max_length={self.max_length}"
            )
        self.prefill(prompt_BS)
        if self.graph and self._cuda_graph is None:
            self._capture()
            self.prefill(prompt_BS)  # the capture's warm-up steps advanced the cache
        _synchronize(self.device)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            if self._cuda_graph is not None:
                self._cuda_graph.replay()
            else:
                self.step()
        _synchronize(self.device)
        elapsed = time.perf_counter() - start
        tokens = self.tokens_BA[:, length : length + new_tokens].clone()
        return DecodeResult(tokens=tokens, ms_per_token=elapsed * 1e3 / max(new_tokens - 1, 1), graphed=self._cuda_graph is not None)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["DecodeResult", "GreedyDecoder", "HostSyncError", "no_host_sync", "use_dispatcher"]
