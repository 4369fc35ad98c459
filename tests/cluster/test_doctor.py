"""`vitp doctor` against real components: a two-node local Ray cluster with token auth, the moto S3
server, an MLflow server with basic auth. It passes on the healthy setup and names the fix for a
missing token, an unreachable address, an unwritable bucket and a wrong MLflow password."""
import re
import threading
import uuid

import pytest

from vitp.cluster.doctor import EXIT_FAILED, Check, _tracking_line, exit_code, timed
from vitp.cluster.doctor_storage import PROBE_DIR, probe_storage, probe_tracking, storage_fix
from vitp.net import free_ports
from vitp.tracking.server import AuthSettings, start_server

from .conftest import LocalCluster, PortForward, vitp

PASSWORD = f"doctor-{uuid.uuid4().hex}"  # the MLflow admin's; never printed


def lines_of(out) -> dict[str, str]:
    """{check name: its whole line} of a doctor run; every stdout line is one check."""
    found = {}
    for line in out.stdout.splitlines():
        assert line.startswith(("ok   ", "FAIL ")), f"not a check line: {line!r}\n{out.stdout}{out.stderr}"
        found[line[5:].split(":", 1)[0]] = line
    return found


# --------------------------------------------------------------------------- fast: formatting and exit code


def test_lines_and_exit_code():
    good, bad = Check("cluster", True, "2 node(s) alive"), Check("mlflow", False, "login rejected", "set X")
    assert good.line() == "ok   cluster: 2 node(s) alive"
    assert bad.line() == "FAIL mlflow: login rejected -> set X"
    assert exit_code([good, good]) == 0 and exit_code([good, bad]) == EXIT_FAILED == 3 and exit_code([]) == 3


def test_a_check_that_raises_or_hangs_is_a_fail_line_not_a_traceback():
    def boom():
        raise RuntimeError("first line\nsecond line")

    raised = timed("cluster", boom, 5, "the fix")
    assert raised.line() == "FAIL cluster: RuntimeError: first line -> the fix"
    never = threading.Event()
    hung = timed("mlflow", lambda: never.wait(), 0.2, "start the server")
    assert not hung.ok and "no answer within" in hung.detail and hung.fix == "start the server"
    never.set()


def test_probe_on_a_local_directory_leaves_nothing(tmp_path):
    shared = tmp_path / PROBE_DIR / "shared-x"
    shared.parent.mkdir()
    shared.write_text("abc")
    assert probe_storage(str(tmp_path), "here", str(shared), "abc") == {"where": "here", "ok": True}
    assert [p.name for p in (tmp_path / PROBE_DIR).iterdir()] == ["shared-x"]
    unshared = probe_storage(str(tmp_path), "node", str(tmp_path / "missing"), "abc")
    assert not unshared["ok"] and unshared["step"] == "read what this machine wrote"
    assert "not shared between the nodes" in storage_fix(str(tmp_path), unshared["error"], unshared["step"])


def test_the_jobs_mlflow_address_is_probed_by_its_health_endpoint():
    """probe_tracking: an answering /health is ok, an error status or a closed port is not (and says
    which address), a non-server URI (SQLite) has nothing to reach."""
    import http.server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        assert probe_tracking(uri) == {"ok": True, "detail": f"{uri} answers (HTTP 200)"}
        assert probe_tracking(uri + "/nothing-here")["ok"] is False
    finally:
        server.shutdown()
    (port,) = free_ports(1)
    closed = probe_tracking(f"http://127.0.0.1:{port}")
    assert not closed["ok"] and f"no MLflow server answers at http://127.0.0.1:{port} (" in closed["detail"]
    assert "urlopen" not in closed["detail"]  # the reason, not the exception's repr
    line = _tracking_line(f"http://127.0.0.1:{port}", closed).line()
    assert line.startswith("FAIL mlflow from cluster: the jobs' address: no MLflow")
    assert "-> pass --job-tracking-uri" in line
    assert probe_tracking("sqlite:///tmp/x.db")["ok"]
    assert probe_tracking("http://user:s3cret@127.0.0.1:1")["detail"].count("s3cret") == 0  # shown without it


@pytest.mark.parametrize("existing", [False, True], ids=["new-experiment", "existing-experiment"])
def test_the_mlflow_check_leaves_no_run_artifact_or_experiment(tmp_path, existing):
    """The MLflow check on a SQLite store: into the run's experiment when it exists, else a temporary
    one deleted afterwards; either way no active run or new experiment is left, and no artifact file."""
    from mlflow.entities import ViewType

    from vitp.cluster.doctor_mlflow import check_mlflow
    from vitp.recipes import resolve
    from vitp.tracking.store import get_client, get_or_create_experiment
    from vitp.config import Run

    cfg = resolve("debug", [f"work_dir={tmp_path}", "tracking.experiment=mine"])
    client = get_client(Run.of(cfg).tracking_uri)
    if existing:
        get_or_create_experiment(client, "mine")
    before = {e.name for e in client.search_experiments(view_type=ViewType.ALL)}
    check = check_mlflow(Run.of(cfg))
    assert check.ok and "artifact and run deleted" in check.detail, check.line()
    assert ("experiment 'mine'" if existing else "a temporary experiment ('mine' does not exist yet") in check.detail
    active = {e.name: e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    assert set(active) == before  # nothing new a user would see ('mine' only where it existed)
    deleted_runs = client.search_runs([e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)],
                                      run_view_type=ViewType.DELETED_ONLY)
    assert [r.info.run_name for r in deleted_runs] == ["vitp-doctor"]  # the probe ran, and is deleted
    assert not client.search_runs(list(active.values()))
    assert not list(tmp_path.rglob("vitp-doctor.txt"))  # its artifact removed, not only its run


