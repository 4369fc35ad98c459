"""Driver side of a training run: the Ray Train `TorchTrainer` for a Run, fitted between the opening
and the end of its MLflow run (vitp/tracking/training.py).

Owns Scaling/Run/FailureConfig and reporting a finished run instead of training it again. The worker
side is worker.py; the pictures of the trained model are report.py's step; runs no training steps.
"""
from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import ray.train
from ray.data import DataContext
from ray.train.torch import TorchConfig

from .. import storage
from ..storage import through_outages
from ..config import ExperimentConfig, Run
from ..console import get_logger, library_log_level
from ..data.commands import require_labels
from ..data.shards import read_manifest
from ..model.weights import check_source
from ..tracking.training import end_run, end_stored, open_run
from . import checkpoint as ckpt
from .controller import Trainer
from .failures import final_error
from .rerun import finished, run_to_continue
from .spools import gather_spools
from .staging import clear_dead_everywhere
from .streams import EvalDatasetFactory, RankStreams, train_placeholder
from .worker import train_per_worker

log = get_logger(__name__)


@dataclass
class TrainSummary:
    run_name: str
    mlflow_run_id: Optional[str]
    checkpoint: Optional[str]
    metrics: dict[str, Any]
    seconds: float
    already_finished: bool = False  # the run's final checkpoint existed: nothing was trained


# How long one start of the worker group waits for its placement group: Ray Train's
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s), after which its controller tries again, for ever. A
# fixed-size run waits parallel.placement_timeout_s at once (our controller then ends the run in one
# line: controller.py), so a slow autoscaler is not met with a retry and a traceback each minute.
# An elastic run (parallel.min_workers) starts its worker group with as many workers as Ray's
# autoscaling coordinator says are ready. That view is refreshed every 20 s, so just after a node is
# lost (a preemption at its deadline) it can still count the node, and the group waits for a
# placement that never comes: 60 s before it decides again, with no failure counted. One refresh
# later the view holds only what is left. A value the user set in the environment wins.
ELASTIC_START_TIMEOUT_S = 25
_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


@contextmanager
def _start_timeout(cfg: ExperimentConfig) -> Iterator[None]:
    """Around `trainer.fit()`: Train passes the driver's value on to its controller."""
    p = cfg.parallel
    wait_s = ELASTIC_START_TIMEOUT_S if p.min_workers else p.placement_timeout_s
    if not wait_s or _START_TIMEOUT_ENV in os.environ:  # 0: Train's own, retried for ever
        yield
        return
    os.environ[_START_TIMEOUT_ENV] = f"{wait_s:g}"
    try:
        yield
    finally:
        os.environ.pop(_START_TIMEOUT_ENV, None)


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the run's reported checkpoints


def _forget_removed_checkpoints(run: Run) -> None:
    """Ray Train refuses to continue a run whose list of reported checkpoints names one that is
    gone, which retention (checkpoint.retain) does: such a list is dropped. A resume picks the
    newest complete checkpoint in storage (worker.py), not from that list."""
    root = run.dir
    path = storage.join(root, RAY_SNAPSHOT)
    try:
        named = set(re.findall(r'"checkpoint_dir_name": *"([^"]+)"', storage.read_bytes(path).decode()))
    except (FileNotFoundError, UnicodeDecodeError):  # none (a run Ray never registered a checkpoint of)
        return
    if named - set(storage.listdir(root)):
        storage.rmtree(path, root)
        log.info("[%s] Ray Train's checkpoint list named checkpoints retention removed: dropped", run.name)


def _warn(run: Run):
    return lambda line: log.warning("[%s] %s", run.name, line)


def _where_it_stands(run: Run) -> tuple[str | None, dict[str, Any] | None]:
    """The newest complete checkpoint of the run and its meta.json (None, None for a fresh run),
    once the shards are known to be labelled if the run trains a classifier."""
    root = run.shards
    if storage.exists(storage.join(root, "manifest.json")):  # (missing shards fail in the workers)
        require_labels(run.cfg, root, read_manifest(root))  # no classifier on unlabelled shards
    existing = ckpt.latest_complete_checkpoint(run, warn=_warn(run))
    return existing, (ckpt.read_meta(existing) if existing else None)


