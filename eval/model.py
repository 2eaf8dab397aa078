"""`occult-hf`: lm-eval's Hugging Face model with the MoE blocks replaced by Occult's, as deployed.

    lm_eval.simple_evaluate(
        model="occult-hf",
        model_args="pretrained=allenai/OLMoE-1B-7B-0924,placement=placement.json,num_devices=8,"
                   "prune=router,max_devices_per_token=2",
        tasks=["occult23"], task_manager=occult_hf.eval.make_task_manager(), batch_size=8)

`model_args` are everything lm-eval's `hf` model takes, plus the Occult settings: either
`occult_config=PATH` (an `OccultConfig` JSON file) or its fields one by one (`placement=`,
`num_devices=`, `prune=`, `max_devices_per_token=`, ...: every `OccultConfig` field).
With none of them, a checkpoint saved with an `occult_config` runs with it, any other with the
default `OccultConfig()` (exact, contiguous placement).

Under `torchrun` (WORLD_SIZE > 1) the processes form one expert-parallel group: each rank holds its
experts, evaluates its share of the documents (lm-eval splits documents by rank), and every rank
runs the same number of forwards (`ForwardLockstep`); rank 0 returns the results, equal to the
one-process result. lm-eval's own data-parallel path (accelerate) is not used: it would give every
rank a full model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import re
from typing import Any

import torch
import torch.distributed as dist
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype

from occult_hf.hf.apply import install, lockstep_managed_by_caller, occult_config_of
from occult_hf.utils.checks import did_you_mean
from occult_hf.config import OccultConfig
from occult_hf.utils.logging import get_logger
from occult_hf.utils.progress import progress_enabled

from .lockstep import ForwardLockstep
from .scoring import score_requests

logger = get_logger(__name__)

#: `OccultConfig` fields, each of which may be given in `model_args` instead of `occult_config=PATH`
OCCULT_FIELDS = tuple(f.name for f in dataclasses.fields(OccultConfig))

#: `hf` model_args about building the model some other way; they contradict "as it will run"
UNSUPPORTED_HF_ARGS = (
    "parallelize", "tp_plan", "peft", "delta", "autogptq", "gptqmodel", "gguf_file",
    "max_memory_per_gpu", "max_cpu_memory", "offload_folder",
)  # fmt: skip

#: arguments of `HFLM.__init__` that this class handles itself (the rest are passed on to HFLM)
_HANDLED_HERE = {"self", "pretrained", "kwargs", "device", "dtype", "backend", *UNSUPPORTED_HF_ARGS}
_HFLM_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters) - _HANDLED_HERE


def resolve_occult_config(occult_config: Any, fields: dict[str, Any]) -> OccultConfig | None:
    """The `OccultConfig` that `model_args` ask for, or None when they name no Occult setting."""
    given = {name: value for name, value in fields.items() if value is not None}
    if occult_config is not None and given:
        raise ValueError(
            f"occult-hf: give either occult_config={occult_config!r} or the individual settings "
            f"{sorted(given)}, not both"
        )
    if occult_config is not None:
        return OccultConfig.coerce(occult_config)
    return OccultConfig(**given) if given else None


def ep_world(device: str | None) -> tuple[int, int]:
    """(rank, world size) of the expert-parallel group: the default process group, started here when a launcher set
    `WORLD_SIZE > 1` (torchrun, srun, mpirun), and joined as it is when the caller started it (`occult eval` does,
    before its checks, so that a rank whose checks fail can tell the others)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if str(device or "cuda").startswith("cuda") and torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _resolve_device(device: str | None, world_size: int) -> torch.device:
    """lm-eval's rule (a CUDA request without CUDA falls back to CPU), plus one GPU per local rank under EP."""
    requested = device or "cuda"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        logger.info("occult-hf: device=%r requested but CUDA is not available; using cpu", requested)
        return torch.device("cpu")
    if requested == "cuda" and world_size > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(requested)


