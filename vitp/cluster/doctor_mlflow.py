"""`vitp doctor`'s MLflow check: log to the tracking server as a run would, then remove what it logged.

Owns the probe run and its clean-up; must leave no run, artifact or experiment a user would see.
"""
from __future__ import annotations

import contextlib
import os
import uuid

from vitp.cluster.checks import Check, first_line
from vitp.config import Run
from vitp.errors import ConfigError


def _mlflow_failure(shown: str, user: str, step: str, experiment: str, e) -> Check:
    text, code = first_line(e.message), getattr(e, "error_code", "")
    if "401" in text or "unauthorized" in text.lower() or code == "UNAUTHENTICATED":
        what, fix = (f"{shown} rejected the login of user {user!r} (wrong password?)", f"export "
                     f"MLFLOW_TRACKING_PASSWORD=<{user}'s password> (or the right MLFLOW_TRACKING_USERNAME)") if user \
            else (f"{shown} requires a login and none was given",
                  "export MLFLOW_TRACKING_USERNAME=<user> MLFLOW_TRACKING_PASSWORD=<password>")
    elif "403" in text or "permission" in text.lower() or code == "PERMISSION_DENIED":
        what, fix = (f"{shown}: user {user or '(none)'} may not {step} in {experiment!r}",
                     f"grant the user EDIT on experiment {experiment!r} or choose --set tracking.experiment=<yours>")
    elif step == "log an artifact":
        what, fix = (f"{shown} could not store an artifact ({text})", "check the server's --artifacts-destination "
                     "and its storage credentials (MLFLOW_S3_ENDPOINT_URL, AWS_* where the server runs)")
    elif "connect" in text.lower() or "max retries" in text.lower():
        what, fix = f"no MLflow server answers at {shown} ({text})", "start it (vitp mlflow-server) or fix the URI"
    else:
        what, fix = f"{shown}: {step} failed ({text})", "check the server's log and --tracking-uri"
    return Check("mlflow", False, what, fix)


def _delete_artifacts(artifact_uri: str, tracking_uri: str) -> bool:
    """Remove a run's artifacts from its store (S3, the server's proxy, local files); False where
    that store cannot delete (they stay until `mlflow gc`)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository  # lazy: mlflow
    try:
        # (the tracking URI resolves a server's proxied mlflow-artifacts:/ URIs)
        get_artifact_repository(artifact_uri, tracking_uri=tracking_uri).delete_artifacts()
        return True
    except Exception:  # noqa: BLE001 - NotImplementedError, or a server without artifact deletes
        return False


def check_mlflow(run: Run) -> Check:
    """Log a run as training would (a param, a metric, an artifact), then delete its artifact and the
    run. In the run's experiment when it exists; else in a temporary experiment deleted afterwards, so
    the doctor creates nothing a user sees (deleted runs and experiments go with `mlflow gc`)."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow

    from vitp.tracking.redact import redact_text
    from vitp.tracking.store import get_client, get_or_create_experiment
    cfg = run.cfg
    try:
        uri = run.tracking_uri
    except ConfigError:
        return Check("mlflow", False, f"work_dir={cfg.work_dir} is object storage and no tracking URI is set",
                     "pass --tracking-uri http://<mlflow-server>:5000 (or --set tracking.uri=...; "
                     "`vitp mlflow-server` runs one)")
    shown, name, user = redact_text(uri), cfg.tracking.experiment, os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    client, run_id, temporary, step = get_client(uri), None, None, "find the experiment"
    try:
        exp = client.get_experiment_by_name(name)
        if exp is not None and exp.lifecycle_stage == "deleted":
            return Check("mlflow", False, f"experiment {name!r} at {shown} is deleted",
                         f"restore it (`mlflow experiments restore --experiment-id {exp.experiment_id}`) "
                         "or choose --set tracking.experiment=<another name>")
        if exp is None:
            step = "create an experiment"
            exp_id = temporary = get_or_create_experiment(client, f"vitp-doctor-{uuid.uuid4().hex[:8]}")
        else:
            exp_id = exp.experiment_id
        step = "start a run"
        run = client.create_run(exp_id, run_name="vitp-doctor", tags={"vitp.doctor": "preflight"})
        run_id = run.info.run_id
        step = "log a param and a metric"
        client.log_param(run_id, "doctor", "1")
        client.log_metric(run_id, "doctor/ok", 1.0)
        step = "log an artifact"
        client.log_text(run_id, "ok\n", "vitp-doctor.txt")
        step = "end and delete the run"
        artifact_deleted = _delete_artifacts(run.info.artifact_uri, uri)
        client.set_terminated(run_id)
        client.delete_run(run_id)
        run_id = None
        if temporary:
            step = "delete the temporary experiment"
            client.delete_experiment(temporary)
            temporary = None
    except MlflowException as e:
        return _mlflow_failure(shown, user, step, name, e)
    finally:
        with contextlib.suppress(Exception):  # cleanup after a failure already reported
            run_id and client.delete_run(run_id)
        with contextlib.suppress(Exception):
            temporary and client.delete_experiment(temporary)
    where = (f"experiment {name!r}" if exp is not None else
             f"a temporary experiment ({name!r} does not exist yet: the first run creates it)")
    removed = "artifact and run deleted" if artifact_deleted else "run deleted; its artifact stays until `mlflow gc`"
    return Check("mlflow", True, f"{shown} accepted a run{f' as {user!r}' if user else ''} in {where} "
                 f"(param, metric, artifact logged; {removed})")