def build_trainer(run: Run, mlflow_info: Optional[dict[str, str]] = None,
                  with_val: bool = True, callbacks: Optional[list] = None):
    """The TorchTrainer for `run` (not yet started)."""
    cfg = run.cfg
    # Train propagates the driver's DataContext to the workers: our progress line replaces
    # Ray Data's per-dataset bars, which would otherwise repeat for every epoch and eval pass.
    DataContext.get_current().enable_progress_bars = False
    p = cfg.parallel
    resources = {"CPU": p.cpus_per_worker}
    if p.use_gpu:
        resources["GPU"] = p.gpus_per_worker
    cfg_dict = cfg.to_dict()
    datasets: dict[str, Any] = {"train": train_placeholder}
    if with_val:
        datasets["val"] = EvalDatasetFactory(cfg_dict)
    # Ray Train reads and writes checkpoints through the same filesystem (S3 endpoint) as the rest.
    fs, inner = storage.filesystem(run.paths.runs)
    return Trainer(  # a worker's ConfigError or InputError is not retried (failures.py)
        train_per_worker,
        placement_timeout_s=p.placement_timeout_s,
        train_loop_config={"cfg": cfg_dict, "mlflow": mlflow_info, "datasets": list(datasets)},
        torch_config=TorchConfig(backend="nccl" if p.use_gpu else "gloo"),
        # min_workers: elastic, Train runs what the cluster has (a lost node costs a restart on
        # fewer workers, and the group grows back); workers re-derive the batch (for_world).
        scaling_config=ray.train.ScalingConfig(
            num_workers=(p.min_workers, p.num_workers) if p.min_workers else p.num_workers,
            use_gpu=p.use_gpu, resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=cfg.run_name,
            storage_path=inner,
            storage_filesystem=fs,
            # preemptions (a node drained with a deadline) have their own, unlimited budget
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures,
                                                   max_preemption_failures=-1),
            # retention is ours (checkpoint.retain, after each commit): Ray Train keeps its list whole
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
            callbacks=callbacks or None,
            logging_config=ray.train.LoggingConfig(log_level=library_log_level()),
        ),
        datasets=datasets,
        dataset_config=RankStreams(cfg_dict),
    )


def run_training(run: Run, tracking: bool = True, with_val: bool = True,
                 extra_tags: Optional[dict[str, str]] = None, parent_run_id: Optional[str] = None,
                 callbacks: Optional[list] = None, continuable: tuple[str, ...] = (),
                 start_metrics: Optional[dict[str, float]] = None) -> TrainSummary:
    """Run (or resume, same run name) a Ray Train job for `run` (`Run.resolve(cfg)`), logged to MLflow.

    Re-running with the same `tracking.run_name`/recipe resumes from the newest checkpoint
    and continues the same MLflow run; a new name starts fresh. A resume may change the keys of
    `continuable` (RunLogger.log_params); `start_metrics` are logged at the step it starts from.
    The pictures of the trained model are a step of their own after it (report.log_report).
    """
    if not isinstance(run, Run):
        raise TypeError(f"run_training takes a Run, not {type(run).__name__}: pass Run.resolve(cfg)")
    if run.cfg.train.init_from not in ("", "scratch"):
        check_source(run.cfg.train.init_from)  # a wrong file fails here, once, not in every worker
    t0 = time.time()
    run, existing, meta = run_to_continue(run, lambda r: through_outages(
        lambda: _where_it_stands(r), f"run {r.name}'s shards and checkpoints", _warn(r)), continuable)
    cfg, warn = run.cfg, _warn(run)
    if finished(run, meta):  # reported, not trained again (e.g. a sweep driver killed after a trial's
        # last checkpoint, before Tune recorded the trial as done)
        run_id = end_stored(run, meta, existing, warn) if tracking else None
        return TrainSummary(cfg.run_name, run_id, existing, {"step": meta["step"], **meta.get("metrics", {})},
                            time.time() - t0, already_finished=True)
    logger = None
    if tracking:
        logger = open_run(run, meta, warn, parent_run_id=parent_run_id, extra_tags=extra_tags,
                          continuable=continuable, start_metrics=start_metrics)
        log.info("[%s] MLflow run %s (%s) at %s", cfg.run_name, logger.run_id,
                 "resumed" if logger.resumed else "new", run.tracking_uri)
    if existing:  # a fresh run has no checkpoint list to forget: no read of the store for it
        through_outages(lambda: _forget_removed_checkpoints(run), f"run {run.name}'s checkpoint list", warn)
    mlflow_info = {"uri": run.tracking_uri, "run_id": logger.run_id} if logger else None
    trainer = build_trainer(run, mlflow_info, with_val=with_val, callbacks=callbacks)
    error: BaseException | None = None
    try:
        with _start_timeout(cfg):
            result = trainer.fit()
    except BaseException as e:  # noqa: BLE001 - its MLflow run is ended first, then it is raised
        error = e
    finally:
        clear_dead_everywhere()  # staged copies of workers killed mid-upload, on every node
    # Ray names checkpoints inside its filesystem: give them back as the user's path or URI
    checkpoint = (storage.join(run.dir, storage.basename(result.checkpoint.path))
                  if error is None and result.checkpoint else None)
    if logger:
        if not isinstance(error, KeyboardInterrupt):
            gather_spools(logger.run_id)  # rank 0's unsent metrics, wherever its node was: sent before the end
        end_run(logger, run, checkpoint, error, warn)
    if error is not None:
        user_error = final_error(error)
        if user_error is not None:  # the worker's (or controller's) own one-line error, not Train's wrapper
            raise user_error from error
        raise error
    return TrainSummary(cfg.run_name, logger.run_id if logger else None, checkpoint, dict(result.metrics or {}),
                        time.time() - t0)