# --------------------------------------------------------------------------- e2e: real cluster, S3, MLflow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head + one worker node with token authentication."""
    c = LocalCluster(tmp_path_factory.mktemp("doctor-cluster"), workers=1, num_cpus=1, auth=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def mlflow_server(s3, tmp_path_factory):
    """An MLflow server with basic auth (user admin) and its artifacts on S3."""
    tmp = tmp_path_factory.mktemp("doctor-mlflow")
    handle = start_server(f"sqlite:///{tmp}/m.db", f"{s3.bucket('mlflow')}/artifacts",
                          auth=AuthSettings(admin_password=PASSWORD), log_path=tmp / "server.log")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def setup(s3, cluster, mlflow_server):
    """The arguments and environment of a healthy doctor run."""
    work_dir = f"{s3.bucket('doctor')}/vit"
    env = {"RAY_AUTH_TOKEN_PATH": str(cluster.token_path), "MLFLOW_TRACKING_USERNAME": "admin",
           "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    args = ["doctor", "debug", "--address", cluster.address, "--set", f"work_dir={work_dir}",
            "--tracking-uri", mlflow_server.uri]
    return args, env, work_dir


def run(args, env, **changes):
    out = vitp(*args, env={**env, **changes}, timeout=400)
    print(f"$ vitp {' '.join(args)}  (exit {out.returncode})\n{out.stdout}")  # shown by pytest -rA
    return out


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
@pytest.mark.e2e
def test_doctor_passes_on_a_healthy_cluster(setup, s3, mlflow_server, cluster, monkeypatch):
    """... with this machine and the jobs reaching MLflow at different addresses, as through a
    `kubectl port-forward`: this machine's check goes through its own address, the jobs' address
    is asked from the cluster."""
    args, env, work_dir = setup
    forward = PortForward(mlflow_server.port)
    try:
        out = run([forward.uri if a == mlflow_server.uri else a for a in args]
                  + ["--job-tracking-uri", mlflow_server.uri, "--allreduce"], env)
    finally:
        forward.close()
    assert out.returncode == 0, out.stdout + out.stderr
    found = lines_of(out)
    assert set(found) == {"cluster", "storage here", "storage on cluster", "all-reduce", "mlflow",
                          "mlflow from cluster", "data"}
    # the recipe's gang (2 workers, 1 CPU each) on the two 1-CPU nodes: gloo across them, a bandwidth measured
    bandwidth = re.search(r"2 workers on 2 node\(s\) \(gloo\): 16 MiB in [\d.]+ ms, bus bandwidth ([\d.]+) GB/s",
                          found["all-reduce"])
    assert bandwidth and float(bandwidth.group(1)) > 0, found["all-reduce"]
    assert forward.connections > 0
    assert f"the jobs' address: {mlflow_server.uri} answers (HTTP 200)" in found["mlflow from cluster"]
    assert all(line.startswith("ok   ") for line in found.values()), out.stdout
    assert "token accepted" in found["cluster"] and "2 node(s) alive" in found["cluster"]
    # The job's driver and a task on the other node both wrote, listed, read and deleted.
    assert "job driver" in found["storage on cluster"] and "node " in found["storage on cluster"]
    assert work_dir in found["storage on cluster"]
    assert "accepted a run as 'admin'" in found["mlflow"]
    # Nothing left behind: no probe object in the bucket, the doctor's run deleted.
    bucket = work_dir.split("/")[2]
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [k for k in keys if "probe-" in k or "shared-" in k or "allreduce-" in k], keys
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    client = MlflowClient(mlflow_server.uri)
    # the recipe's experiment did not exist: a temporary one took the probe run and was deleted
    assert "a temporary experiment ('vit-pipeline-debug' does not exist yet" in found["mlflow"]
    assert client.get_experiment_by_name("vit-pipeline-debug") is None
    assert [e.name for e in client.search_experiments()] == ["Default"]
    every = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    assert [r.info.run_name for r in client.search_runs(every, run_view_type=ViewType.DELETED_ONLY)] == ["vitp-doctor"]
    assert "artifact and run deleted" in found["mlflow"]
    secret = cluster.token_path.read_text().strip()
    assert secret not in out.stdout + out.stderr and PASSWORD not in out.stdout + out.stderr


@pytest.mark.e2e
def test_no_token_and_a_wrong_token_name_the_token_variables(setup, cluster, tmp_path):
    args, env, _ = setup
    env = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN_PATH"}
    out = run(args, env)
    assert out.returncode == EXIT_FAILED, out.stdout + out.stderr
    found = lines_of(out)
    assert found["cluster"].startswith("FAIL cluster:") and "requires a token" in found["cluster"]
    assert "-> export RAY_AUTH_TOKEN_PATH=" in found["cluster"]
    assert found["storage on cluster"].startswith("FAIL")  # not checked without a cluster
    wrong = lines_of(run(args, env, RAY_AUTH_TOKEN="not-the-token"))
    assert "rejected the token" in wrong["cluster"] and "RAY_AUTH_TOKEN_PATH" in wrong["cluster"]
    # a command that joins the cluster as a driver says the same in one line (exit 3), not a traceback
    joined = vitp("pretrain", "debug", "--address", f"127.0.0.1:{cluster.port}", "--set", f"work_dir={tmp_path}",
                  env=env)
    assert joined.returncode == 3, joined.stdout + joined.stderr
    last = joined.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vitp pretrain: cannot join the Ray cluster at 127.0.0.1:{cluster.port}") and \
        "RAY_AUTH_TOKEN_PATH" in last and "Traceback" not in joined.stderr, joined.stderr[-2000:]


@pytest.mark.e2e
def test_unwritable_bucket_names_the_bucket_fix(setup, s3):
    args, env, _ = setup
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/vit"
    out = run([a.replace(setup[2], missing) for a in args], env)
    assert out.returncode == EXIT_FAILED, out.stdout + out.stderr
    found = lines_of(out)
    assert found["cluster"].startswith("ok")
    for name in ("storage here", "storage on cluster"):  # from this machine and from the nodes
        assert found[name].startswith(f"FAIL {name}:"), out.stdout
        assert f"aws s3 mb {missing.rsplit('/', 1)[0]}" in found[name] and "AWS_ENDPOINT_URL" in found[name]


@pytest.mark.e2e
def test_wrong_mlflow_password_names_the_password_variable(setup):
    args, env, _ = setup
    # ... and, in the same run, a jobs' MLflow address nothing answers at (VITP_JOB_TRACKING_URI)
    (port,) = free_ports(1)
    out = run(args, env, MLFLOW_TRACKING_PASSWORD="not-the-password", VITP_JOB_TRACKING_URI=f"http://127.0.0.1:{port}")
    assert out.returncode == EXIT_FAILED, out.stdout + out.stderr
    found = lines_of(out)
    assert found["mlflow"].startswith("FAIL mlflow:") and "rejected the login of user 'admin'" in found["mlflow"]
    assert "-> export MLFLOW_TRACKING_PASSWORD=" in found["mlflow"]
    assert found["mlflow from cluster"].startswith(f"FAIL mlflow from cluster: the jobs' address: no MLflow "
                                                   f"server answers at http://127.0.0.1:{port}")
    assert "-> pass --job-tracking-uri" in found["mlflow from cluster"]
    assert all(found[n].startswith("ok") for n in ("cluster", "storage here", "storage on cluster"))


@pytest.mark.e2e
def test_unreachable_address_fails_fast_with_the_fix(tmp_path):
    (port,) = free_ports(1)
    out = vitp("doctor", "debug", "--address", f"http://127.0.0.1:{port}", "--set", f"work_dir={tmp_path}",
               timeout=120)
    assert out.returncode == EXIT_FAILED, out.stdout + out.stderr
    found = lines_of(out)
    assert found["cluster"].startswith(f"FAIL cluster: no Ray dashboard answers at http://127.0.0.1:{port}")
    assert "start the cluster" in found["cluster"] and "--address" in found["cluster"]
    assert found["storage here"].startswith("ok") and found["mlflow"].startswith("ok")
    # A GCS address that nothing listens on fails the same way, before Ray's own retries.
    gcs = lines_of(vitp("doctor", "debug", "--address", f"127.0.0.1:{port}", "--set", f"work_dir={tmp_path}",
                        timeout=120))
    assert gcs["cluster"].startswith(f"FAIL cluster: nothing answers at 127.0.0.1:{port}")


def test_an_allreduce_below_the_asked_bandwidth_is_a_fail_line_with_the_fix():
    from vitp.cluster.allreduce import bus_bandwidth, line

    algbw, busbw = bus_bandwidth(256 * 2**20, 0.004, 16)
    assert busbw == pytest.approx(algbw * 2 * 15 / 16)  # what each ring link carries
    result = {"workers": 16, "nodes": 2, "backend": "nccl", "mib": 256, "seconds": 0.004,
              "algbw_gbps": algbw, "busbw_gbps": busbw}
    assert line(result).ok and line(result, min_busbw=busbw * 0.9).ok
    bad = line(result, min_busbw=busbw * 1.1)
    assert not bad.ok and "EFA" in bad.fix and "TCPX" in bad.fix, bad.line()
