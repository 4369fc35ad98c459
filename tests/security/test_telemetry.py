"""Nothing leaves the machine unasked: MLflow 3's client telemetry (on by default in every process
that imports MLflow) and Ray's usage stats are off in the `vitp` process before MLflow loads, so in
everything it starts, and in the `mlflow server` vitp starts; a value the user set (an opt-in) is
kept. The job specs, manifests and launchers: tests/cluster/test_configs.py
(test_nothing_leaves_the_cluster_unasked)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitp.net import TELEMETRY_OFF

ROOT = Path(__file__).resolve().parents[2]

# What `vitp CMD` runs (the console script is vitp.cli:main), then what MLflow decides once it is
# imported after it: its own telemetry check, and whether it started a telemetry client.
CLI = """
import json, os, sys
from vitp.cli import main
rc = main(["config", "debug"])
got = {"rc": rc, "env": {k: os.environ.get(k) for k in %r}}
if sys.argv[1] == "import":
    import mlflow
    from mlflow.telemetry import get_telemetry_client
    from mlflow.telemetry import utils
    got.update(vacuous=utils._IS_IN_CI_ENV_OR_TESTING or utils._IS_MLFLOW_DEV_VERSION,
               disabled=utils.is_telemetry_disabled(), client=get_telemetry_client() is not None)
print(json.dumps(got))
""" % (tuple(TELEMETRY_OFF),)
# Where MLflow's telemetry is off whatever the switch says (mlflow/telemetry/utils.py
# _is_ci_env_or_testing): taken out of the probe's environment, so only the switch decides.
CI_VARS = ("PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS",
           "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE", "TEAMCITY_VERSION",
           "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME", "RUNBOT_WORKER_ID", "DO_NOT_TRACK")


def _vitp(tmp_path: Path, mode: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in CI_VARS and k not in TELEMETRY_OFF}
    p = subprocess.run([sys.executable, "-c", CLI, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**base, "HOME": str(tmp_path), **env})  # MLflow keeps an installation id in HOME
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_vitp_command_turns_telemetry_off_before_mlflow_loads_unless_opted_in(tmp_path):
    got = _vitp(tmp_path, "import")
    assert got["rc"] == 0 and not got["vacuous"]
    assert got["env"] == TELEMETRY_OFF  # inherited by every process it starts
    assert got["disabled"] and not got["client"]  # MLflow's own decision: no telemetry client, no thread
    opted = {"MLFLOW_DISABLE_TELEMETRY": "false", "RAY_USAGE_STATS_ENABLED": "1"}
    assert _vitp(tmp_path, "env-only", **opted)["env"] == opted  # the user's, kept


def _group_environs(pgid: int) -> list[dict[str, str]]:
    """The environment of every process in process group `pgid` (the server and its workers)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
                out.append(dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


@pytest.mark.slow
def test_the_mlflow_server_vitp_starts_has_telemetry_off(tmp_path, monkeypatch):
    """start_server (`vitp mlflow-server`, the tests' servers) from a process that never set the switches."""
    from vitp.tracking.server import start_server

    for name in TELEMETRY_OFF:
        monkeypatch.delenv(name, raising=False)
    with start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "artifacts")) as server:
        environs = _group_environs(server.process.pid)  # the server leads its own process group
    assert environs
    for env in environs:
        assert {k: env.get(k) for k in TELEMETRY_OFF} == TELEMETRY_OFF
