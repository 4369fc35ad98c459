"""MLflow runs: resume by id or name, step-deduplicated metrics (optionally spooled off-thread), status.

An explicit MlflowClient, not mlflow's global active run (rank 0 and trial drivers log from one process);
client: store.py, spool: spool.py, param strings: values.py, what a resume may change: params.py. No torch
or ray. A SIGKILLed process leaves its run RUNNING: the next start() resumes it, or stale.py marks it KILLED.
"""
from __future__ import annotations

import logging
import math
import os
import time
import uuid
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from vitp import storage
from vitp.tracking.params import check_conflicts, continued
from vitp.tracking.redact import redact
from vitp.tracking.spool import HEARTBEAT_TAG, MetricSender
from vitp.tracking.spoolfile import METRICS_PER_BATCH, SPOOL_MAX_MB, add_leftover, has_leftovers
from vitp.tracking.store import (PARENT_TAG, TrackingError, get_client, get_or_create_experiment, quote,
                                 unreachable)
from vitp.tracking.values import PARAMS_PER_BATCH, chunks, params_for_mlflow, tags_for_mlflow

log = logging.getLogger(__name__)

ATTEMPT_TAG = "vitp.attempt"  # 1 for a fresh run, +1 on each resume: shows how often it restarted
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")

# --------------------------------------------------------------------------------------
# The run logger
# --------------------------------------------------------------------------------------


