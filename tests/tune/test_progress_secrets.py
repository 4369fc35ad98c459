"""A sweep trial's error reaches its MLflow run as the `vitp.error` tag, set by the sweep's Tune
callback (SweepProgress), not by the trial's RunLogger: it is redacted on that path too, as are the
lines the callback prints and the failures the sweep summarises (trial_error)."""
import base64
import secrets
from types import SimpleNamespace

from mlflow.tracking import MlflowClient

from vitp.tracking.redact import REDACTED


def test_a_failed_trials_error_tag_and_lines_are_redacted(tmp_path, monkeypatch):
    from vitp.tune.progress import USER_ERROR, SweepProgress, trial_error

    db_password = f"{secrets.token_hex(5)}/pg+pw"  # only known as PGPASSWORD's value
    monkeypatch.setenv("PGPASSWORD", db_password)
    uri_password, token = f"u@{secrets.token_hex(4)}", f"tk{secrets.token_hex(6)}"
    error = (f"Traceback (most recent call last):\n  ...\nOperationalError: connection to "
             f"postgresql://mlflow:{uri_password}@db:5432/mlflow failed for {db_password} "
             f"(token={token}; b64 {base64.b64encode(db_password.encode()).decode()})")

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    died, orphan = (client.create_run(exp, tags={"sweep": "s", "trial_id": t}).info.run_id for t in ("t1", "t2"))
    lines = []
    progress = SweepProgress("s", 2, 1, "val/top1", uri, "e", run_name=lambda config, trial_id="": trial_id,
                             log=lines.append)
    progress.on_trial_error(0, [], SimpleNamespace(trial_id="t1", config={}, error_msg=error))
    # a trial whose driver died before on_trial_error: settle() ends its run with the error it kept
    progress.failed["t2"] = trial_error(error, None)
    progress.settle()

    for run_id in (died, orphan):
        run = client.get_run(run_id)
        tag = run.data.tags["vitp.error"]
        assert run.info.status == "FAILED"
        assert tag.startswith("OperationalError: connection to postgresql://mlflow:***@db:5432/mlflow failed for ***"), tag
        for leaked in (uri_password, db_password, token, base64.b64encode(db_password.encode()).decode()):
            assert leaked not in tag, (leaked, tag)
    printed = "\n".join(lines)
    assert "FAILED" in printed and REDACTED in printed
    assert not any(s in printed for s in (uri_password, db_password)), printed
    # a trial that returned with the user's mistake (USER_ERROR): the summary's line is redacted too
    line = trial_error(None, {USER_ERROR: f"ConfigError: --set tracking.uri=http://a:{uri_password}@h: {db_password}"})
    assert uri_password not in line and db_password not in line and line.startswith("ConfigError: --set")
