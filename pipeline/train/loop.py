"""The training loop: `run_loop` (plain torch + DeepSpeed) and `train_per_worker` (Ray Train).

`run_loop` owns the step cadence — train, log, evaluate, checkpoint — and talks to the outside
only through callbacks, so the same loop runs in a Ray Train worker, in a bare
`torch.distributed` process group (tests, benchmarks) and on one GPU without Ray.
"""
from __future__ import annotations

import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from ..config import ExperimentConfig
from ..model import adapt_state_dict, build_vit, training_flops
from . import checkpoint as ckpt
from .engine import build_engine, device_for
from .step import all_reduce_sum, evaluate, group, memory_gb, train_step

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LoopHooks:
    """How the loop reaches the outside world. Every hook is called on every rank."""

    # (step, metrics) at each log interval; metrics are already averaged over ranks
    on_log: Callable[[int, dict[str, float]], None] = lambda step, m: None
    # (step, state) when a checkpoint is due; returns nothing. Default: no checkpoints.
    on_checkpoint: Optional[Callable[[int, ckpt.TrainState, dict[str, float]], None]] = None
    # () -> iterator of eval batches, or None for no evaluation
    eval_batches: Optional[Callable[[], Iterator[Batch]]] = None


@dataclass
class LoopResult:
    state: ckpt.TrainState
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per log interval


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model_and_engine(cfg: ExperimentConfig, world_size: int | None = None):
    """Model from the config (weights from `train.init_from` if set) wrapped in DeepSpeed."""
    seed_everything(cfg.train.seed)  # same init on every rank
    model = build_vit(cfg.model, cfg.data.image_size)
    if cfg.train.init_from and cfg.train.init_from != "scratch":
        from .export import load_weights

        sd = load_weights(cfg.train.init_from)
        # a fine-tuning head is always fresh (zero-init, pre-logits dropped); pos-embed resampled
        keep = None if cfg.model.head == "pretrain" else False
        model.load_state_dict(adapt_state_dict(model, sd, keep_head=keep))
    return build_engine(model, cfg, world_size)


def run_loop(cfg: ExperimentConfig, engine, batches: Iterator[Batch], state: ckpt.TrainState,
             hooks: LoopHooks, rank: int = 0, world: int = 1) -> LoopResult:
    """Train from `state.step` to `cfg.train.steps` optimizer steps.

    `batches` yields micro-batches on the device; `grad_accum` of them make one step. Metrics
    are averaged over ranks at log time (an all-reduce every `log_every` steps, not every step).
    """
    t, p = cfg.train, cfg.parallel
    device = next(engine.module.parameters()).device
    flops_img = training_flops(cfg.model.variant, cfg.data.image_size, cfg.model.num_classes,
                               engine.module.representation_size if cfg.model.head == "pretrain" else None)
    peak = t.device_peak_tflops * 1e12 * world
    result = LoopResult(state=state)
    window_loss, window_steps, window_images, window_t0 = 0.0, 0, 0, time.perf_counter()
    steps = group(batches, p.grad_accum)
    while state.step < t.steps:
        try:
            micro = next(steps)
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at step {state.step} of {t.steps}: the stream must cover "
                "train.steps x parallel.global_batch images (add epochs or lower train.steps)"
            ) from None
        res = train_step(engine, micro)
        state.step += 1
        state.samples_seen += res.images * world
        window_loss += res.loss
        window_steps += 1
        window_images += res.images
        last = state.step == t.steps
        eval_due = hooks.eval_batches is not None and (
            last or bool(t.eval_every and state.step % t.eval_every == 0))
        if (t.log_every and state.step % t.log_every == 0) or last or eval_due:
            elapsed = time.perf_counter() - window_t0
            sums = all_reduce_sum({"loss": window_loss / window_steps, "images": window_images,
                                   "seconds": elapsed}, device)
            ips = sums["images"] / (sums["seconds"] / world)  # images/s of the whole world
            metrics = {
                "train/loss": sums["loss"] / world,
                "train/lr": res.lr,
                "train/grad_norm": res.grad_norm,
                "perf/images_per_sec": ips,
                "perf/mfu": ips * flops_img / peak,
                "perf/mem_gb": memory_gb(device),
                "perf/step_time_s": elapsed / window_steps,
            }
            if eval_due:
                metrics.update(run_eval(engine, hooks.eval_batches(), device))
            result.history.append({"step": state.step, **metrics})
            hooks.on_log(state.step, metrics)
            window_loss, window_steps, window_images, window_t0 = 0.0, 0, 0, time.perf_counter()
        if hooks.on_checkpoint and ((t.checkpoint_every and state.step % t.checkpoint_every == 0) or last):
            hooks.on_checkpoint(state.step, state, result.history[-1] if result.history else {})
    return result


def run_eval(engine, batches: Iterator[Batch], device: torch.device) -> dict[str, float]:
    sums = all_reduce_sum(evaluate(engine, batches), device)
    n = max(sums["count"], 1)
    return {"val/loss": sums["loss_sum"] / n, "val/top1": sums["correct"] / n, "val/count": sums["count"]}


# ---------------------------------------------------------------------------------------
# Ray Train worker
# ---------------------------------------------------------------------------------------


def _progress_line(cfg: ExperimentConfig, step: int, m: dict[str, float], t_start: float, start_step: int) -> str:
    done = step - start_step
    rate = done / max(time.time() - t_start, 1e-9)
    eta = (cfg.train.steps - step) / rate if rate > 0 else float("inf")
    eta_s = f"{int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s" if math.isfinite(eta) else "?"
    line = (f"[{cfg.run_name}] step {step}/{cfg.train.steps} loss {m['train/loss']:.4f} "
            f"lr {m['train/lr']:.2e} {m['perf/images_per_sec']:.1f} img/s mfu {m['perf/mfu']:.2%} ETA {eta_s}")
    if "val/top1" in m:
        line += f" | val top1 {m['val/top1']:.3f} loss {m['val/loss']:.3f}"
    return line