class RunLogger:
    """One MLflow run, owned by one process (Train rank 0 or a Tune trial driver).

    Use `RunLogger.start(...)`; as a context manager the run ends FINISHED on normal exit (or
    sys.exit(0)), FAILED on an exception and KILLED on KeyboardInterrupt. A process killed by
    SIGKILL/OOM cannot end its run: it stays RUNNING until a later start() resumes it by name or id.
    """

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str, run_name: str,
                 resumed: bool, last_steps: dict[str, int]):
        self.client = client
        self.tracking_uri = client.tracking_uri
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.run_name = run_name
        self.resumed = resumed
        self._last_steps = dict(last_steps)  # metric key -> highest step in MLflow (or spooled)
        self.status: str | None = None  # set by end()
        self._sender: MetricSender | None = None  # background=True: log_metrics only spools

    # ---------------------------------------------------------------- start / resume
    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        *,
        run_id: str | None = None,
        resume_by_name: bool = True,
        tags: dict | None = None,
        parent_run_id: str | None = None,
        background: bool = False, timeout_s: float = 5.0,
        spool_dir: str | os.PathLike | None = None, heartbeat_s: float = 30.0, spool_max_mb: float = SPOOL_MAX_MB,
    ) -> "RunLogger":
        """Continue `run_id` (whatever its status: a retried trial); else the newest unfinished
        (RUNNING/FAILED/KILLED) run named `run_name`; else create a run.

        A resumed run is set back to RUNNING and its `vitp.attempt` tag incremented. With
        `parent_run_id`, resume by name only matches runs under that parent (trial names repeat).
        background=True: log_metrics appends to a spool file (spoolfile.py, under `spool_dir`, at most
        `spool_max_mb` unsent) and returns; a thread sends it (each request at most `timeout_s`) and
        sets `vitp.heartbeat` every `heartbeat_s`. A leftover spool of this run goes first.
        """
        client = get_client(tracking_uri)
        experiment_id = get_or_create_experiment(client, experiment)
        all_tags = {**(tags or {}), HEARTBEAT_TAG: str(int(time.time()))}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id

        run = None
        if run_id:
            try:
                run = client.get_run(run_id)
            except MlflowException as e:
                if unreachable(e):  # the server is down: not a wrong id
                    raise
                raise TrackingError(
                    f"run_id={run_id!r} not found in {client.tracking_uri}: pass the id of an "
                    "existing run, or run_id=None to resume by name / start a new run"
                ) from e
            if run.info.experiment_id != experiment_id:
                raise TrackingError(
                    f"run_id={run_id!r} belongs to experiment id {run.info.experiment_id}, not "
                    f"{experiment!r} (id {experiment_id}): pass the matching experiment name"
                )
            if run.info.lifecycle_stage == "deleted":
                raise TrackingError(
                    f"run_id={run_id!r} is deleted: restore it (`mlflow runs restore --run-id "
                    f"{run_id}`) or start a new run"
                )
        elif resume_by_name:
            run = cls._find_unfinished(client, experiment_id, run_name, parent_run_id)

        if run is None:
            created = client.create_run(
                experiment_id, tags={**tags_for_mlflow(all_tags), ATTEMPT_TAG: "1"}, run_name=run_name
            )
            logger = cls(client, created.info.run_id, experiment_id, run_name, False, {})
            return logger._attach_spool(background, timeout_s, spool_dir, heartbeat_s, spool_max_mb, known={})

        rid = run.info.run_id
        tag_batch = tags_for_mlflow(all_tags)
        # A Train worker attaching to the RUNNING run its driver opened is not a new attempt; a
        # resume by name (driver restart) or of an ended run (trial retry) is.
        attempt = int(run.data.tags.get(ATTEMPT_TAG, "1") or 1)
        if not (run_id and run.info.status == "RUNNING"):
            attempt += 1
            tag_batch[ATTEMPT_TAG] = str(attempt)
        if run.info.status != "RUNNING":
            client.update_run(rid, status="RUNNING")
        if tag_batch:
            client.log_batch(rid, tags=[RunTag(k, v) for k, v in tag_batch.items()])
        last_steps = {}
        for key in run.data.metrics:
            history = client.get_metric_history(rid, key)
            if history:
                last_steps[key] = max(m.step for m in history)
        log.debug("resuming MLflow run %s (%s), attempt %d", rid, run.info.run_name, attempt)
        logger = cls(client, rid, experiment_id, run.info.run_name or run_name, True, last_steps)
        return logger._attach_spool(background, timeout_s, spool_dir, heartbeat_s, spool_max_mb, known=last_steps)

    @classmethod
    def existing(cls, tracking_uri: str, run_id: str) -> "RunLogger":
        """A logger that writes straight to the run `run_id` and leaves its status and attempt alone
        (what is added to a run after it ended: the post-training report)."""
        return cls(get_client(tracking_uri), run_id, "", "", True, {})

    @classmethod
    def attach(cls, tracking_uri: str, run_id: str, *, timeout_s: float = 5.0, spool_dir: str | os.PathLike | None = None,
               heartbeat_s: float = 30.0, spool_max_mb: float = SPOOL_MAX_MB) -> "RunLogger":
        """A background logger (see start) for a run another process opened (the Train driver's); no
        MLflow call here, so a worker (re)started in an outage trains on. The sender drops replays."""
        logger = cls(get_client(tracking_uri), run_id, "", "", True, {})
        return logger._attach_spool(True, timeout_s, spool_dir, heartbeat_s, spool_max_mb, known=None)

    def _attach_spool(self, background: bool, timeout_s: float, spool_dir, heartbeat_s: float,
                      spool_max_mb: float, known: dict[str, int] | None = None) -> "RunLogger":
        if not background and not has_leftovers(self.run_id, spool_dir):
            return self
        sender = MetricSender(self.tracking_uri, self.run_id, known, timeout_s=timeout_s,
                              spool_dir=spool_dir, heartbeat_s=heartbeat_s, spool_max_mb=spool_max_mb)
        for key, step in sender.adopted.items():  # spooled steps count as logged: replays skip them
            self._last_steps[key] = max(step, self._last_steps.get(key, -1))
        if background:
            self._sender = sender.start()
        elif not sender.close(timeout_s):
            log.warning("run %s: leftover spooled metrics could not be sent yet; kept for the next start", self.run_id)
        return self

    @staticmethod
    def _find_unfinished(client: MlflowClient, experiment_id: str, run_name: str, parent_run_id):
        filters = [f"attributes.run_name = {quote(run_name)}", "attributes.status != 'FINISHED'"]
        if parent_run_id:
            filters.append(f"tags.`{PARENT_TAG}` = {quote(parent_run_id)}")
        runs = client.search_runs(
            [experiment_id],
            filter_string=" and ".join(filters),
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0] if runs else None

    # ---------------------------------------------------------------- state
    @property
    def last_step(self) -> int:
        """Highest step already logged for any metric of this run; -1 if none."""
        return max(self._last_steps.values(), default=-1)

    def last_step_of(self, key: str) -> int:
        return self._last_steps.get(key, -1)

    # ---------------------------------------------------------------- params and config
    def log_params(self, params: dict[str, Any], continued_at: int | None = None,
                   continuable: tuple[str, ...] = ()) -> dict[str, str]:
        """Log params (nested dicts are flattened), skipping ones already identical in the run.

        Returns what was (or already had been) logged. A differing value raises ParamConflictError,
        except for a CONTINUABLE key (or one of `continuable`: a population-based search's perturbed
        keys) when `continued_at` (the step a run is continued from) is given: its first value stays
        and the new one is recorded as `<key>.continued_at_<step>` (MLflow params cannot change).
        """
        wanted = params_for_mlflow(params)
        existing = self.client.get_run(self.run_id).data.params
        if continued_at is not None:
            wanted = continued(wanted, existing, continued_at, continuable)
        check_conflicts(self.run_id, self.run_name, wanted, existing)
        new = [Param(k, v) for k, v in wanted.items() if k not in existing]
        for batch in chunks(new, PARAMS_PER_BATCH):
            try:
                self.client.log_batch(self.run_id, params=batch)
            except MlflowException as e:
                if unreachable(e):
                    raise
                # Another attempt of the same run logged in between: re-check, report ours.
                check_conflicts(self.run_id, self.run_name, wanted, self.client.get_run(self.run_id).data.params)
                raise TrackingError(f"logging params to run {self.run_id}: {e.message}") from e
        return wanted

    def log_config(self, cfg_dict: dict[str, Any], continued_at: int | None = None,
                   continuable: tuple[str, ...] = ()) -> dict[str, str]:
        """The resolved config as flattened, redacted params plus a redacted config.json artifact
        (the newest attempt's; `continued_at`, `continuable`: see log_params)."""
        logged = self.log_params(cfg_dict, continued_at=continued_at, continuable=continuable)
        self.log_dict(cfg_dict, "config.json")
        return logged

    # ---------------------------------------------------------------- metrics
    def log_metrics(self, metrics: dict[str, float], step: int) -> int:
        """Log one step of metrics in a batch; returns how many values were written.

        A step <= the last step already logged for that key is skipped (a resumed attempt replays
        steps after its last checkpoint), so MLflow never holds a step twice. NaN/inf are skipped
        with a warning.
        """
        step = int(step)
        now = int(time.time() * 1000)
        batch: list[Metric] = []
        for key, value in metrics.items():
            if step <= self._last_steps.get(key, -1):
                continue
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise TrackingError(
                    f"metric {key}={value!r} at step {step} is not a number: log a float"
                ) from None
            if not math.isfinite(v):
                log.warning("metric %s=%s at step %d is not finite: not logged", key, v, step)
                continue
            batch.append(Metric(key, v, now, step))
        for chunk in chunks(batch, METRICS_PER_BATCH):
            if self._sender is None:
                self.client.log_batch(self.run_id, metrics=chunk)
                continue
            try:
                self._sender.append(step, now, {m.key: m.value for m in chunk})
            except OSError as e:  # local disk full/unwritable: training goes on without these
                log.warning("metrics of step %d not spooled (%s): not logged", step, e)
                return 0
        for m in batch:
            self._last_steps[m.key] = step
        return len(batch)

    def backlog(self) -> bytes:
        """The spooled lines MLflow does not have yet (b"" when it has them all): a checkpoint keeps
        them, so a node lost with its spool loses no metric of a step before that checkpoint."""
        return self._sender.spool.unsent() if self._sender else b""

    def take_backlog(self, data: bytes) -> None:
        """Send the lines of another process's `backlog()` with this logger's (each (key, step)
        once: the server's steps decide what it still lacks); where both hold a step, this logger's
        value is the one kept."""
        if not data or self._sender is None:
            return
        add_leftover(self.run_id, f"backlog-{uuid.uuid4().hex[:8]}.jsonl", data, self._sender.spool.dir.parent)
        for key, step in self._sender.adopt().items():
            self._last_steps[key] = max(step, self._last_steps.get(key, -1))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait at most timeout_s until every spooled metric is in MLflow; False if some are not."""
        return self._sender.flush(timeout_s) if self._sender else True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Flush (bounded) and stop the background sender without ending the run (a Train worker's
        logger); what is not sent stays spooled for the next start() of this run. True if all sent."""
        sender, self._sender = self._sender, None
        return sender.close(timeout_s) if sender else True

    # ---------------------------------------------------------------- tags and artifacts
    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set (or overwrite) tags; credential-looking values are stored as "***"."""
        items = [RunTag(k, v) for k, v in tags_for_mlflow(tags).items()]
        for chunk in chunks(items, PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=chunk)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Log a file (or directory) at a local path or a URI (copied locally first)."""
        path = str(path)
        if not storage.exists(path):
            raise TrackingError(f"artifact {path} does not exist: write it before logging it")
        with storage.local_copy(path) as local:
            self.client.log_artifact(self.run_id, local, artifact_path)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        """A JSON/YAML artifact (sweep.json, the manifest, config.json), redacted like params."""
        self.client.log_dict(self.run_id, redact(d), artifact_file)

    # ---------------------------------------------------------------- end
    def end(self, status: str = "FINISHED", timeout_s: float = 30.0) -> None:
        """Mark the run FINISHED, FAILED or KILLED. Calling it again is a no-op.

        With background=True it first flushes for at most timeout_s; if MLflow does not answer,
        the run stays RUNNING and the spool stays on disk (one warning says where), never raising.
        """
        status = status.upper()
        if status not in TERMINAL_STATUSES:
            raise TrackingError(f"end(status={status!r}): use one of {', '.join(TERMINAL_STATUSES)}")
        if self.status is not None:
            return
        if (sender := self._sender) is None:
            self.client.set_terminated(self.run_id, status=status)
        elif not (self.close(timeout_s) and sender.terminate(status)):
            log.warning(
                "MLflow at %s unreachable (%s): run %s left RUNNING instead of %s, %d metric values kept "
                "in %s: RunLogger.start(..., run_id=%r) sends them, then end() it (or mark_stale_runs)",
                self.tracking_uri, sender.last_error.splitlines()[0][:200] if sender.last_error else "no answer",
                self.run_id, status, sender.left, sender.spool.dir, self.run_id)
        self.status = status

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or (issubclass(exc_type, SystemExit) and exc.code in (0, None)):
            status = "FINISHED"  # sys.exit(0) inside the block is a normal end
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        try:
            self.end(status)
        except Exception as end_error:  # noqa: BLE001 - never hide the exception that ended the run
            if exc_type is None:
                raise
            log.warning("could not mark MLflow run %s %s: %s", self.run_id, status, end_error)
        return False

    def __repr__(self) -> str:
        return (
            f"RunLogger(run_id={self.run_id!r}, name={self.run_name!r}, resumed={self.resumed}, "
            f"last_step={self.last_step}, uri={self.tracking_uri!r})"
        )
