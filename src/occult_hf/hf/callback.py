"""`OccultCallback`: pruning-aware fine-tuning with the Hugging Face `Trainer` (docs/design.md §4).

What it does, all optional except the logging:

- **Logs** (into the Trainer's `logs`, so every logger transformers supports shows them), per MoE
  layer and averaged over layers, over the forwards since the previous log: `CT` (distinct devices
  per token of the routing actually dispatched), remote copies (CT minus one when the token's own
  device is among them: its EP rank, or in one process the `metrics.token_ranks` convention),
  device load balance (max / mean of tokens x experts per device) and the fraction of routing weight
  that pruning removed (`CollaborationPruner.take_sums` after each training step: evaluations in between
  do not count). Under torch.distributed the sums are reduced over all ranks first.
- **N_d schedule**: `max_devices_per_token` of every live pruner goes from `start` (default: no
  pruning) to `target` (default: the model's `OccultConfig.max_devices_per_token`) over
  `schedule_steps` optimizer steps, so the model is eased into the constraint; `max_nodes_per_token` the same
  way from `start_nodes_per_token` to `target_nodes_per_token` (node-limited pruning).
- **MoE-only training**: `train_moe_only=True` freezes every parameter outside the MoE blocks
  (the paper fine-tunes only the routers and experts).
- **Drift watch**: a `ProfileCollector` accumulates a routing profile from the training batches
  themselves (the routers' own decisions, before pruning: what a new placement should serve; no
  extra forward); every `check_every` steps the callback logs the CT of the current placement
  against a placement re-planned on that recent profile, then starts a new window. At every save it
  writes the recent profile (`occult_recent_profile.safetensors`) and the re-planned placement
  (`occult_placement_replanned.json`) beside the checkpoint.

Checkpoints under EP (the experts gathered for rank 0's vanilla checkpoint, a PEFT model's expert
adapters gathered, per-rank optimizer state for `resume_from_checkpoint`) need no callback: importing
occult_hf hooks the Trainer's save and resume themselves (`occult_hf.hf.trainer`).

Shape legend: T tokens, k experts per token, E routed experts, D devices.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from ..metrics import evaluate_placement, load_balance
from ..moe import OccultMoE
from ..placement import Placement, get_planner, plan_placement
from ..profile import ProfileCollector, RoutingProfile
from ..pruning import pruners_of
from ..stats import RoutingMeter
from ..utils.checks import check_count
from .native_ep import ep_blocks, uses_occult_ep

RECENT_PROFILE_FILENAME = "occult_recent_profile.safetensors"
REPLANNED_PLACEMENT_FILENAME = "occult_placement_replanned.json"
LOG_PREFIX = "occult/"


# ----- the N_d schedule --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceLimitSchedule:
    """`N_d` as a function of the optimizer step: `start` at step 0, `target` from `steps` on.

    In between it falls linearly and is rounded up, so each smaller `N_d` starts only once the line
    has passed it: `N_d(step) = target + ceil((start - target) * (1 - step / steps))`.
    """

    start: int
    target: int
    steps: int

    def __post_init__(self) -> None:
        check_count("N_d schedule start", self.start, 1)
        check_count("N_d schedule target", self.target, 1)
        if self.start < self.target:
            raise ValueError(
                f"N_d schedule start ({self.start}) must be >= target ({self.target}): the schedule tightens the limit"
            )
        check_count("N_d schedule steps", self.steps, 0)

    def at(self, step: int) -> int:
        if step >= self.steps:
            return self.target
        remaining = 1.0 - step / self.steps
        return self.target + math.ceil((self.start - self.target) * remaining - 1e-9)


# ----- the callback --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer as the callback reads it, on either front end.

    Attributes:
        routing: what the meter reads after each forward (`last_topk_ids_Tk`, `dispatcher`, `ep`, `layout`): the
            `OccultMoE` (the `occult_config` path) or the `OccultEP` (transformers' EP, `ep_implementation="occult"`).
        fed_by: the module whose forward hook feeds the meter: the `OccultMoE`, or the experts module through which
            transformers calls the `OccultEP`.
        block: the MoE block, whose parameters (router, experts, shared experts) `train_moe_only` keeps trainable.
    """

    routing: Any
    fed_by: nn.Module
    block: nn.Module


def moe_layers(model) -> dict[int, MoELayer]:
    """Decoder layer -> `MoELayer` of every occult MoE layer of `model` (either front end; none: empty)."""
    layers = {m.layer_idx: MoELayer(m, m, m) for m in model.modules() if isinstance(m, OccultMoE)}
    if layers or not uses_occult_ep(model):
        return layers
    return {layer: MoELayer(impl, impl.experts, block) for layer, _, block, impl in ep_blocks(_transformers_model(model))}


