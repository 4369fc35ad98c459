"""Driver side of a training run: the Ray Train `TorchTrainer` for a config, its MLflow run.

Owns Scaling/Run/FailureConfig, starting or resuming the MLflow run by name (ended FAILED on a
crash) and reporting a finished run instead of training it again. The worker side is worker.py;
must not run training steps itself.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import ray.train
import torch
from ray.data import DataContext
from ray.train.torch import TorchConfig

from .. import storage
from ..storage import through_outages
from ..config import ExperimentConfig, Run
from ..console import get_logger, library_log_level
from ..data.commands import require_labels
from ..data.ingest import dataset_name, normalize, peek_rows, shards_dir, shards_name
from ..data.shards import read_manifest
from ..model.analysis import REPORT, summary_lines, write_report
from ..model.attention import write_rollout_pngs
from ..model.vit import build_vit
from ..model.weights import check_source
from ..tracking.lineage import log_model_input, log_shards
from ..tracking.runs import RunLogger
from ..tracking.store import (ERROR_TAG, MLFLOW_OUTAGE_S, get_client, quote, resolve_tracking_uri,
                              through_mlflow_outages)
from ..tracking.values import source_tags
from . import checkpoint as ckpt
from .export import consolidate
from .controller import Trainer
from .failures import final_error
from .rerun import ignored_settings, run_to_continue
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


# An elastic run (parallel.min_workers) starts its worker group with as many workers as Ray's
# autoscaling coordinator says are ready. That view is refreshed every 20 s, so just after a node is
# lost (a preemption at its deadline) it can still count the node, and the group waits for a
# placement that never comes: Ray Train's default of 60 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S)
# before it decides again, with no failure counted. One refresh later the view holds only what is
# left. A value the user set in the environment wins.
ELASTIC_START_TIMEOUT_S = 25
_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


@contextmanager
def _elastic_start_timeout(cfg: ExperimentConfig) -> Iterator[None]:
    """Around `trainer.fit()`: Train passes the driver's value on to its controller."""
    if not cfg.parallel.min_workers or _START_TIMEOUT_ENV in os.environ:
        yield
        return
    os.environ[_START_TIMEOUT_ENV] = str(ELASTIC_START_TIMEOUT_S)
    try:
        yield
    finally:
        os.environ.pop(_START_TIMEOUT_ENV, None)


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the run's reported checkpoints


def _forget_removed_checkpoints(cfg: ExperimentConfig) -> None:
    """Ray Train refuses to continue a run whose list of reported checkpoints names one that is
    gone, which retention (checkpoint.retain) does: such a list is dropped. A resume picks the
    newest complete checkpoint in storage (worker.py), not from that list."""
    root = ckpt.run_dir(cfg)
    path = storage.join(root, RAY_SNAPSHOT)
    try:
        named = set(re.findall(r'"checkpoint_dir_name": *"([^"]+)"', storage.read_bytes(path).decode()))
    except (FileNotFoundError, UnicodeDecodeError):  # none (a run Ray never registered a checkpoint of)
        return
    if named - set(storage.listdir(root)):
        storage.rmtree(path, root)
        log.info("[%s] Ray Train's checkpoint list named checkpoints retention removed: dropped", cfg.run_name)


def _warn(cfg: ExperimentConfig):
    return lambda line: log.warning("[%s] %s", cfg.run_name, line)


def _open_mlflow_run(cfg: ExperimentConfig, uri: str, meta, parent_run_id, extra_tags, continuable,
                     start_metrics) -> RunLogger:
    """Start or resume the run's MLflow run and log its config, manifest and inputs. Safe to repeat
    (`through_mlflow_outages`): a second try resumes the run the first one created, by name."""
    previous = _mlflow_run_of(uri, meta) if meta else None
    logger = RunLogger.start(uri, cfg.tracking.experiment, cfg.run_name,
                             run_id=previous.info.run_id if previous else None,
                             parent_run_id=parent_run_id, background=True,
                             timeout_s=cfg.tracking.log_timeout_s, spool_max_mb=cfg.tracking.spool_max_mb,
                             tags={"recipe": cfg.recipe, "variant": cfg.model.variant,
                                   **_source_tags(cfg, extra_tags), "dataset": dataset_name(cfg),
                                   "train_fraction": f"{cfg.data.train_fraction:g}", **cfg.tracking.tags,
                                   **(extra_tags or {})})
    try:
        logger.log_config(cfg.to_dict(), continued_at=meta["step"] if meta else None, continuable=continuable)
        if start_metrics:
            logger.log_metrics(start_metrics, step=meta["step"] if meta else 0)
        _log_manifest(logger, cfg)
        if (extra_tags or {}).get("source_model_id"):  # started from a registered model
            log_model_input(logger.client, logger.run_id, extra_tags["source_model_id"])
    except BaseException:
        logger.close(timeout_s=0)  # its spool stays for the next try's start
        raise
    return logger


