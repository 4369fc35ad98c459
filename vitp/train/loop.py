"""The training loop: `run_loop` owns the step cadence (train, log, evaluate, checkpoint).

It reaches the outside only through `LoopHooks`, so the same loop runs in a Ray Train worker
(train/worker.py), in a bare `torch.distributed` group (tests, benchmarks) and on one GPU.
Must not import Ray, MLflow or the driver (trainer.py).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from ..config import ExperimentConfig, drill_steps
from ..console import get_logger
from ..model import memory
from ..model.flops import training_flops
from ..model.loading import adapt_state_dict, load_grouped
from ..model.variants import decode_variant
from ..model.vit import build_vit
from . import checkpoint as ckpt
from .engine import build_engine, partitioned_construction, return_freed_host_memory
from .objective import objective_for
from .export import load_weights
from .step import StepResult, all_reduce_sum, evaluate, group, memory_gb, train_step

log = get_logger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LoopHooks:
    """How the loop reaches the outside world. Every hook is called on every rank."""

    # (step, metrics, checkpoint_due) at each log interval; metrics are already averaged over
    # ranks; checkpoint_due: on_checkpoint will be called for this same step, right after
    on_log: Callable[[int, dict[str, float], bool], None] = lambda step, m, checkpoint_due: None
    # (step, state, metrics) when a checkpoint is due (every train.checkpoint_every steps and at
    # the last step); returns nothing. Default: no checkpoints.
    on_checkpoint: Optional[Callable[[int, ckpt.TrainState, dict[str, float]], None]] = None
    # () -> iterator of eval batches, or None for no evaluation
    eval_batches: Optional[Callable[[], Iterator[Batch]]] = None
    # (step) after every step; True = checkpoint now (e.g. a preemption notice). Every rank
    # must return the same answer.
    checkpoint_now: Optional[Callable[[int], bool]] = None
    # () after train.nonfinite_patience consecutive skipped (non-finite) steps: restore model,
    # optimizer and LR scheduler from the last complete checkpoint; returns its step, or None
    # when there is none (the run then stops). Training goes on with the next batches (no data
    # rewind). Called at most once a run; every rank must return the same answer.
    restore: Optional[Callable[[], Optional[int]]] = None
    # (step) every train.fewshot_every steps, after the step's log and checkpoint: take a
    # snapshot of the weights for an evaluation off the training path (a collective under ZeRO-3)
    on_fewshot: Optional[Callable[[int], None]] = None
    # (step, applied) after every optimizer step; applied: the update was not skipped (the weight EMA)
    after_step: Optional[Callable[[int, bool], None]] = None
    # () -> a model with the weight EMA: each evaluation also scores it (val_ema/*); a collective
    ema_model: Optional[Callable[[], torch.nn.Module]] = None


@dataclass
class LoopResult:
    state: ckpt.TrainState
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per log interval


class NonFiniteGuard:
    """Skipped-step bookkeeping: after `patience` skipped steps in a row, one rollback through
    `restore`; the next such run of steps (or one with nothing to restore) stops the run."""

    def __init__(self, cfg: ExperimentConfig, restore: Optional[Callable[[], Optional[int]]], rank: int):
        self.cfg, self.restore, self.rank = cfg, restore, rank
        self.skipped = self.in_a_row = self.rollbacks = 0
        self.restored_step: Optional[int] = None

    def after_step(self, step: int, res: StepResult) -> None:
        if not res.skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        if self.cfg.parallel.precision == "fp16" and math.isfinite(res.loss):
            # DeepSpeed's dynamic loss scaling at work (scaled grads overflowed, the scale drops)
            self._say(f"step {step}: fp16 gradient overflow, update skipped, loss scale lowered")
            return
        self.in_a_row += 1
        self._say(f"step {step}: non-finite loss or gradient norm, update skipped "
                  f"({self.in_a_row} in a row, {self.skipped} in all)")
        if self.in_a_row < self.cfg.train.nonfinite_patience:
            return
        if self.rollbacks == 0 and self.restore is not None:
            self.restored_step = self.restore()
            if self.restored_step is not None:
                self.rollbacks += 1
                self.in_a_row = 0
                self._say(f"step {step}: rolled back to the checkpoint of step {self.restored_step}; "
                          "continuing with the next batches")
                return
        raise RuntimeError(self.message(step))

    def message(self, step: int) -> str:
        o, p = self.cfg.optim, self.cfg.parallel
        where = (f"again after rolling back to the checkpoint of step {self.restored_step}"
                 if self.rollbacks else "and there is no checkpoint to roll back to")
        return (f"step {step}: {self.in_a_row} consecutive non-finite steps (loss or gradient norm "
                f"NaN/inf; {self.skipped} skipped in all), {where}. Likely causes: LR too high or "
                f"warm-up too short (optim.lr={o.lr}, optim.warmup_steps={o.warmup_steps}); fp16 "
                f"overflow (parallel.precision={p.precision}: use bf16); bad input data (check the "
                f"shards' quarantine.parquet and the batches before step {step}); no gradient "
                f"clipping (optim.grad_clip={o.grad_clip})")

    def metrics(self) -> dict[str, float]:
        return {"train/skipped_steps": float(self.skipped), "train/rollbacks": float(self.rollbacks)}

    def _say(self, line: str) -> None:
        if self.rank == 0:
            log.info(line)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model_and_engine(cfg: ExperimentConfig, world_size: int | None = None):
    """Model from the config (weights from `train.init_from` if set) wrapped in DeepSpeed.

    Under ZeRO-3 the model is built partitioned (`deepspeed.zero.Init`): no rank ever holds all
    of it; initialisation and `init_from` weights go in one gathered group at a time."""
    seed_everything(cfg.train.seed)  # same init on every rank
    return_freed_host_memory()
    source = cfg.train.init_from if cfg.train.init_from not in ("", "scratch") else None
    keep = None if cfg.model.head == "pretrain" else False  # a fine-tuning head is always fresh
    if cfg.parallel.zero_stage == 3:
        with partitioned_construction(cfg, world_size) as gather:
            model = build_vit(cfg.model, cfg.data.image_size, init=False, mpp=cfg.train.objective == "mpp")
            model.init_weights(gather)
            if source:
                rank0 = torch.distributed.get_rank() == 0  # the only writer of a gathered group
                sd = adapt_state_dict(model, load_weights(source), keep_head=keep) if rank0 else None
                load_grouped(model, sd, gather)
                del sd
        return build_engine(model, cfg, world_size)
    model = build_vit(cfg.model, cfg.data.image_size, mpp=cfg.train.objective == "mpp")
    if source:
        # pre-logits dropped and the head zero-initialised for fine-tuning; pos-embed resampled
        model.load_state_dict(adapt_state_dict(model, load_weights(source), keep_head=keep))
    return build_engine(model, cfg, world_size)


def memory_model(cfg: ExperimentConfig, world: int) -> memory.MemoryEstimate:
    """The memory model's figure per rank for this config (vitp/model/memory.py)."""
    p, m = cfg.parallel, cfg.model
    rep = (m.representation_size or decode_variant(m.variant).width) if m.head == "pretrain" else None
    return memory.estimate(m.variant, cfg.data.image_size, zero_stage=p.zero_stage, world=world,
                           micro_batch=p.micro_batch, precision=p.precision, checkpointing=m.grad_checkpointing,
                           offload_optimizer=p.offload_optimizer, offload_params=p.offload_params,
                           num_classes=m.num_classes, representation_size=rep)