def _feeding(meter: RoutingMeter, routing):
    """A forward hook that adds each forward's routing (`routing`: an `OccultMoE` or an `OccultEP`) to `meter`."""

    def hook(module, inputs, output) -> None:
        meter.update(routing)

    return hook


class OccultCallback(TrainerCallback):
    """Logging, `N_d` schedule, MoE-only training and drift watch for a model with `OccultMoE` blocks, or one that
    runs inside transformers' EP with `ep_implementation="occult"`.

    Checkpoints need no callback (see `occult_hf.hf.trainer`).

    Args:
        target_devices_per_token: the final `N_d`; None: the pruners' own value (the model's
            `OccultConfig.max_devices_per_token`). Needs a model built with `prune` set.
        start_devices_per_token: `N_d` at step 0; None: no pruning (`D`).
        target_nodes_per_token, start_nodes_per_token: the same for `N_n` (`OccultConfig.max_nodes_per_token`;
            start None: every node), over the same `schedule_steps`; needs pruners with a node layout.
        schedule_steps: optimizer steps from start to target (0: target from the first step).
        schedule_fraction: instead of `schedule_steps`, this fraction of the run's optimizer steps (the Trainer's
            `state.max_steps` when training begins, so a run by epochs is eased too).
        train_moe_only: freeze every parameter outside the MoE blocks.
        check_every: run the drift check every this many optimizer steps (0: only at saves).
        planner: placement method for the re-planned placement (`placement.available_planners()`).
        planner_options: keyword options of that planner.
        sample_size: tokens per layer kept in the recent profile's top-k sample.
        per_layer: also log every layer's numbers (keys `occult/<name>/layer_<l>`); by default each
            metric logs its mean over layers (`occult/<name>`) and its worst layer (`occult/<name>/max`),
            so a 16-layer model adds 8 keys per log line rather than 69.

    Put it first among the callbacks (`trainer.callback_handler.callbacks.insert(0, cb)` or
    `cb.attach(trainer)`) when reporting integrations (TensorBoard, W&B, ...) must see its numbers:
    `Trainer` calls `on_log` of its reporting callbacks before user callbacks.
    """

    def __init__(
        self,
        target_devices_per_token: int | None = None,
        start_devices_per_token: int | None = None,
        schedule_steps: int = 0,
        train_moe_only: bool = False,
        check_every: int = 0,
        planner: str = "refined",
        planner_options: dict | None = None,
        sample_size: int = 4096,
        per_layer: bool = False,
        target_nodes_per_token: int | None = None,
        start_nodes_per_token: int | None = None,
        schedule_fraction: float | None = None,
    ) -> None:
        get_planner(planner).make_options(**(planner_options or {}))  # clear errors now rather than at the first check
        check_count(
            "OccultCallback sample_size", sample_size, 1, why=": the drift check measures CT on the recent profile's top-k sample"
        )
        check_count("OccultCallback check_every", check_every, 0, meaning=" (0: only at saves)")
        check_count("OccultCallback schedule_steps", schedule_steps, 0)
        if schedule_fraction is not None and not (isinstance(schedule_fraction, (int, float)) and 0 <= schedule_fraction <= 1):
            raise ValueError(f"OccultCallback schedule_fraction must be a number in [0, 1] or None, got {schedule_fraction!r}")
        if schedule_fraction is not None and schedule_steps:
            raise ValueError("OccultCallback takes schedule_steps or schedule_fraction, not both")
        for symbol, start, target in (("devices", start_devices_per_token, target_devices_per_token),
                                      ("nodes", start_nodes_per_token, target_nodes_per_token)):  # fmt: skip
            for end, value in (("start", start), ("target", target)):
                if value is not None:
                    check_count(f"OccultCallback {end}_{symbol}_per_token", value, 1)
            if start is not None and target is not None and start < target:
                raise ValueError(
                    f"OccultCallback start_{symbol}_per_token ({start}) must be >= target_{symbol}_per_token ({target}): "
                    f"the schedule tightens the limit"
                )
        self.target_devices_per_token = target_devices_per_token
        self.start_devices_per_token = start_devices_per_token
        self.target_nodes_per_token = target_nodes_per_token
        self.start_nodes_per_token = start_nodes_per_token
        self.schedule_steps = schedule_steps
        self.schedule_fraction = schedule_fraction
        self.train_moe_only = train_moe_only
        self.check_every = check_every
        self.planner = planner
        self.planner_options = dict(planner_options or {})
        self.sample_size = sample_size
        self.per_layer = per_layer

        self.schedule: DeviceLimitSchedule | None = None
        self.current_devices_per_token: int | None = None  # N_d of the pruners now
        self.node_schedule: DeviceLimitSchedule | None = None
        self.current_nodes_per_token: int | None = None  # N_n of the pruners now
        self.recent_profile = None
        self.replanned_placement = None
        self._model = None
        self._layers: dict[int, MoELayer] = {}
        self._meters: dict[int, RoutingMeter] = {}
        self._handles: list = []
        self._collector = None
        self._pending_logs: dict[str, float] = {}
        self._pruned_sums: dict[int, torch.Tensor] = {}  # layer -> the pruner's sums over the training steps since the last log

    def attach(self, trainer) -> "OccultCallback":
        """Register this callback first in `trainer`, so that reporting integrations see its numbers."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    # ----- setup ----------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self.train_moe_only:
            self._freeze_outside_moe(model)  # before the Trainer builds its optimizer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("OccultCallback needs the model: the Trainer passes it to callbacks as `model`")
        self._bind(model)
        if self.train_moe_only:
            self._freeze_outside_moe(model)
        if self.schedule_fraction is not None:
            self.schedule_steps = int(state.max_steps * self.schedule_fraction)
        self._setup_schedule()
        self._apply_schedule(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._collector is not None:
            self._collector.detach()
            self._collector = None

    def _bind(self, model) -> None:
        layers = moe_layers(model)
        if not layers:
            raise ValueError(
                f"OccultCallback found no OccultMoE blocks in {type(model).__name__}: load the model with "
                f"occult_config=... (or inside transformers' EP with ep_implementation='occult') or call "
                f"occult_hf.apply_occult(model, config) first"
            )
        untracked = sorted(layer for layer, moe in layers.items() if not moe.routing.track)
        if untracked:  # the meters read each forward's routing: stale routing would be counted again, silently
            raise ValueError(
                f"OccultCallback meters the routing of each forward, but layers {untracked} do not keep it: "
                f"call occult_hf.track_routing(model) before training"
            )
        self.on_train_end(None, None, None)  # a second train() call re-binds cleanly
        self._model, self._layers = model, layers
        self._meters = {layer: RoutingMeter() for layer in layers}
        self._pruned_sums = {}
        for layer, moe in layers.items():
            self._handles.append(moe.fed_by.register_forward_hook(_feeding(self._meters[layer], moe.routing)))
        self._collector = self._new_collector()

    def _new_collector(self) -> ProfileCollector:
        """A drift window's collector, attached: the training forwards' routing (not the evaluations')."""
        return ProfileCollector(_transformers_model(self._model), sample_size=self.sample_size, training_only=True).attach()

    def _freeze_outside_moe(self, model) -> None:
        moe_parameters = {id(p) for moe in moe_layers(model).values() for p in moe.block.parameters()}
        if not moe_parameters:
            raise ValueError("OccultCallback(train_moe_only=True) found no OccultMoE blocks to train")
        for parameter in model.parameters():
            if id(parameter) not in moe_parameters:
                parameter.requires_grad_(False)
        if not any(parameter.requires_grad for parameter in model.parameters()):  # else torch's error at the backward
            raise ValueError(
                "OccultCallback(train_moe_only=True) left no parameter to train: the MoE blocks' parameters are frozen "
                "(a PEFT model trains its adapters only) and nothing trainable is inside them; put the adapters on the "
                "experts or the routers (LoRA target_parameters, modules_to_save) or drop train_moe_only"
            )

    # ----- N_d schedule ---------------------------------------------------------------------
    def _setup_schedule(self) -> None:
        pruners = pruners_of(self._model)
        wants_schedule = any(
            v is not None
            for v in (self.target_devices_per_token, self.start_devices_per_token, self.target_nodes_per_token, self.start_nodes_per_token)
        )
        if not pruners:
            if wants_schedule:
                raise ValueError(
                    "OccultCallback got an N_d schedule but the model has no pruners: build it with "
                    "OccultConfig(prune='router' or 'similarity', max_devices_per_token=...)"
                )
            self.schedule = self.node_schedule = None
            return
        self.schedule = self._limit_schedule(
            pruners, "N_d", "num_devices", "max_devices_per_token", self.target_devices_per_token,
            self.start_devices_per_token, self.schedule,
        )  # fmt: skip
        self.node_schedule = self._limit_schedule(
            pruners, "N_n", "num_nodes", "max_nodes_per_token", self.target_nodes_per_token,
            self.start_nodes_per_token, self.node_schedule,
        )  # fmt: skip

    def _limit_schedule(self, pruners, symbol, units_name, limit_name, target, start, previous):
        """The schedule of one limit (`N_d` or `N_n`: the pruners' `limit_name` out of `units_name`); None where the
        pruners have no such limit and none was asked."""
        units = max(getattr(p, units_name) for p in pruners.values())
        if target is None:
            if previous is not None:  # a second train(): keep the first run's target
                target = previous.target
            else:
                limits = [getattr(p, limit_name) for p in pruners.values() if getattr(p, limit_name) is not None]
                if not limits:
                    if start is not None:
                        raise ValueError(f"OccultCallback got a start {symbol} but the model's pruners have no {symbol} limit")
                    return None
                target = min(limits)
        start = units if start is None else start
        if target > units or start > units:
            raise ValueError(f"OccultCallback {symbol} schedule (start {start}, target {target}) exceeds {units_name}={units}")
        return DeviceLimitSchedule(start=start, target=target, steps=self.schedule_steps)

    def _apply_schedule(self, step: int) -> None:
        pruners = pruners_of(self._model).values() if self._model is not None else ()
        if self.schedule is not None:
            self.current_devices_per_token = self.schedule.at(step)
            for pruner in pruners:
                pruner.max_devices_per_token = self.current_devices_per_token
        if self.node_schedule is not None:
            self.current_nodes_per_token = self.node_schedule.at(step)
            for pruner in pruners:
                pruner.max_nodes_per_token = self.current_nodes_per_token

    def on_step_begin(self, args, state, control, **kwargs):
        self._apply_schedule(state.global_step)
        self._take_pruner_sums(keep=False)  # the forwards since the last step ended: an evaluation's, not training

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self._take_pruner_sums(keep=True)
        if self.check_every and state.global_step % self.check_every == 0:
            self._pending_logs.update(self._drift_check())

    def _take_pruner_sums(self, keep: bool) -> None:
        """Take every pruner's sums (on the device); add them to the training step's (`keep`) or drop them."""
        for layer, pruner in (pruners_of(self._model).items() if self._model is not None else ()):
            sums = pruner.take_sums()
            if keep and sums is not None:
                self._pruned_sums[layer] = sums if layer not in self._pruned_sums else self._pruned_sums[layer] + sums

    # ----- logging --------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the routing numbers to a training log line; an evaluation's line (the model in eval mode: the Trainer
        logs its metrics before training resumes) takes none, so that they stay for the next training line."""
        if logs is None or self._model is None or not self._model.training:
            return
        added = self._routing_logs()
        added.update(self._pending_logs)
        self._pending_logs = {}
        if self.schedule is not None:
            added[LOG_PREFIX + "max_devices_per_token"] = float(self.current_devices_per_token)
        if self.node_schedule is not None:
            added[LOG_PREFIX + "max_nodes_per_token"] = float(self.current_nodes_per_token)
        logs.update(added)
        # the Trainer stored a copy of `logs` in the history before calling on_log
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)

    def _routing_logs(self) -> dict[str, float]:
        """Per-layer and mean CT, remote copies, load balance and removed weight since the last log."""
        pruners = pruners_of(self._model)
        layers = sorted(self._meters)
        ep = next(iter(self._layers.values())).routing.ep
        num_devices, reduce_device = ep.num_devices, _reduction_device(ep, self._model)
        rows = []
        for layer in layers:
            meter_row = self._meters[layer].pop(num_devices, reduce_device)
            sums = self._pruned_sums.pop(layer, None)  # tokens, removed weight, pruned tokens
            removed_2 = torch.zeros(2, dtype=torch.float64) if sums is None else sums[[1, 0]]
            rows.append(torch.cat([meter_row, removed_2.to(reduce_device)]))
        table = torch.stack(rows)  # [layers, 3 + D + 2]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        table = table.cpu().numpy()
        per_layer: dict[str, dict[int, float]] = {}
        for layer, row in zip(layers, table):
            tokens, ct_sum, remote_sum = row[:3]
            load_D, (removed_sum, pruner_tokens) = row[3 : 3 + num_devices], row[3 + num_devices :]
            if tokens == 0:
                continue
            values = {
                "ct": ct_sum / tokens,
                "remote_copies": remote_sum / tokens,
                "load_balance": load_balance(load_D) if load_D.sum() > 0 else float("nan"),
            }
            if layer in pruners:
                values["removed_weight"] = removed_sum / pruner_tokens if pruner_tokens else 0.0
            for name, value in values.items():
                per_layer.setdefault(name, {})[layer] = float(value)
        logs = {}
        for name, by_layer in per_layer.items():
            logs[LOG_PREFIX + name] = float(np.mean(list(by_layer.values())))
            logs[f"{LOG_PREFIX}{name}/max"] = float(max(by_layer.values()))  # the worst layer
            if self.per_layer:
                logs.update({f"{LOG_PREFIX}{name}/layer_{layer}": value for layer, value in by_layer.items()})
        return logs

    # ----- drift watch ----------------------------------------------------------------------
    def _drift_check(self) -> dict[str, float]:
        """Plan on the recent window's profile, compare CTs on it, start a new window."""
        profile = self._recent_window_profile()
        if profile is None:
            return {}
        num_devices = next(iter(self._layers.values())).routing.ep.num_devices
        current = self._running_placement(profile.num_experts, num_devices)
        replanned = plan_placement(profile, num_devices, self.planner, progress=False, **self.planner_options)
        replanned.meta.update({"source": "OccultCallback drift watch", "tokens": profile.meta.get("tokens")})
        self.recent_profile, self.replanned_placement = profile, replanned
        current_metrics = evaluate_placement(profile, current)
        replanned_metrics = evaluate_placement(profile, replanned)
        return {
            LOG_PREFIX + "drift/ct_current": float(np.mean([m.ct for m in current_metrics.values()])),
            LOG_PREFIX + "drift/ct_replanned": float(np.mean([m.ct for m in replanned_metrics.values()])),
            LOG_PREFIX + "drift/balance_current": float(np.mean([m.balance for m in current_metrics.values()])),
            LOG_PREFIX + "drift/balance_replanned": float(np.mean([m.balance for m in replanned_metrics.values()])),
        }

    def _running_placement(self, num_experts: int, num_devices: int) -> Placement:
        """The placement the model runs, read from its layers' layouts: the primary homes and the copies (without
        these the current CT and balance would be those of another placement)."""
        layers, replicas = {}, {}
        for layer, moe in self._layers.items():
            layout = moe.routing.layout
            layers[layer] = layout.primary_devices()
            if layout.replicated:
                homes_EM = layout.home_table_EM.tolist()
                extra = {e: [d for d in homes if d >= 0 and d != layers[layer][e]] for e, homes in enumerate(homes_EM)}
                replicas[layer] = {e: devices for e, devices in extra.items() if devices}
        return Placement(num_experts, num_devices, layers, replicas=replicas)

    def _recent_window_profile(self):
        """The profile of the training tokens since the last check (all ranks), then a fresh window."""
        collector = self._collector
        local_tokens = collector.token_count
        total_tokens = sum(_over_ranks(int(local_tokens)))
        if total_tokens == 0:
            return None
        profile = RoutingProfile.from_collector(collector, source="OccultCallback training window") if local_tokens else None
        profiles = _over_ranks(profile)  # the ranks' counts and Gram matrices summed, their samples pooled
        profile = profiles[0] if len(profiles) == 1 else RoutingProfile.merge([p for p in profiles if p is not None])
        profile.meta["tokens"] = int(total_tokens)
        collector.detach()
        self._collector = self._new_collector()
        return profile

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if self._model is None:
            return
        checkpoint_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.check_every == 0 or self.recent_profile is None:  # 0: each save checks the window since the last
            self._pending_logs.update(self._drift_check())
        if self.recent_profile is None or not state.is_world_process_zero:
            return
        os.makedirs(checkpoint_dir, exist_ok=True)
        self.recent_profile.save(os.path.join(checkpoint_dir, RECENT_PROFILE_FILENAME))
        self.replanned_placement.save(os.path.join(checkpoint_dir, REPLANNED_PLACEMENT_FILENAME))


# ----- helpers ---------------------------------------------------------------------------------------


def _transformers_model(model):
    """The transformers model inside a PEFT wrapper (the profile collector binds its forward arguments)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _reduction_device(ep, model) -> torch.device:
    """Where cross-rank reductions over the EP group `ep` run: CPU under gloo, else the model's device (CUDA under
    NCCL)."""
    if ep.is_distributed and dist.get_backend(ep.group) == "gloo":
        return torch.device("cpu")
    return next(model.parameters()).device


def _over_ranks(value) -> list:
    """`value` of every rank (`all_gather_object`), or `[value]` without several ranks."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


__all__ = ["OccultCallback", "DeviceLimitSchedule", "MoELayer", "moe_layers", "RECENT_PROFILE_FILENAME", "REPLANNED_PLACEMENT_FILENAME"]
