"""What a sweep prints and records of trials Tune stopped (a Tune callback on the driver), and
which of a trial's Train reports reach Tune (EvaluationReports). One line per trial start and end
with the sweep's ETA; a trial the scheduler stopped early has its MLflow run ended KILLED with tags
naming the scheduler and step, never FAILED. MLflow only through `vitp.tracking`.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable, Mapping, Optional

from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback

from ..config import ExperimentConfig
from ..console import duration, get_logger, progress
from ..tracking import find_runs
from ..tracking.redact import redact_message
from ..tracking.store import ERROR_TAG, get_client, quote, through_mlflow_outages
from ..tracking.values import tags_for_mlflow
from .population import EVALUATION, LAST_EVALUATION, evaluations

_log = get_logger(__name__)

STOPPED_BY_TAG = "vitp.stopped_by"  # who ended a run early: "asha" (the scheduler), ...
STOPPED_AT_TAG = "vitp.stopped_at_step"

# A trial's last result key holding the user's mistake it ended on (a ConfigError or InputError
# inside its training: e.g. a source whose weights file is damaged). Such a trial returns instead of
# raising: Tune retries every error trial_retries times, and the same input fails the same way on
# every attempt. Its metric is NaN (no score); outcome.summarise and SweepProgress count it as failed.
USER_ERROR = "vitp/user_error"


def trial_error(error: Any, result: Optional[Mapping[str, Any]]) -> str:
    """The one line a failed trial ended on: the user's mistake it returned with, or the last
    line of the error Tune recorded ("" for a trial that did not fail); redacted (redact_message):
    it is printed, tagged `vitp.error` and kept in the sweep's summary."""
    if (result or {}).get(USER_ERROR):
        return redact_message((str(result[USER_ERROR]).splitlines() or [""])[0])[:300]
    return redact_message((str(error).strip().splitlines() or ["?"])[-1])[:300] if error else ""


class EvaluationReports(TuneReportCallback):
    """Ray's TuneReportCallback for the Train reports that carry the sweep's `metric` (a checkpoint
    saved between evaluations, train.checkpoint_every, reports none, and Tune ends the whole sweep on
    a result without the metric it searches on), each with the evaluations made so far (EVALUATION)
    and whether it is the run's last (LAST_EVALUATION): what the sweep's ASHA counts and spares."""

    def __init__(self, metric: str, cfg: ExperimentConfig):
        super().__init__()
        self.metric, self.cfg = metric, cfg

    def after_report(self, run_context, metrics, checkpoint):
        if self.metric in metrics[0]:
            step = int(metrics[0].get("step", 0))
            marked = {**metrics[0], EVALUATION: evaluations(step, self.cfg),
                      LAST_EVALUATION: step >= self.cfg.train.steps}
            super().after_report(run_context, [marked, *metrics[1:]], checkpoint)


_ACTIVE: dict[str, "SweepProgress"] = {}  # sweep name -> its callback in this driver