def _where_it_stands(cfg: ExperimentConfig) -> tuple[str | None, dict[str, Any] | None]:
    """The newest complete checkpoint of the run and its meta.json (None, None for a fresh run),
    once the shards are known to be labelled if the run trains a classifier."""
    root = shards_dir(cfg)
    if storage.exists(storage.join(root, "manifest.json")):  # (missing shards fail in the workers)
        require_labels(cfg, root, read_manifest(root))  # no classifier on unlabelled shards
    existing = ckpt.latest_complete_checkpoint(cfg, warn=_warn(cfg))
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
    """
    if not isinstance(run, Run):
        raise TypeError(f"run_training takes a Run, not {type(run).__name__}: pass Run.resolve(cfg)")
    if run.cfg.train.init_from not in ("", "scratch"):
        check_source(run.cfg.train.init_from)  # a wrong file fails here, once, not in every worker
    t0 = time.time()
    run, existing, meta = run_to_continue(run, lambda cfg: through_outages(
        lambda: _where_it_stands(cfg), f"run {cfg.run_name}'s shards and checkpoints", _warn(cfg)), continuable)
    cfg = run.cfg
    if existing and cfg.train.resume == "never":
        raise FileExistsError(
            f"run {cfg.run_name!r} already has checkpoints ({existing}) and train.resume='never': "
            "choose a new --set tracking.run_name=..., or use train.resume=auto to continue it"
        )
    if meta and meta["step"] >= (cfg.train.pause_at or cfg.train.steps):
        return _already_finished(cfg, existing, meta, tracking, t0)
    if existing:
        log.info("[%s] continuing from %s (same run name)", cfg.run_name, existing)
        planned = ((meta.get("config") or {}).get("train") or {}).get("steps")
        if planned is not None and planned != cfg.train.steps:
            log.info("[%s] train.steps %s -> %s: the LR schedule is re-planned to end at step %s",
                     cfg.run_name, planned, cfg.train.steps, cfg.train.steps)
    logger = None
    mlflow_info = None
    if tracking:
        uri = resolve_tracking_uri(cfg)
        logger = through_mlflow_outages(
            lambda: _open_mlflow_run(cfg, uri, meta, parent_run_id, extra_tags, continuable, start_metrics),
            "its MLflow run", _warn(cfg))
        mlflow_info = {"uri": uri, "run_id": logger.run_id}
        log.info("[%s] MLflow run %s (%s) at %s", cfg.run_name, logger.run_id,
                 "resumed" if logger.resumed else "new", uri)
    if existing:
        through_outages(lambda: _forget_removed_checkpoints(cfg), f"run {cfg.run_name}'s checkpoint list", _warn(cfg))
    trainer = build_trainer(run, mlflow_info, with_val=with_val, callbacks=callbacks)
    try:
        with _elastic_start_timeout(cfg):
            result = trainer.fit()
    except BaseException as e:
        if logger:
            killed = isinstance(e, KeyboardInterrupt) or _ended_killed(logger)
            if not isinstance(e, KeyboardInterrupt):
                gather_spools(logger.run_id)  # rank 0's unsent metrics, wherever its node was
            if not killed:
                _record_error(logger, e)
            logger.end("KILLED" if killed else "FAILED")
        user_error = final_error(e)
        if user_error is not None:  # the worker's own one-line error, not Train's wrapper
            raise user_error from e
        raise
    finally:
        clear_dead_everywhere()  # staged copies of workers killed mid-upload, on every node
    # Ray names checkpoints inside its filesystem: give them back as the user's path or URI
    checkpoint = (storage.join(run.dir, storage.basename(result.checkpoint.path))
                  if result.checkpoint else None)
    metrics = dict(result.metrics or {})
    if logger:
        if checkpoint:
            tags = {"checkpoint": checkpoint,
                    **({"vitp.paused_at": str(cfg.train.pause_at)} if cfg.train.pause_at else {})}
            through_mlflow_outages(lambda: logger.set_tags(tags), "its MLflow run's checkpoint tag", _warn(cfg))
            if cfg.model.head == "finetune":
                _log_rollouts(logger, cfg, checkpoint)
            elif metrics.get("step", 0) >= cfg.train.steps:  # pre-training done (not paused)
                _log_analysis(logger, cfg, checkpoint, int(metrics["step"]))  # paper Figure 7
        gather_spools(logger.run_id)  # end() sends them before it marks the run FINISHED
        logger.end("FINISHED", timeout_s=MLFLOW_OUTAGE_S)  # trained: worth waiting out an outage for
    return TrainSummary(cfg.run_name, logger.run_id if logger else None, checkpoint, metrics,
                        time.time() - t0)


def _already_finished(cfg: ExperimentConfig, checkpoint: str, meta: dict[str, Any], tracking: bool,
                      t0: float) -> TrainSummary:
    """The run's final checkpoint is in storage (e.g. a sweep driver killed after a trial's last
    checkpoint, before Tune recorded the trial as done): report it instead of training again.

    Its MLflow run is left as it is when already FINISHED (end time and attempt unchanged); one
    still marked RUNNING/FAILED/KILLED (the driver died before ending it) is ended FINISHED. A final
    checkpoint copied from another run (a PBT exploit at the last step) ends this run's own.
    """
    ignored = ignored_settings(meta, cfg)  # a changed setting that this does not use is worth a warning
    log.log(logging.WARNING if ignored else logging.INFO,
            "[%s] already %s: %s is step %d of %d; nothing to train%s (raise train.pause_at / "
            "train.steps to continue it, or choose a new --set tracking.run_name=... to train again)",
            cfg.run_name, "paused" if meta["step"] < cfg.train.steps else "finished", checkpoint,
            meta["step"], cfg.train.steps, f", so {ignored} change nothing" if ignored else "")
    run_id = through_mlflow_outages(lambda: _finish_mlflow_run(cfg, meta, checkpoint), "its MLflow run",
                                    _warn(cfg)) if tracking else None
    metrics = {"step": meta["step"], **meta.get("metrics", {})}
    return TrainSummary(cfg.run_name, run_id, checkpoint, metrics, time.time() - t0, already_finished=True)


def _finish_mlflow_run(cfg: ExperimentConfig, meta: dict, checkpoint: str) -> str | None:
    """The MLflow run of a run whose final checkpoint is stored, ended FINISHED; its id (None: none)."""
    uri = resolve_tracking_uri(cfg)
    run = _mlflow_run_of(uri, meta)
    if run is None and meta.get("copied_from"):  # another trial's final state (a PBT exploit): this run's own
        run = _mlflow_run_named(uri, cfg)
    if run and run.info.status != "FINISHED":
        logger = RunLogger.start(uri, cfg.tracking.experiment, cfg.run_name, run_id=run.info.run_id)
        logger.set_tags({"checkpoint": checkpoint})
        logger.end("FINISHED")
    return run.info.run_id if run else None


def _final_model_and_rows(cfg: ExperimentConfig, checkpoint: str, count: int):
    """The trained model (consolidated from `checkpoint`) and the first `count` held-out rows
    (a few rows of one shard: no Ray Data pipeline), for the pictures logged after a run."""
    model = build_vit(cfg.model, cfg.data.image_size, mpp=cfg.train.objective == "mpp")
    model.load_state_dict(consolidate(checkpoint))
    return model, peek_rows(cfg, ("val", "train"), count)


def _log_rollouts(logger, cfg: ExperimentConfig, checkpoint: str, count: int = 4) -> None:
    """Attention rollouts of the fine-tuned model on a few held-out images, as run artifacts
    (the paper's Figure 6 view). Best effort: a failure here is reported, not raised."""
    try:
        model, rows = _final_model_and_rows(cfg, checkpoint, count)
        with tempfile.TemporaryDirectory() as d:
            for path in write_rollout_pngs(model, rows["image"], rows["label"].tolist(), d,
                                           originals=rows["stored"]):
                logger.log_artifact(path, "attention")
    except Exception as e:  # the run itself succeeded; say why the pictures are missing
        log.warning("[%s] attention rollouts not logged: %s", cfg.run_name, e)


def _log_analysis(logger, cfg: ExperimentConfig, checkpoint: str, step: int, count: int = 4) -> None:
    """The Figure 7 report of the pre-trained model (patch-embedding filters, position-embedding
    similarity, attention distance on a few held-out images) under the run's `analysis/`
    artifacts, and its numbers as `analysis/*` metrics. Best effort, like _log_rollouts."""
    try:
        model, rows = _final_model_and_rows(cfg, checkpoint, count)
        images = normalize(torch.from_numpy(rows["image"])).contiguous()  # (n, 3, S, S)
        with tempfile.TemporaryDirectory() as d:
            report = write_report(model, d, images)
            for name in (*report["files"], REPORT):
                logger.log_artifact(storage.join(d, name), "analysis")
        pos = report["pos_embed"]
        logger.log_metrics({f"analysis/pos_embed_{k}": v for k, v in (
            ("distance_corr", pos["distance_corr"]), ("neighbour_sim", pos["neighbour_similarity"]),
            ("other_sim", pos["other_similarity"])) if v is not None}, step)
        for line in summary_lines(report):
            log.info("[%s] %s", cfg.run_name, line)
    except Exception as e:  # the run itself succeeded; say why the report is missing
        log.warning("[%s] Figure 7 analysis not logged: %s", cfg.run_name, e)


def _mlflow_run_of(uri: str, meta: dict[str, Any]):
    """The MLflow run that wrote the checkpoint with this `meta` (so a re-run continues it), or None."""
    run_id = meta.get("mlflow_run_id")
    if not run_id:
        return None
    try:
        return get_client(uri).get_run(run_id)
    except Exception:  # a different store: start or resume by name instead
        return None


def _mlflow_run_named(uri: str, cfg: ExperimentConfig):
    """This run's MLflow run, by its name in its experiment, or None."""
    client = get_client(uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], f"attributes.run_name = {quote(cfg.run_name)}") if exp else []
    return runs[0] if runs else None