def load_occult_model(
    pretrained: str,
    occult_config: OccultConfig | None,
    *,
    device: torch.device,
    dtype: str | torch.dtype | None,
    **load_kwargs: Any,
) -> transformers.PreTrainedModel:
    """Load `pretrained` through occult_hf's `from_pretrained(occult_config=...)`, on `device`, in eval mode.

    `occult_config=None` means the checkpoint's saved `occult_config`, else `OccultConfig()`. Under
    torch.distributed the EP group is the default group (every rank loads, each keeps its experts).
    """
    install()  # idempotent: what `import occult_hf` sets up
    keyword = {"occult_config": occult_config}
    if occult_config is None:  # the checkpoint's own, applied by the load (a pruned fine-tune runs pruned), else the default
        config_kwargs = {k: load_kwargs[k] for k in ("revision", "trust_remote_code", "subfolder") if k in load_kwargs}
        stores_one = getattr(transformers.AutoConfig.from_pretrained(pretrained, **config_kwargs), "occult_config", None) is not None
        keyword = {} if stores_one else {"occult_config": OccultConfig()}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        pretrained, **keyword, dtype=get_dtype(dtype), device_map={"": str(device)}, **load_kwargs
    )
    return model.eval()


def _rejected_model_arg(error: TypeError, load_kwargs: dict[str, Any]) -> str | None:
    """The name in `load_kwargs` that the model class rejected with `error`, else None.

    Every model_arg that is neither HFLM's nor an Occult setting goes to `from_pretrained`, which hands
    the names it does not know to the model class; a misspelt Occult setting ends there. Checked after
    the fact, because which names `from_pretrained` takes depends on the transformers version and model.
    """
    rejected = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    return rejected[1] if rejected is not None and rejected[1] in load_kwargs else None


class _DropModelObjectWarnings(logging.Filter):
    """HFLM warns that a model object "assumes single-process" and that "many arguments may be ignored";
    occult-hf passes a model object by design and owns the distributed setup, so those two are noise."""

    _PREFIXES = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self._PREFIXES)


@contextlib.contextmanager
def _without_model_object_warnings():
    hflm_logger = logging.getLogger(HFLM.__module__)
    quiet = _DropModelObjectWarnings()
    hflm_logger.addFilter(quiet)
    try:
        yield
    finally:
        hflm_logger.removeFilter(quiet)