class SweepProgress(Callback):
    """Prints `[sweep NAME] trial i/N ...` lines with an ETA, and marks pruned trials' runs."""

    def __init__(self, name: str, total: int, concurrency: int, metric: str, tracking_uri: str,
                 experiment: str, run_name: Callable[[Mapping[str, Any], str], str], scheduler: str = "none",
                 planned_steps: Callable[[Mapping[str, Any]], int] | None = None,
                 log: Callable[[str], None] = _log.info):
        self.name, self.total, self.concurrency, self.metric = name, total, max(1, concurrency), metric
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.planned_steps = planned_steps
        self.scheduler, self.log = scheduler, log
        self.started: dict[str, float] = {}
        self.durations: list[float] = []
        self.ended = 0
        self.stopped: dict[str, Any] = {}  # trial id -> the step the scheduler stopped it at
        self.failed: dict[str, str] = {}  # trial id -> the error it ended on
        self.completed: set[str] = set()  # trials Tune saw complete (their own driver ends their runs)
        _ACTIVE[name] = self

    def __getstate__(self):  # Tune pickles its callbacks with the sweep state: no functions
        return {k: v for k, v in self.__dict__.items() if k not in ("log", "run_name", "planned_steps")}

    def __setstate__(self, state):
        """Tune.restore brings back the saved callback, not the resumed driver's: it takes that one's
        functions (run names, planned steps, log) and its place as the sweep's (`active`)."""
        fresh = _ACTIVE.get(state["name"])
        self.__dict__.update(state, log=fresh.log if fresh else _log.info,
                             run_name=fresh.run_name if fresh else (lambda config, trial_id="": "?"),
                             planned_steps=fresh.planned_steps if fresh else None)
        _ACTIVE[state["name"]] = self

    def get_state(self) -> dict:  # saved with the sweep's state: a resumed driver goes on counting
        return {"ended": self.ended, "durations": list(self.durations), "stopped": dict(self.stopped),
                "failed": dict(self.failed), "completed": sorted(self.completed)}

    def set_state(self, state: dict) -> None:
        self.ended, self.durations, self.stopped = state["ended"], list(state["durations"]), dict(state["stopped"])
        self.failed, self.completed = dict(state.get("failed", {})), set(state.get("completed", ()))

    @staticmethod
    def active(name: str) -> "SweepProgress":
        """The callback Tune runs for sweep `name` in this process (the restored one after a resume)."""
        return _ACTIVE[name]

    def _eta(self) -> str:
        left = self.total - self.ended
        if not self.durations or left <= 0:
            return ""
        mean = sum(self.durations) / len(self.durations)
        return duration(mean * left / min(self.concurrency, left))

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started[trial.trial_id] = time.time()
        self.log(f"[sweep {self.name}] trial {trial.trial_id} started: {self.run_name(trial.config, trial.trial_id)}")

    def _end(self, trial, what: str) -> None:
        self.ended += 1
        t0 = self.started.pop(trial.trial_id, None)
        took = time.time() - t0 if t0 is not None else None
        if took is not None:
            self.durations.append(took)
        eta = self._eta()
        self.log(f"[sweep {self.name}] {self.ended}/{self.total} {self.run_name(trial.config, trial.trial_id)}: {what}"
                 f"{f' in {duration(took)}' if took is not None else ''}{f', ETA {eta}' if eta else ''}")
        # on a terminal, a bar of the sweep (the line above already says it elsewhere)
        progress(f"[sweep {self.name}] {self.ended}/{self.total} trials", self.ended, self.total,
                 eta or "-", log=lambda line: None)

    def on_trial_complete(self, iteration, trials, trial, **info):
        # A trial the scheduler stopped completes too (Tune marks its last result done): it is
        # told apart by its last reported step, short of the steps it was planned to train.
        result = trial.last_result or {}
        self.completed.add(trial.trial_id)
        if result.get(USER_ERROR):  # ended on the user's mistake: failed, not retried
            self._end(trial, f"FAILED: {trial_error(None, result)[:200]}")
            return
        value = result.get(self.metric)
        score = f"{self.metric} {value:.4f}" if isinstance(value, (int, float)) else f"no {self.metric}"
        step = result.get("step")
        planned = self.planned_steps(trial.config) if self.planned_steps else None
        if self.scheduler == "none" or step is None or planned is None or step >= planned:
            self._end(trial, score)
            return
        self._end(trial, f"stopped early by {self.scheduler} at step {step} of {planned} ({score})")
        self.stopped[trial.trial_id] = step
        self._mark("KILLED", f"tags.trial_id = {quote(trial.trial_id)}",
                   {STOPPED_BY_TAG: self.scheduler, STOPPED_AT_TAG: str(step)})

    def settle(self, done: bool = True) -> None:
        """Once every trial has ended: mark the stopped trials' runs KILLED again (a stopped trial's
        own driver sees the stop as an error and may end its run FAILED after the first mark; those
        stopped under an earlier driver of the sweep are found by the first mark's tags) and,
        if the sweep is `done`, end FAILED each trial run still RUNNING of a trial that did not
        complete: its process died with its actor or node before it could end it (a driver killed
        meanwhile missed on_trial_error). A completed trial's run left RUNNING stays so: MLflow was
        down as it ended and lacks some of its metrics (tracking/runs.py)."""
        for trial_id, step in getattr(self, "stopped", {}).items():
            self._mark("KILLED", f"tags.trial_id = {quote(trial_id)}",
                       {STOPPED_BY_TAG: self.scheduler, STOPPED_AT_TAG: str(step)}, patient=True)
        # and those an earlier driver of the sweep stopped (this one was started with --resume): their
        # first mark's tags say so, whatever the trial's own process ended the run with since
        self._mark("KILLED", f"tags.`{STOPPED_BY_TAG}` LIKE '%' and attributes.status != 'KILLED'", {}, patient=True)
        if done:
            failed, completed = getattr(self, "failed", {}), getattr(self, "completed", set())
            running = self._mark(None, "attributes.status = 'RUNNING'", {}, patient=True)
            for trial_id in {r["tags"].get("trial_id") for r in running if r["tags"].get("trial_id")} - completed:
                self._mark("FAILED", f"tags.trial_id = {quote(trial_id)} and attributes.status = 'RUNNING'", {
                    ERROR_TAG: failed.get(trial_id, "the trial ended without ending its run (its process died)")[:500]},
                    patient=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        error = trial_error(getattr(trial, "error_msg", None) or "see the trial's error.txt", None)
        self.failed[trial.trial_id] = error
        self._end(trial, f"FAILED: {error[:200]}")
        # a trial whose actor or node died could not end its own run
        self._mark("FAILED", f"tags.trial_id = {quote(trial.trial_id)} and attributes.status = 'RUNNING'",
                   {ERROR_TAG: error[:500]})

    def _mark(self, status: str | None, filter_string: str, tags: dict[str, str], patient: bool = False) -> list[dict]:
        """End this sweep's runs matching `filter_string` with `status` (None: only find them) and
        `tags`; the runs. `patient` (the driver's settle, not Tune's loop): through an MLflow outage."""
        def mark() -> list[dict]:
            runs = find_runs(self.tracking_uri, self.experiment, f"{filter_string} and tags.sweep = {quote(self.name)}")
            for run in runs if status else ():
                self._tag(run["run_id"], tags)
                get_client(self.tracking_uri).set_terminated(run["run_id"], status)
            return runs
        try:
            return through_mlflow_outages(mark, f"[sweep {self.name}] its trial runs", self.log) if patient else mark()
        except Exception as e:  # noqa: BLE001 - an MLflow hiccup must not end the sweep
            self.log(f"[sweep {self.name}] could not mark trial runs {status} ({filter_string}): "
                     f"{redact_message(str(e))}")
            return []

    def _tag(self, run_id: str, tags: dict[str, str]) -> None:
        """Set `tags` on a trial's run, redacted and cut to MLflow's limits as RunLogger.set_tags does
        (an error line may hold a password a trial's URI or command carried)."""
        client = get_client(self.tracking_uri)
        for key, value in tags_for_mlflow(tags).items():
            client.set_tag(run_id, key, value)


class CtrlC:
    """Whether Ctrl-C interrupted a `tuner.fit()` inside this block: Tune catches it, saves the search
    and returns as if the sweep had ended, putting back the SIGINT handler it found; so the handler
    set here is back afterwards only if Ctrl-C was pressed (a second one then raises KeyboardInterrupt)."""

    pressed = False

    @staticmethod
    def _again(signum, frame):
        raise KeyboardInterrupt

    def __enter__(self) -> "CtrlC":
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGINT, self._again) if main else None
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            self.pressed = signal.getsignal(signal.SIGINT) is self._again
            signal.signal(signal.SIGINT, self.previous)

