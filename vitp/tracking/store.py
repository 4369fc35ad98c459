"""The MLflow store: its URI, a race-safe client, experiments, and quoting values into search filters.

Owns the rules every tracking module shares (TrackingError, normalise_uri, get_client, quote,
tag_filters). A sink: imports mlflow, vitp.errors, vitp.paths and the redaction only; never torch or ray.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from vitp.errors import UserError
from vitp.paths import store_uri
from vitp.tracking.redact import redact_message
from vitp.tracking.secret_values import add_uri_passwords

try:
    import fcntl
except ImportError:  # Windows: no flock; get_client's retries absorb most races
    fcntl = None

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: what the UI nests child runs under
ERROR_TAG = "vitp.error"  # a FAILED run's error: its type and last line, as the UI shows tags


class TrackingError(UserError, RuntimeError):
    """An MLflow operation cannot go ahead; the message names the input and the fix (`vitp` exit 2)."""


# --------------------------------------------------------------------------------------
# Store URI and client
# --------------------------------------------------------------------------------------


def normalise_uri(uri: str) -> str:
    """A store URI as MLflow wants it (paths.store_uri), with the folder a local store lives in made."""
    out = store_uri(uri)
    if out.startswith("sqlite:///"):
        Path(out[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    elif out.startswith("file://") and not uri.startswith("file:"):  # a plain directory path
        Path(uri).expanduser().resolve().mkdir(parents=True, exist_ok=True)
    return out


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:/// store URI; None for any other store."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):])
    return None


_ready: set[str] = set()
_ready_lock = threading.Lock()


def get_client(tracking_uri: str) -> MlflowClient:
    """An MlflowClient for `tracking_uri`, with a fresh SQLite store initialised by one process at a time.

    MLflow creates/migrates the SQLite schema when the client is constructed; two processes doing
    that at once fail with "table already exists" / "duplicate column". An exclusive file lock beside
    the DB serialises the first open; later opens in this process skip the lock.
    """
    add_uri_passwords(tracking_uri)  # a password in the store's URI is masked wherever it shows up
    uri = normalise_uri(tracking_uri)
    db = _sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    with _ready_lock:
        if uri in _ready:
            return MlflowClient(tracking_uri=uri)
        db.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{db}.lock", "a+") as lock_file:
            if fcntl is not None:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                for attempt in range(5):
                    try:
                        client = MlflowClient(tracking_uri=uri)  # opens and migrates the store
                        client.search_experiments(max_results=1)
                        break
                    except Exception:  # noqa: BLE001 - e.g. a migration by an opener without our lock
                        if attempt == 4:
                            raise
                        time.sleep(0.5 * (attempt + 1))
            finally:
                if fcntl is not None:
                    fcntl.flock(lock_file, fcntl.LOCK_UN)
        _ready.add(uri)
    return client


_NO_ANSWER = re.compile(r"^API request to \S+ failed with (timeout )?exception")


def unreachable(e: BaseException) -> bool:
    """MLflow's client gave up on a request that got no answer (refused, reset, timed out, 5xx
    past its retries): the server is down or unreachable, not refusing the request itself."""
    return isinstance(e, MlflowException) and bool(_NO_ANSWER.match(str(e.message)))


MLFLOW_OUTAGE_S = 300.0  # how long `through_mlflow_outages` keeps trying a tracking server that does not answer


def through_mlflow_outages(fn, what: str, warn, limit_s: float = MLFLOW_OUTAGE_S, first_pause_s: float = 5.0):
    """fn() again while the tracking server does not answer (`unreachable`; each try includes
    MLflow's own retries), up to `limit_s` with doubling pauses; `warn(line)` says so each time.
    fn must be safe to repeat. The last error is raised once the time is up."""
    deadline, pause = time.monotonic() + limit_s, first_pause_s
    while True:
        try:
            return fn()
        except MlflowException as e:
            if not unreachable(e) or time.monotonic() + pause > deadline:
                raise
            warn(f"{what}: MLflow does not answer ({redact_message(str(e.message).splitlines()[0])[:160]}); "
                 f"trying again in {pause:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 60.0)


# --------------------------------------------------------------------------------------
# Experiments
# --------------------------------------------------------------------------------------


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "experiment"


# The MLflow UI (>= 3.4) opens an experiment by its kind: a model-training one on its runs, not
# on the empty GenAI overview of traces. Ours are all model training.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def ui_url(base: str, experiment_id: str) -> str:
    """The MLflow UI page of an experiment's training runs. The UI opens in its GenAI mode (an empty
    traces overview) unless told otherwise: `workflowType=machine_learning` is its switch."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def get_or_create_experiment(client: MlflowClient, name: str) -> str:
    """Experiment id for `name`, creating it if needed; tagged a model-training experiment unless
    it has a kind already. Safe when several processes race to create it."""
    if not name:
        raise TrackingError("experiment name is empty: set --set tracking.experiment=<name>")
    exp = client.get_experiment_by_name(name)
    if exp is None:
        artifact_location = None
        db = _sqlite_path(client.tracking_uri)
        if db is not None:
            # MLflow's SQLite default puts artifacts in ./mlruns of whatever the cwd is; keep them
            # beside the DB so a work dir is self-contained.
            artifact_location = (db.parent / "mlartifacts" / _safe_name(name)).as_uri()
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as e:
            # Lost the race to another process: the experiment exists now.
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise TrackingError(
                    f"cannot create MLflow experiment {name!r} in {client.tracking_uri}: {e.message}"
                ) from e
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} (id {exp.experiment_id}) in {client.tracking_uri} is "
            f"deleted: restore it (`mlflow experiments restore --experiment-id {exp.experiment_id}`) "
            "or choose another --set tracking.experiment=<name>"
        )
    if EXPERIMENT_KIND_TAG not in exp.tags:  # made by an older version or by hand: mark it (a kind set is kept)
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


# --------------------------------------------------------------------------------------
# Search filters
# --------------------------------------------------------------------------------------


def quote(value: str) -> str:
    """A string literal for an MLflow search filter."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise TrackingError(f"run name {value!r} contains both ' and \": use a name without quotes")


def tag_filters(sweep: str | None, tags: dict[str, Any] | None) -> list[str]:
    """Filter clauses matching every tag in `tags`, plus the `sweep` tag when given."""
    wanted = dict(tags or {})
    if sweep:
        wanted["sweep"] = sweep
    return [f"tags.`{k}` = {quote(str(v))}" for k, v in wanted.items()]