def _ended_killed(logger) -> bool:
    """Whether the run was already ended KILLED from outside (a sweep's scheduler stopping this
    trial, whose stop reaches the training here as an error): then it stays KILLED."""
    try:
        return logger.client.get_run(logger.run_id).info.status == "KILLED"
    except Exception:  # noqa: BLE001 - MLflow unreachable: end as the error says
        return False


def _record_error(logger, e: BaseException) -> None:
    lines = str(e).strip().splitlines()
    try:
        logger.set_tags({ERROR_TAG: f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]})
    except Exception:  # noqa: BLE001 - MLflow down too: the run still ends FAILED below (or stays spooled)
        pass


def _source_tags(cfg: ExperimentConfig, extra_tags: Optional[dict[str, str]]) -> dict[str, str]:
    """MLflow's Source column: the vitp command that made the run (its driver may be a Tune trial,
    whose argv is Ray's)."""
    sweep = (extra_tags or {}).get("sweep")
    command = (f"vitp sweep {sweep}" if sweep else
               f"vitp {'pretrain' if cfg.model.head == 'pretrain' else 'finetune'} {cfg.recipe}")
    return source_tags(command)


def _log_manifest(logger, cfg: ExperimentConfig) -> None:
    """The shards' manifest as an artifact, and the shards as the run's dataset input (named by
    dataset and train fraction, digest of the manifest: same shards, same digest)."""
    root = shards_dir(cfg)
    path = storage.join(root, "manifest.json")
    manifest = through_outages(lambda: storage.read_json(path) if storage.exists(path) else None,
                               f"run {cfg.run_name}'s shard manifest", _warn(cfg))
    if manifest is not None:
        logger.log_dict(manifest, "data/manifest.json")
        log_shards(logger.client, logger.run_id, shards_name(cfg), root, manifest=manifest)
