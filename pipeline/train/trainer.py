"""Driver side of a training run: Ray Train `TorchTrainer` from the config, MLflow run, result.

Builds ScalingConfig / RunConfig / FailureConfig from the config, hands the dataset factories
to Train (re-evaluated on every worker-group restart so a resumed attempt streams from the
epoch its checkpoint stopped in), starts or resumes the MLflow run by name and ends it FAILED
on a crash.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..config import ExperimentConfig
from . import checkpoint as ckpt


def storage_path(cfg: ExperimentConfig) -> str:
    """Where Ray Train keeps this run's checkpoints: <work_dir>/runs (a local path or a URI)."""
    if "://" in cfg.work_dir:
        return cfg.work_dir.rstrip("/") + "/runs"
    return os.path.abspath(os.path.join(cfg.work_dir, "runs"))


def latest_complete_checkpoint(cfg: ExperimentConfig) -> Optional[str]:
    """Newest checkpoint directory of this run that passes `checkpoint.verify` (local storage)."""
    run_dir = os.path.join(storage_path(cfg), cfg.run_name)
    if "://" in run_dir or not os.path.isdir(run_dir):
        return None
    for name in sorted(os.listdir(run_dir), reverse=True):
        path = os.path.join(run_dir, name)
        if name.startswith("checkpoint_") and ckpt.verify(path)[0]:
            return path
    return None


def train_rows_per_epoch(cfg: ExperimentConfig) -> int:
    """Training images per epoch, from the shards' manifest."""
    from ..data import shards as sh
    from ..data.ingest import shards_dir

    return int(sh.read_manifest(shards_dir(cfg))["counts"]["train"])


def stream_start_epoch(cfg: ExperimentConfig) -> int:
    """The epoch a (re)started attempt streams from: that of the newest complete checkpoint.

    Called by the dataset factory (in the Train controller) and by every worker, so both agree.
    With remote storage (URIs) attempts stream from epoch 0 and workers skip what was consumed.
    """
    latest = latest_complete_checkpoint(cfg)
    return int(ckpt.read_meta(latest)["train_state"]["epoch"]) if latest else 0


class TrainDatasetFactory:
    """Picklable `() -> Dataset` for Train: called on every worker-group (re)start, it streams
    from the epoch the newest complete checkpoint stopped in (the data position)."""

    def __init__(self, cfg_dict: dict[str, Any]):
        self.cfg_dict = cfg_dict

    def __call__(self):
        from ray.data import DataContext

        from ..data.ingest import build_train_dataset

        DataContext.get_current().enable_progress_bars = False  # the split runs in this process
        cfg = ExperimentConfig.from_dict(self.cfg_dict)
        return build_train_dataset(cfg, start_epoch=stream_start_epoch(cfg))


class EvalDatasetFactory:
    def __init__(self, cfg_dict: dict[str, Any]):
        self.cfg_dict = cfg_dict

    def __call__(self):
        from ray.data import DataContext

        from ..data.ingest import build_eval_dataset

        DataContext.get_current().enable_progress_bars = False
        return build_eval_dataset(ExperimentConfig.from_dict(self.cfg_dict))


@dataclass
class TrainSummary:
    run_name: str
    mlflow_run_id: Optional[str]
    checkpoint: Optional[str]
    metrics: dict[str, Any]
    seconds: float
    already_finished: bool = False  # the run's final checkpoint existed: nothing was trained


