"""A training run's MLflow run, from open to end: started or resumed by name (its config, tags,
shard manifest and inputs logged), ended FINISHED with its checkpoint tag, FAILED with the error's
last line, or KILLED; and the run of one whose final checkpoint is already stored, ended FINISHED.
The driver (vitp/train/trainer.py) calls these around Ray Train's fit; no torch or ray here.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from mlflow.tracking import MlflowClient

from vitp import storage
from vitp.config import Run
from vitp.tracking.lineage import log_model_input, log_shards, shard_manifest
from vitp.tracking.runs import RunLogger
from vitp.tracking.store import ERROR_TAG, MLFLOW_OUTAGE_S, get_client, quote, through_mlflow_outages
from vitp.tracking.values import source_tags

Warn = Callable[[str], None]


def open_run(run: Run, meta: Optional[dict[str, Any]], warn: Warn, *, parent_run_id: Optional[str] = None,
             extra_tags: Optional[dict[str, str]] = None, continuable: tuple[str, ...] = (),
             start_metrics: Optional[dict[str, float]] = None) -> RunLogger:
    """Start the MLflow run of `run`, or resume the one that wrote its newest checkpoint (`meta`, that
    checkpoint's meta.json) or the unfinished one of its name, and log its config, start metrics,
    shard manifest and inputs; tried again through an MLflow outage (a second try resumes by name)."""
    return through_mlflow_outages(
        lambda: _open(run, meta, warn, parent_run_id, extra_tags or {}, continuable, start_metrics),
        "its MLflow run", warn)


def _open(run: Run, meta, warn: Warn, parent_run_id, extra_tags: dict[str, str], continuable,
          start_metrics) -> RunLogger:
    cfg = run.cfg
    tags = {"recipe": cfg.recipe, "variant": cfg.model.variant, **_source_tags(run, extra_tags),
            "dataset": run.dataset, "train_fraction": f"{cfg.data.train_fraction:g}", **cfg.tracking.tags,
            **extra_tags}
    previous = _run_that_wrote(get_client(run.tracking_uri), meta) if meta else None
    logger = RunLogger.start(run.tracking_uri, cfg.tracking.experiment, cfg.run_name,
                             run_id=previous.info.run_id if previous else None,
                             parent_run_id=parent_run_id, background=True,
                             timeout_s=cfg.tracking.log_timeout_s, spool_max_mb=cfg.tracking.spool_max_mb, tags=tags)
    try:
        logger.log_config(cfg.to_dict(), continued_at=meta["step"] if meta else None, continuable=continuable)
        if start_metrics:
            logger.log_metrics(start_metrics, step=meta["step"] if meta else 0)
        _log_inputs(logger, run, extra_tags.get("source_model_id"), warn)
    except BaseException:
        logger.close(timeout_s=0)  # its spool stays for the next try's start
        raise
    return logger


def end_run(logger: RunLogger, run: Run, checkpoint: Optional[str], error: Optional[BaseException],
            warn: Warn) -> None:
    """End the MLflow run as its training ended. Trained to its end (or its pause): tagged with its
    last checkpoint and ended FINISHED, waiting out an outage for it (trained work is worth it).
    Stopped on `error`: KILLED on Ctrl-C or when it was already ended KILLED from outside (a sweep's
    scheduler stopping the trial), else FAILED with the error's last line as a tag."""
    if error is None:
        if checkpoint:
            pause_at = run.cfg.train.pause_at
            tags = {"checkpoint": checkpoint, **({"vitp.paused_at": str(pause_at)} if pause_at else {})}
            through_mlflow_outages(lambda: logger.set_tags(tags), "its MLflow run's checkpoint tag", warn)
        logger.end("FINISHED", timeout_s=MLFLOW_OUTAGE_S)
    elif isinstance(error, KeyboardInterrupt) or _ended_killed(logger):
        logger.end("KILLED")
    else:
        lines = str(error).strip().splitlines()
        with contextlib.suppress(Exception):  # MLflow down too: the run still ends FAILED (or stays spooled)
            logger.set_tags({ERROR_TAG: f"{type(error).__name__}: {lines[-1] if lines else ''}"[:500]})
        logger.end("FAILED")


def end_stored(run: Run, meta: dict[str, Any], checkpoint: str, warn: Warn) -> Optional[str]:
    """The MLflow run of a run whose final checkpoint is stored (nothing left to train), ended
    FINISHED if it was not; its id, None when there is none. Left as it is when already FINISHED (end
    time and attempt unchanged). A final checkpoint copied from another run (a PBT exploit at the last
    step) names the donor's run, so this run's own is found by name."""
    return through_mlflow_outages(lambda: _end_stored(run, meta, checkpoint), "its MLflow run", warn)


def _end_stored(run: Run, meta: dict[str, Any], checkpoint: str) -> Optional[str]:
    cfg, client = run.cfg, get_client(run.tracking_uri)
    found = _run_that_wrote(client, meta)
    if found is None and meta.get("copied_from"):  # this run's own, by its name in its experiment
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        named = client.search_runs([exp.experiment_id], f"attributes.run_name = {quote(cfg.run_name)}") if exp else []
        found = named[0] if named else None
    if found and found.info.status != "FINISHED":
        logger = RunLogger.start(run.tracking_uri, cfg.tracking.experiment, cfg.run_name, run_id=found.info.run_id)
        logger.set_tags({"checkpoint": checkpoint})
        logger.end("FINISHED")
    return found.info.run_id if found else None


def _run_that_wrote(client: MlflowClient, meta: dict[str, Any]):
    """The MLflow run that wrote the checkpoint with this `meta` (so a re-run continues it), or None."""
    run_id = meta.get("mlflow_run_id")
    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except Exception:  # noqa: BLE001 - a different store: start or resume by name instead
        return None


def _ended_killed(logger: RunLogger) -> bool:
    try:
        return logger.client.get_run(logger.run_id).info.status == "KILLED"
    except Exception:  # noqa: BLE001 - MLflow unreachable: end as the error says
        return False


def _source_tags(run: Run, extra_tags: dict[str, str]) -> dict[str, str]:
    """MLflow's Source column: the vitp command that made the run (its driver may be a Tune trial,
    whose argv is Ray's)."""
    cfg = run.cfg
    sweep = extra_tags.get("sweep")
    command = (f"vitp sweep {sweep}" if sweep else
               f"vitp {'pretrain' if cfg.model.head == 'pretrain' else 'finetune'} {cfg.recipe}")
    return source_tags(command)


def _log_inputs(logger: RunLogger, run: Run, source_model_id: Optional[str], warn: Warn) -> None:
    """The run's inputs: the registered model it started from (if it did), and its shards (named by
    dataset and train fraction, digest of the manifest: same shards, same digest), with their
    manifest as an artifact."""
    manifest = storage.through_outages(lambda: shard_manifest(run.shards), f"run {run.name}'s shard manifest", warn)
    if source_model_id:
        log_model_input(logger.client, logger.run_id, source_model_id)
    if manifest is not None:
        logger.log_dict(manifest, "data/manifest.json")
        log_shards(logger.client, logger.run_id, run.shards_name, run.shards, manifest)