@register_model("occult-hf")
class OccultHFLM(HFLM):
    """lm-eval's `HFLM` evaluating an Occult model.

    Args (`model_args`): everything `HFLM` takes, plus `occult_config` (an `OccultConfig` JSON path) or
    any of the `OccultConfig` fields (`OCCULT_FIELDS`: placement, num_devices, prune,
    max_devices_per_token, profile, dispatch, expert_backend, deterministic), not both.
    """

    def __init__(
        self,
        pretrained: str,
        occult_config: str | None = None,
        device: str | None = "cuda",
        dtype: str | torch.dtype | None = "auto",
        backend: str = "default",
        **kwargs: Any,
    ) -> None:
        if not isinstance(pretrained, str):
            raise TypeError(
                f"occult-hf: pretrained must be a model path or hub id (str), got {type(pretrained).__name__}; "
                f"to evaluate a model object, apply_occult() it and pass it to lm-eval's HFLM"
            )
        if backend not in ("default", "causal"):
            raise ValueError(f"occult-hf: backend must be 'default' or 'causal' (MoE decoders), got {backend!r}")
        unsupported = sorted(name for name in kwargs if name in UNSUPPORTED_HF_ARGS and kwargs[name] not in (None, False))
        if unsupported:
            raise ValueError(
                f"occult-hf: model_args {unsupported} are not supported: the model is loaded and its MoE "
                f"blocks replaced by occult_hf, exactly as it runs in deployment"
            )
        settings = {name: kwargs.pop(name, None) for name in OCCULT_FIELDS}
        requested_config = resolve_occult_config(occult_config, settings)

        rank, world_size = ep_world(device)
        batch_size = kwargs.get("batch_size", 1)
        if world_size > 1 and str(batch_size).startswith("auto"):
            raise ValueError(
                f"occult-hf: batch_size={batch_size!r} is not supported under expert parallelism "
                f"(world size {world_size}): its out-of-memory retries differ between ranks; give an integer"
            )
        self._ep_group = dist.group.WORLD if world_size > 1 else None
        hflm_kwargs = {name: value for name, value in kwargs.items() if name in _HFLM_ARGS}
        load_kwargs = {name: value for name, value in kwargs.items() if name not in _HFLM_ARGS and name not in UNSUPPORTED_HF_ARGS}
        for shared in ("revision", "trust_remote_code", "subfolder"):
            if shared in hflm_kwargs:
                load_kwargs[shared] = hflm_kwargs[shared]

        try:
            model = load_occult_model(
                pretrained, requested_config, device=_resolve_device(device, world_size), dtype=dtype, **load_kwargs
            )
        except TypeError as error:
            name = _rejected_model_arg(error, load_kwargs)
            if name is None:
                raise
            raise ValueError(
                f"occult-hf: model_args {name!r} is not an OccultConfig field, an argument of lm-eval's hf model or "
                f"of from_pretrained{did_you_mean([name], [*OCCULT_FIELDS, *sorted(_HFLM_ARGS)])}"
            ) from error
        hflm_kwargs.setdefault("tokenizer", pretrained)
        with _without_model_object_warnings():
            super().__init__(pretrained=model, backend="causal", **hflm_kwargs)
        # HFLM treats a model object as single-process; this class owns the EP group instead
        self._rank, self._world_size = rank, world_size
        self.pretrained = pretrained
        self._lockstep = None
        if world_size > 1:
            idle_token = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
            self._lockstep = ForwardLockstep(
                self.model, self._ep_group, self.device, idle_token, autocast_dtype=self.mixed_precision_dtype
            )

    # ----- collectives: every rank drains its forwards before it meets the others ------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._lockstep is None:
            return super().all_gather(tensor)
        self._lockstep.drain()
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self._ep_group)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self._lockstep is None:
            return super().gather_object(obj, dst)
        self._lockstep.drain()
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst, group=self._ep_group)
        return gathered

    def barrier(self) -> None:
        """Under EP a drain: it returns, on every rank in the same round, once all ranks have reached it."""
        if self._lockstep is None:
            super().barrier()
        else:
            self._lockstep.drain()

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """Under EP, `ForwardLockstep` already pairs every forward of generation across ranks (and across
        generate calls, batches and request types). The runtime's EP `generate` forces `synced_gpus=True`,
        whose per-step all_reduce would interleave with the lockstep's votes, so the class's own
        `generate` (synced_gpus off) runs here."""
        if self._lockstep is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        with lockstep_managed_by_caller(self.model):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's scoring with one wait for the device per batch instead of four per request (`scoring.score_requests`);
        HFLM's own for what that does not cover (an `auto` batch size).

        `loglikelihood_rolling` (perplexity) calls this once per batch of windows with `override_bs` (the batch's
        length) and its bar forced on. With an integer batch size HFLM ignores `override_bs` (the batch is one
        chunk of at most `batch_size` windows either way), so the batched scorer serves those calls too; the bar
        follows HF's progress switches here because lm-eval does not pass its caller's `disable_tqdm` down.
        """
        disable_tqdm = disable_tqdm or not progress_enabled()
        if self.backend != "causal" or not isinstance(self.batch_size, int):
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        return score_requests(self, requests, disable_tqdm=disable_tqdm)

    # ----- lm-eval's request bars follow HF's progress-bar switches (and `occult eval --no-progress`) -----
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not progress_enabled())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not progress_enabled())

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=disable_tqdm or not progress_enabled())

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["occult_config"] = occult_config_of(self.model).to_dict()
        info["expert_parallel_world_size"] = self.world_size
        return info


__all__ = ["OccultHFLM", "OCCULT_FIELDS", "UNSUPPORTED_HF_ARGS", "ep_world", "resolve_occult_config", "load_occult_model"]