def build_trainer(cfg: ExperimentConfig, mlflow_info: Optional[dict[str, str]] = None,
                  with_val: bool = True, callbacks: Optional[list] = None):
    """The TorchTrainer for `cfg` (not yet started)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from .loop import train_per_worker

    from ray.data import DataContext

    # Train propagates the driver's DataContext to the workers: our progress line replaces
    # Ray Data's per-dataset bars, which would otherwise repeat for every epoch and eval pass.
    DataContext.get_current().enable_progress_bars = False
    p = cfg.parallel
    resources = {"CPU": p.cpus_per_worker}
    if p.use_gpu:
        resources["GPU"] = p.gpus_per_worker
    cfg_dict = cfg.to_dict()
    datasets: dict[str, Any] = {"train": TrainDatasetFactory(cfg_dict)}
    if with_val:
        datasets["val"] = EvalDatasetFactory(cfg_dict)
    return TorchTrainer(
        train_per_worker,
        train_loop_config={"cfg": cfg_dict, "mlflow": mlflow_info, "datasets": list(datasets)},
        torch_config=TorchConfig(backend="nccl" if p.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=p.num_workers, use_gpu=p.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=cfg.run_name,
            storage_path=storage_path(cfg),
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints or None),
            callbacks=callbacks or None,
        ),
        datasets=datasets,
    )


def run_training(cfg: ExperimentConfig, tracking: bool = True, with_val: bool = True,
                 extra_tags: Optional[dict[str, str]] = None, parent_run_id: Optional[str] = None,
                 callbacks: Optional[list] = None) -> TrainSummary:
    """Run (or resume, same run name) a Ray Train job for `cfg`, logged to MLflow.

    Re-running with the same `tracking.run_name`/recipe resumes from the newest checkpoint
    and continues the same MLflow run; a new name starts fresh.
    """
    from ..tracking import RunLogger, resolve_tracking_uri

    from ..config import absolute_paths

    cfg = absolute_paths(cfg)  # workers do not share the driver's working directory
    t0 = time.time()
    existing = latest_complete_checkpoint(cfg)
    if existing and cfg.train.resume == "never":
        raise FileExistsError(
            f"run {cfg.run_name!r} already has checkpoints ({existing}) and train.resume='never': "
            "choose a new --set tracking.run_name=..., or use train.resume=auto to continue it"
        )
    meta = ckpt.read_meta(existing) if existing else None
    if meta and meta["step"] >= cfg.train.steps:
        return _already_finished(cfg, existing, meta, tracking, t0)
    if existing:
        print(f"[{cfg.run_name}] continuing from {existing} (same run name)", flush=True)
    logger = None
    mlflow_info = None
    if tracking:
        uri = resolve_tracking_uri(cfg)
        run = _mlflow_run_of(uri, meta) if meta else None
        logger = RunLogger.start(uri, cfg.tracking.experiment, cfg.run_name,
                                 run_id=run.info.run_id if run else None,
                                 parent_run_id=parent_run_id,
                                 tags={"recipe": cfg.recipe, "variant": cfg.model.variant,
                                       "dataset": cfg.data.source, **cfg.tracking.tags,
                                       **(extra_tags or {})})
        logger.log_config(cfg.to_dict())
        _log_manifest(logger, cfg)
        mlflow_info = {"uri": uri, "run_id": logger.run_id}
        print(f"[{cfg.run_name}] MLflow run {logger.run_id} ({'resumed' if logger.resumed else 'new'}) at {uri}",
              flush=True)
    trainer = build_trainer(cfg, mlflow_info, with_val=with_val, callbacks=callbacks)
    try:
        result = trainer.fit()
    except BaseException as e:
        if logger:
            logger.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    checkpoint = result.checkpoint.path if result.checkpoint else None
    metrics = dict(result.metrics or {})
    if logger:
        if checkpoint:
            logger.set_tags({"checkpoint": checkpoint})
            if cfg.model.head == "finetune":
                _log_rollouts(logger, cfg, checkpoint)
        logger.end("FINISHED")
    return TrainSummary(cfg.run_name, logger.run_id if logger else None, checkpoint, metrics,
                        time.time() - t0)


def _already_finished(cfg: ExperimentConfig, checkpoint: str, meta: dict[str, Any], tracking: bool,
                      t0: float) -> TrainSummary:
    """The run's final checkpoint is in storage (e.g. a sweep driver killed after a trial's last
    checkpoint, before Tune recorded the trial as done): report it instead of training again.

    Its MLflow run is left as it is when already FINISHED (end time and attempt unchanged); one
    still marked RUNNING/FAILED/KILLED (the driver died before ending it) is ended FINISHED.
    """
    print(f"[{cfg.run_name}] already finished: {checkpoint} is step {meta['step']} of "
          f"{cfg.train.steps}; nothing to train (raise train.steps to continue it, or choose a new "
          "--set tracking.run_name=... to train again)", flush=True)
    run_id = None
    if tracking:
        from ..tracking import RunLogger, resolve_tracking_uri

        uri = resolve_tracking_uri(cfg)
        run = _mlflow_run_of(uri, meta)
        run_id = run.info.run_id if run else None
        if run and run.info.status != "FINISHED":
            logger = RunLogger.start(uri, cfg.tracking.experiment, cfg.run_name, run_id=run_id)
            logger.set_tags({"checkpoint": checkpoint})
            logger.end("FINISHED")
    metrics = {"step": meta["step"], **meta.get("metrics", {})}
    return TrainSummary(cfg.run_name, run_id, checkpoint, metrics, time.time() - t0, already_finished=True)


def _log_rollouts(logger, cfg: ExperimentConfig, checkpoint: str, count: int = 4) -> None:
    """Attention rollouts of the fine-tuned model on a few held-out images, as run artifacts
    (the paper's Figure 6 view). Best effort: a failure here is reported, not raised."""
    import tempfile

    try:
        import numpy as np
        import torch

        from ..data.ingest import build_eval_dataset, normalize
        from ..model import build_vit
        from ..model.attention import attention_rollout, save_rollout_png
        from .export import consolidate

        model = build_vit(cfg.model, cfg.data.image_size)
        model.load_state_dict(consolidate(checkpoint))
        model.eval()
        rows = build_eval_dataset(cfg).take(count)
        images = np.stack([r["image"] for r in rows])  # (n, S, S, 3) uint8
        x = normalize(torch.from_numpy(images)).contiguous()
        with torch.no_grad():
            rollout = attention_rollout(model, x)  # (n, gh, gw)
            pred = model(x).argmax(-1).tolist()
        with tempfile.TemporaryDirectory() as d:
            for i, r in enumerate(rows):
                path = os.path.join(d, f"rollout_{i}_label{int(r['label'])}_pred{pred[i]}.png")
                save_rollout_png(images[i], rollout[i], path)
                logger.log_artifact(path, "attention")
    except Exception as e:  # the run itself succeeded; say why the pictures are missing
        print(f"[{cfg.run_name}] attention rollouts not logged: {e}", flush=True)


def _mlflow_run_of(uri: str, meta: dict[str, Any]):
    """The MLflow run that wrote the checkpoint with this `meta` (so a re-run continues it), or None."""
    run_id = meta.get("mlflow_run_id")
    if not run_id:
        return None
    from ..tracking.runs import get_client

    try:
        return get_client(uri).get_run(run_id)
    except Exception:  # a different store: start or resume by name instead
        return None


def _log_manifest(logger, cfg: ExperimentConfig) -> None:
    from ..data.ingest import shards_dir

    path = os.path.join(shards_dir(cfg), "manifest.json")
    if "://" not in path and os.path.exists(path):
        with open(path) as f:
            logger.log_dict(json.load(f), "data/manifest.json")


# ---------------------------------------------------------------------------------------
# Driver conveniences the CLI calls
# ---------------------------------------------------------------------------------------


def connect_ray(cfg: ExperimentConfig, address: Optional[str] = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS); else start a local Ray sized for `cfg`.

    Locally the CPU count is logical: Train's controller and Ray Data's read/augment tasks need
    slots beside the workers, so we ask for at least workers x cpus_per_worker + 2.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    p = cfg.parallel
    need = int(p.num_workers * p.cpus_per_worker + 0.999) + 2
    ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
             logging_level="WARNING")


def ensure_shards(cfg: ExperimentConfig, log=print) -> str:
    """Shards for `cfg` exist (manifest present) or, for the corpora that need no files
    (synthetic fractals, scikit-learn's digits), are made now."""
    from ..data import shards as sh
    from ..data.ingest import shards_dir

    root = shards_dir(cfg)
    try:
        sh.read_manifest(root)
        return root
    except FileNotFoundError:
        if cfg.data.source not in ("synthetic", "digits"):
            raise FileNotFoundError(
                f"no shards at {root} for data.source={cfg.data.source!r}: run "
                f"`vitp preprocess {cfg.recipe}` first (or set data.shards to existing shards)"
            ) from None
    from ..data.commands import run_preprocess

    log(f"[{cfg.run_name}] no shards at {root}: preprocessing the bundled {cfg.data.source} corpus")
    run_preprocess(cfg, overwrite=False, log=log)
    return root