def run_loop(cfg: ExperimentConfig, engine, batches: Iterator[Batch], state: ckpt.TrainState,
             hooks: LoopHooks, rank: int = 0, world: int = 1) -> LoopResult:
    """Train from `state.step` to `cfg.train.steps` optimizer steps.

    `batches` yields micro-batches on the device; `grad_accum` of them make one step. Metrics
    are averaged over ranks at log time (an all-reduce every `log_every` steps, not every step).
    A step with a non-finite loss or grad norm applies no update (train_step) and is left out of
    train/loss; `NonFiniteGuard` counts such steps and rolls back or stops on a run of them.
    """
    t, p = cfg.train, cfg.parallel
    device = next(engine.module.parameters()).device
    flops_img = training_flops(cfg.model.variant, cfg.data.image_size, cfg.model.num_classes,
                               engine.module.representation_size if cfg.model.head == "pretrain" else None)
    peak = t.device_peak_tflops * 1e12 * world
    mem_model_gb = memory_model(cfg, world).device / 1e9  # logged beside the measured peak
    result = LoopResult(state=state)
    window_loss, window_steps, window_images, window_t0 = 0.0, 0, 0, time.perf_counter()
    window_applied = 0  # steps of the window that updated the weights (their loss is logged)
    window_wait = 0.0  # seconds of the window spent waiting for the next batch
    steps = group(batches, p.grad_accum)
    guard, drill = NonFiniteGuard(cfg, hooks.restore, rank), drill_steps(t.nan_drill)
    objective = objective_for(cfg)  # class labels, or masked patch prediction
    end = t.pause_at or t.steps  # pause_at: stop there with a checkpoint, schedule unchanged
    while state.step < end:
        t_wait = time.perf_counter()
        try:
            micro = next(steps)
            window_wait += time.perf_counter() - t_wait
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at step {state.step} of {t.steps}: the stream must cover "
                "train.steps x parallel.global_batch images (add epochs or lower train.steps)"
            ) from None
        objective.at_step(state.step, rank)  # Mixup / CutMix draws: the same for this step after a resume
        res = train_step(engine, micro, nan_drill=state.step + 1 in drill, objective=objective)
        state.step += 1
        state.samples_seen += res.images * world
        guard.after_step(state.step, res)  # raises on a run of non-finite steps
        if hooks.after_step is not None:
            hooks.after_step(state.step, not res.skipped)
        if not res.skipped:
            window_loss += res.loss
            window_applied += 1
        window_steps += 1
        window_images += res.images
        last = state.step == end
        eval_due = hooks.eval_batches is not None and (
            last or bool(t.eval_every and state.step % t.eval_every == 0))
        checkpoint_due = hooks.on_checkpoint is not None and (
            last or bool(t.checkpoint_every and state.step % t.checkpoint_every == 0)
            or bool(hooks.checkpoint_now and hooks.checkpoint_now(state.step)))
        if (t.log_every and state.step % t.log_every == 0) or last or eval_due:
            elapsed = time.perf_counter() - window_t0
            mean_loss = window_loss / window_applied if window_applied else float("nan")
            sums = all_reduce_sum({"loss": mean_loss, "images": window_images,
                                   "seconds": elapsed, "wait": window_wait}, device)
            ips = sums["images"] / (sums["seconds"] / world)  # images/s of the whole world
            metrics = {
                "train/loss": sums["loss"] / world,
                "train/lr": res.lr,
                "train/grad_norm": res.grad_norm,
                "perf/images_per_sec": ips,
                "perf/mfu": ips * flops_img / peak,
                "perf/mem_gb": memory_gb(device),
                "perf/mem_model_gb": mem_model_gb,
                "perf/step_time_s": elapsed / window_steps,
                # the mean rank's wait for its next batch, and its part of the window's wall time
                "perf/data_wait_s": sums["wait"] / world,
                "perf/data_wait_frac": sums["wait"] / max(sums["seconds"], 1e-9),
                **guard.metrics(),
            }
            if eval_due:
                metrics.update(run_eval(engine, hooks.eval_batches(), device, objective))
                if hooks.ema_model is not None:
                    ema = run_eval(hooks.ema_model(), hooks.eval_batches(), device, objective)
                    metrics.update({k.replace("val/", "val_ema/"): v for k, v in ema.items()})
            result.history.append({"step": state.step, **metrics})
            hooks.on_log(state.step, metrics, checkpoint_due)
            window_loss, window_steps, window_images, window_t0 = 0.0, 0, 0, time.perf_counter()
            window_applied, window_wait = 0, 0.0
        if checkpoint_due:
            hooks.on_checkpoint(state.step, state, result.history[-1] if result.history else {})
        if hooks.on_fewshot is not None and t.fewshot_every and state.step % t.fewshot_every == 0:
            hooks.on_fewshot(state.step)
    return result


def run_eval(engine, batches: Iterator[Batch], device: torch.device, objective=None) -> dict[str, float]:
    """val/loss and val/top1 over all ranks (for mpp: per corrupted patch, top-1 of its colour)."""
    sums = all_reduce_sum(evaluate(engine, batches, objective), device)
    n = max(sums["count"], 1)
    return {"val/loss": sums["loss_sum"] / n, "val/top1": sums["correct"] / n, "val/count": sums["count"]}
