"""The Ray Train worker: `train_per_worker` (build, restore, stream shards, train, report,
checkpoint) and the dataset factories Train calls on every worker-group (re)start.

Runs inside Ray Train; the driver (trainer.py) hands it a config dict. Must not import trainer.py.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import ray.train
import torch

from ..console import get_logger, set_log_rank
from ..config import ExperimentConfig, Run, for_world
from ..data.executor import pace_streaming_executor
from ..data.ingest import default_unit_rows, iter_device_batches, train_rows_per_epoch
from ..data.position import DEALING, with_world
from ..model.vit import build_vit
from . import checkpoint as ckpt
from .ema import WeightEMA
from .engine import device_for, follow_config
from ..eval.probe import FewshotProbes
from .loop import Batch, LoopHooks, build_model_and_engine, run_loop
from .preempt import PreemptionWatch
from .restore import load as load_checkpoint, node_copy
from .samples import SampleRecorder
from .sysmetrics import SystemSampler
from .uploads import CheckpointWriter, commit_metrics, report_metrics

log = get_logger(__name__)

if TYPE_CHECKING:  # MLflow is imported by rank 0 only (_setup): other ranks never log
    from ..tracking.runs import RunLogger


INPUT_BOUND = 0.25  # the progress line says so when the loop waits this part of its time for data


def _rate(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"  # a large model on CPU makes < 1 image/s


def _progress_line(cfg: ExperimentConfig, step: int, m: dict[str, float], t_start: float, start_step: int) -> str:
    done = step - start_step
    rate = done / max(time.time() - t_start, 1e-9)
    eta = (cfg.train.steps - step) / rate if rate > 0 else float("inf")
    eta_s = f"{int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s" if math.isfinite(eta) else "?"
    line = (f"[{cfg.run_name}] step {step}/{cfg.train.steps} loss {m['train/loss']:.4f} "
            f"lr {m['train/lr']:.2e} {_rate(m['perf/images_per_sec'])} img/s mfu {m['perf/mfu']:.2%} "
            f"mem {m['perf/mem_gb']:.1f} GB (model {m['perf/mem_model_gb']:.1f}) ETA {eta_s}")
    if m.get("perf/data_wait_frac", 0.0) >= INPUT_BOUND:
        line += f" | input-bound: {m['perf/data_wait_frac']:.0%} of the time waiting for data"
    if "val/top1" in m:
        line += f" | val top1 {m['val/top1']:.3f} loss {m['val/loss']:.3f}"
    return line


def _peek_init_logits(engine, stream: Iterator[Batch], logger) -> Iterator[Batch]:
    """Log max |logits| of the first micro-batch before any update; the batch is not lost."""
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


@dataclass
class _Rank:
    """What one Train worker built at its start: the run for the world running now (the recipe's
    global batch re-derived), its engine, and on rank 0 the MLflow logger."""

    recipe: Run  # as the driver resolved it
    run: Run  # for this world
    rank: int
    world: int
    device: torch.device
    engine: Any
    logger: RunLogger | None
    mlflow_run_id: str | None
    epoch_rows: int  # training rows in one epoch of the shards
    ema: WeightEMA | None = None  # train.ema_decay: this rank's EMA of its fp32 fragments
    resumed_attempt: str | None = None  # the attempt that wrote the checkpoint it resumed from

    @property
    def cfg(self) -> ExperimentConfig:
        return self.run.cfg

    def say(self, line: str) -> None:
        if self.rank == 0:
            log.info("[%s] %s", self.cfg.run_name, line)


def _setup(config: dict[str, Any]) -> _Rank:
    pace_streaming_executor()  # its data pipelines wait, not spin, while training is slower
    recipe = Run.from_dict(config["cfg"])  # resolved by the driver: its paths absolute
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    set_log_rank(rank)
    run = Run.of(for_world(recipe.cfg, world))  # the recipe's global batch on the workers running now
    cfg = run.cfg
    device = device_for(cfg)
    engine, _, _ = build_model_and_engine(cfg, world)
    mlflow = config.get("mlflow") or {}
    logger = None
    if rank == 0 and mlflow:  # never waits on MLflow: metrics are spooled on this node, sent by a thread
        from ..tracking.runs import RunLogger

        logger = RunLogger.attach(mlflow["uri"], mlflow["run_id"], timeout_s=cfg.tracking.log_timeout_s,
                                  spool_max_mb=cfg.tracking.spool_max_mb)
    ema = WeightEMA(engine, cfg.train.ema_decay) if cfg.train.ema_decay else None  # from the initial weights
    return _Rank(recipe, run, rank, world, device, engine, logger, mlflow.get("run_id"), train_rows_per_epoch(run),
                 ema)


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def _restore(r: _Rank) -> tuple[ckpt.TrainState, float | None]:
    """The training state to go on from and the seconds its restore took (None: fresh), the data
    position brought to the world running now; rank 0 logs the restored checkpoint's commit if the
    attempt that wrote it had no time to. The newest checkpoint in storage whose markers are
    all present: a worker killed inside an upload, or after it but before Ray registered the
    checkpoint, leaves a newer one than Ray knows of, or an incomplete one that is never picked."""
    cfg, state, t0 = r.cfg, ckpt.TrainState(dealing=DEALING), time.perf_counter()
    where = ckpt.latest_complete_checkpoint(r.run)
    if where is not None:
        with node_copy(where, _node()) as d:  # one download per node from object storage
            state = load_checkpoint(r.engine, d)
            if cfg.tune.scheduler == "pbt":  # a trial goes on with its own (perturbed) values
                follow_config(r.engine, cfg)
            meta = ckpt.read_meta(d)
            state.worlds = state.worlds or [[int(meta["world_size"]), 0]]
            r.resumed_attempt = meta.get("attempt")
            if r.logger:  # what MLflow lacked of the steps before it: their spool may be lost with its node
                r.logger.take_backlog(ckpt.read_backlog(d, int(cfg.tracking.spool_max_mb * 2**20)))
            if r.ema and not r.ema.load(d):
                r.say("the checkpoint has no weight EMA (train.ema_decay was 0): it starts from these weights")
        r.say(f"resumed from {where} at step {state.step} ({time.perf_counter() - t0:.1f} s to restore)")
        if r.logger and r.logger.last_step_of("perf/ckpt_upload_s") < state.step:
            r.logger.log_metrics(commit_metrics(where), step=state.step)
    elif cfg.train.resume == "must":
        raise RuntimeError(
            f"train.resume='must' but run {cfg.run_name!r} has no checkpoint in storage: "
            "check the run name / work_dir, or use train.resume=auto"
        )
    state.worlds = with_world(state.worlds, r.world, state.samples_seen)  # what RankStreams read
    state.unit_rows = state.unit_rows or default_unit_rows(r.epoch_rows, state.worlds[0][0])
    return state, (time.perf_counter() - t0 if where is not None else None)


def _announce(r: _Rank, state: ckpt.TrainState, restore_s: float | None) -> None:
    """The batch arithmetic where the world differs from the recipe's, and the parallel layout
    (plus the step resumed from and the restore's seconds) as metrics at the starting step."""
    p, rp = r.cfg.parallel, r.recipe.cfg.parallel
    if (p.grad_accum, p.micro_batch) != (rp.grad_accum, rp.micro_batch):
        r.say(f"{r.world} worker(s): micro batch {p.micro_batch} x grad_accum {p.grad_accum} x {r.world} = "
              f"global batch {p.global_batch} (as the recipe's {rp.micro_batch} x {rp.grad_accum} x "
              f"{rp.num_workers})")
    if r.logger:
        r.logger.log_metrics({"parallel/workers": r.world, "parallel/grad_accum": p.grad_accum,
                              "parallel/micro_batch": p.micro_batch,
                              **({"train/resumed_from": state.step, "perf/restore_s": restore_s}
                                 if restore_s is not None else {})}, step=state.step)


class _Reporter:
    """A rank's hooks into the loop: progress lines and metrics at each log interval, checkpoints
    staged on this node and reported to Ray Train, the roll-back after non-finite steps, the
    preemption watch and the few-shot probes."""

    def __init__(self, r: _Rank, state: ckpt.TrainState, recorder: SampleRecorder | None):
        self.r, self.recorder = r, recorder
        self.writer = CheckpointWriter(r.run, r.engine, r.rank, r.device, r.say,
                                       r.logger.log_metrics if r.logger else None, r.mlflow_run_id, r.ema,
                                       r.logger.backlog if r.logger else None)
        self.t_start, self.start_step = time.time(), state.step
        self.watch = PreemptionWatch(r.device, r.say)
        self.sampler = SystemSampler() if r.logger and r.cfg.tracking.system_metrics else None
        # train.fewshot_every: weights copied at those steps, scored by an actor off the training path
        self.probes = FewshotProbes(r.run, r.engine, r.rank, r.logger, r.say,
                                    ema=r.ema if r.cfg.train.fewshot_weights == "ema" else None) \
            if r.cfg.train.fewshot_every else None

    def hooks(self, has_val: bool) -> LoopHooks:
        return LoopHooks(on_log=self.on_log, on_checkpoint=self.on_checkpoint,
                         eval_batches=self.eval_batches if has_val else None, checkpoint_now=self.watch,
                         restore=self.restore, on_fewshot=self.probes.snapshot if self.probes else None,
                         after_step=self.after_step if self.r.ema else None,
                         ema_model=self.ema_model if self.r.ema else None)

    def ema_model(self) -> torch.nn.Module:
        """A plain ViT with the whole EMA weights, on every rank (each scores its share of val)."""
        cfg = self.r.cfg
        model = build_vit(cfg.model, cfg.data.image_size, device="meta", mpp=cfg.train.objective == "mpp")
        model.load_state_dict(self.r.ema.whole(), assign=True)
        return model.to(self.r.device).eval()

    def after_step(self, step: int, applied: bool) -> None:
        if applied:  # a skipped (non-finite) step left the weights as they were
            self.r.ema.update()

    def eval_batches(self) -> Iterator[Batch]:
        cfg = self.r.cfg
        return iter_device_batches(ray.train.get_dataset_shard("val"), cfg.parallel.micro_batch, self.r.device,
                                   mean=cfg.data.mean, std=cfg.data.std, drop_last=False)

    def on_log(self, step: int, metrics: dict[str, float], checkpoint_due: bool) -> None:
        r = self.r
        if r.rank == 0:
            log.info(_progress_line(r.cfg, step, metrics, self.t_start, self.start_step))
            if r.logger:
                r.logger.log_metrics({**metrics, **(self.sampler.sample() if self.sampler else {})}, step=step)
            if self.probes:
                self.probes.poll()  # results that are in, logged at their snapshot's step
        if "val/top1" in metrics and not checkpoint_due:
            # evaluations reach Ray (and a Tune scheduler) between checkpoints; all ranks report
            report_metrics({"step": step, **metrics})

    def on_checkpoint(self, step: int, st: ckpt.TrainState, metrics: dict[str, float]) -> None:
        """The snapshot blocks; the upload goes on in the background (uploads.py). A preemption's
        checkpoint also waits for its upload, so the deadline rule counts the upload
        (PreemptionWatch.checkpoint_s) and the checkpoint is in storage before the node goes."""
        r = self.r
        preempted = bool(self.watch.steps) and self.watch.steps[-1] == step
        st.epoch, st.epoch_offset = divmod(st.samples_seen, max(r.epoch_rows, 1))
        if self.recorder:  # before the checkpoint can count as complete: a rank killed right after it
            self.recorder.flush(step, self.writer.attempt)  # must not lose the record of the steps that
            # checkpoint covers
        io = self.writer.write(step, st, metrics)
        if preempted:
            self.writer.wait()
            self.writer.commit()
        self.watch.checkpoint_s = io["perf/ckpt_blocked_s"] + self.writer.upload_s
        r.say(f"checkpoint {step}: {io['perf/ckpt_mb']:.1f} MB, training blocked {io['perf/ckpt_blocked_s']:.2f} s"
              + ("" if preempted else ", uploading in the background"))
        if r.logger:
            r.logger.log_metrics({**io, **({"train/preempt_checkpoint": 1.0} if preempted else {})}, step=step)
        self.watch.park()

    def restore(self) -> int | None:
        """Non-finite steps in a row: model and optimizer back to the newest complete checkpoint
        (the data goes on from here), its step; None when there is none."""
        path = ckpt.latest_complete_checkpoint(self.r.run)
        if path is None:
            return None
        with node_copy(path, _node()) as d:
            step = load_checkpoint(self.r.engine, d).step
            if self.r.ema:
                self.r.ema.load(d)
            return step

    def finish(self) -> None:
        """After the loop, on every rank: the last checkpoint's upload committed; rank 0's queued probes."""
        self.writer.finish()
        if self.probes and self.r.rank == 0:
            self.probes.finish()  # the queued probes, before the run's metrics are flushed

    def close(self) -> None:
        if self.probes:
            self.probes.close()
        if self.r.logger:
            self.r.logger.close(timeout_s=30)  # bounded; what is unsent stays spooled for the driver's end()


def train_per_worker(config: dict[str, Any]) -> None:
    """Runs on each Ray Train worker: build, restore, stream shards, train, report, checkpoint.

    `config` = {"cfg": resolved config dict, "mlflow": {"uri", "run_id"} or None, "datasets"}.
    """
    r = _setup(config)
    state, restore_s = _restore(r)
    _announce(r, state, restore_s)
    # This rank's stream starts right after what it consumed before the restored checkpoint
    # (RankStreams, from the same newest complete checkpoint): nothing is read twice.
    cfg = r.cfg
    recorder = SampleRecorder(r.run, r.rank, r.world, state.step, r.resumed_attempt) \
        if cfg.train.record_samples else None
    stream = iter_device_batches(ray.train.get_dataset_shard("train"), cfg.parallel.micro_batch,
                                 r.device, mean=cfg.data.mean, std=cfg.data.std, on_keys=recorder)
    reporter = _Reporter(r, state, recorder)
    if state.step == 0 and cfg.model.head == "finetune":
        # The transfer head starts at zero: record the largest |logit| of the first batch.
        stream = _peek_init_logits(r.engine, stream, r.logger)
    try:
        run_loop(cfg, r.engine, stream, state, reporter.hooks("val" in config.get("datasets", ["val"])),
                 r.rank, r.world)
        reporter.finish()
    finally:
        reporter.close()