def _peek_init_logits(engine, stream: Iterator[Batch], logger) -> Iterator[Batch]:
    """Log max |logits| of the first micro-batch before any update; the batch is not lost."""
    import itertools

    first = next(stream)
    with torch.no_grad():
        module = engine.module
        was = module.training
        module.eval()
        absmax = engine(first[0].to(next(module.parameters()).dtype)).abs().max().item()
        module.train(was)
    if logger:
        logger.log_metrics({"train/init_logit_absmax": absmax}, step=0)
    return itertools.chain([first], stream)


def _pick_checkpoint(cfg: ExperimentConfig, reported):
    """The checkpoint to resume from: Ray's latest registered one, or a newer one on storage
    whose completion markers are all present. A worker killed inside `ray.train.report` leaves
    a checkpoint that every rank finished writing but Ray never registered; the markers make it
    safe to use, so no finished work is thrown away."""
    import ray.train

    from .trainer import latest_complete_checkpoint

    newest = latest_complete_checkpoint(cfg)
    if newest is None:
        return reported
    newest_step = ckpt.read_meta(newest)["step"]
    if reported is not None:
        with reported.as_directory() as d:
            if ckpt.verify(d)[0] and ckpt.read_meta(d)["step"] >= newest_step:
                return reported
    return ray.train.Checkpoint.from_directory(newest)


def train_per_worker(config: dict[str, Any]) -> None:
    """Runs on each Ray Train worker: build, restore, stream shards, train, report, checkpoint.

    `config` = {"cfg": resolved config dict, "mlflow": {"uri", "run_id"} or None}.
    """
    import ray.train

    from ..data.ingest import iter_device_batches
    from ..tracking import RunLogger

    cfg = ExperimentConfig.from_dict(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = device_for(cfg)
    engine, _, _ = build_model_and_engine(cfg, world)

    state = ckpt.TrainState()
    restored = _pick_checkpoint(cfg, ray.train.get_checkpoint())
    if restored is not None:
        with restored.as_directory() as d:
            state = ckpt.load(engine, d)
        if rank == 0:
            print(f"[{cfg.run_name}] resumed from {restored.path} at step {state.step}", flush=True)
    elif cfg.train.resume == "must":
        raise RuntimeError(
            f"train.resume='must' but run {cfg.run_name!r} has no checkpoint in storage: "
            "check the run name / work_dir, or use train.resume=auto"
        )

    logger = None
    if rank == 0 and config.get("mlflow"):
        logger = RunLogger.start(config["mlflow"]["uri"], cfg.tracking.experiment, cfg.run_name,
                                 run_id=config["mlflow"]["run_id"])

    if logger and restored is not None:
        logger.log_metrics({"train/resumed_from": state.step}, step=state.step)

    # Data position: this attempt's stream starts at the epoch of the newest complete checkpoint
    # (TrainDatasetFactory); skip the micro-batches of that epoch the restored steps consumed.
    from .trainer import stream_start_epoch, train_rows_per_epoch

    epoch_rows = train_rows_per_epoch(cfg)
    stream = iter_device_batches(ray.train.get_dataset_shard("train"), cfg.parallel.micro_batch,
                                 device, mean=cfg.data.mean, std=cfg.data.std)
    if restored is not None:
        consumed = state.samples_seen - stream_start_epoch(cfg) * epoch_rows
        for _ in range(max(0, consumed) // (world * cfg.parallel.micro_batch)):
            next(stream, None)

    def eval_batches():
        shard = ray.train.get_dataset_shard("val")
        return iter_device_batches(shard, cfg.parallel.micro_batch, device, mean=cfg.data.mean,
                                   std=cfg.data.std, drop_last=False)

    t_start, start_step = time.time(), state.step

    def on_log(step: int, metrics: dict[str, float]) -> None:
        if rank == 0:
            print(_progress_line(cfg, step, metrics, t_start, start_step), flush=True)
            if logger:
                logger.log_metrics(metrics, step=step)
        ckpt_due = (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or step == cfg.train.steps
        if "val/top1" in metrics and not ckpt_due:
            # evaluations reach Ray (and a Tune scheduler) between checkpoints; all ranks report
            ray.train.report({"step": step, **metrics})

    def on_checkpoint(step: int, st: ckpt.TrainState, metrics: dict[str, float]) -> None:
        st.epoch = st.samples_seen // max(epoch_rows, 1)
        local = tempfile.mkdtemp(prefix=f"ckpt-{step}-r{rank}-")
        try:
            ckpt.save(engine, local, st, cfg.to_dict() if rank == 0 else None,
                      mlflow_run_id=(config.get("mlflow") or {}).get("run_id"), metrics=metrics)
            ray.train.report({"step": step, **metrics},
                             checkpoint=ray.train.Checkpoint.from_directory(local),
                             checkpoint_dir_name=f"checkpoint_{step:08d}")
        finally:
            shutil.rmtree(local, ignore_errors=True)

    if state.step == 0 and cfg.model.head == "finetune":
        # The transfer head starts at zero: record the largest |logit| of the first batch.
        stream = _peek_init_logits(engine, stream, logger)

    has_val = "val" in config.get("datasets", ["val"])
    hooks = LoopHooks(on_log=on_log, on_checkpoint=on_checkpoint,
                      eval_batches=eval_batches if has_val else None)
    run_loop(cfg, engine, stream, state, hooks, rank, world)
