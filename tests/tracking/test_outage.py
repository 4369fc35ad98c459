"""Training-side logging through MLflow outages, against real `mlflow server` processes: a server
stopped and restarted on the same store and port, responses lost after the server committed
(a TCP proxy), end() while down, a SIGKILLed owner marked KILLED by its stale heartbeat.
"""
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from vitp.net import free_port
from vitp.tracking import RunLogger, TrackingError, start_server
from vitp.tracking.spool import HEARTBEAT_TAG, SEND_INTERVAL_S
from vitp.tracking.spoolfile import MetricSpool, spool_dir_for
from vitp.tracking.stale import STALE_TAG, mark_stale_runs
from vitp.tracking.store import through_mlflow_outages, unreachable

REPO = Path(__file__).resolve().parents[2]
KEYS = ("train/loss", "train/lr", "perf/images_per_sec")


def metrics(step, offset=0.0):
    return {"train/loss": 10.0 - step / 10 + offset, "train/lr": 0.001 * step, "perf/images_per_sec": 100.0 + step}


def assert_each_step_once(client, run_id, steps, offset=0.0):
    for key in KEYS:
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(steps), key
        assert {m.step: m.value for m in history} == {s: metrics(s, offset)[key] for s in steps}, key


def spooled_bytes(spool_dir, run_id):
    return sum(p.stat().st_size for p in spool_dir_for(run_id, spool_dir).glob("*.jsonl"))


class OwnServer:
    """A server on its own SQLite store; restart() starts it again on the same store and port."""

    def __init__(self, root):
        self.store, self.artifacts = f"sqlite:///{root}/server.db", str(root / "artifacts")
        self.handle = start_server(self.store, self.artifacts)

    def restart(self):
        self.handle = start_server(self.store, self.artifacts, port=self.handle.port)


@pytest.fixture(scope="module")
def _own_server(tmp_path_factory):
    own = OwnServer(tmp_path_factory.mktemp("own-server"))
    yield own
    own.handle.stop()


@pytest.fixture
def own_server(_own_server):
    """The module's own server, up: a test stops it and starts it again (each test has its own
    experiment in the store), one that failed half-way may have left it down."""
    if not _own_server.handle.alive():
        _own_server.restart()
    return _own_server


@pytest.mark.slow  # the server stopped and started again
def test_outage_spools_and_backfills_every_step_exactly_once(own_server, experiment, tmp_path):
    spool, uri = tmp_path / "spool", own_server.handle.uri
    run = RunLogger.start(uri, experiment, "outage", background=True, timeout_s=2.0, spool_dir=spool,
                          heartbeat_s=1.0)
    for step in range(1, 11):
        run.log_metrics(metrics(step), step=step)
    assert run.flush(30) and spooled_bytes(spool, run.run_id) == 0

    own_server.handle.stop()  # the tracking server goes away mid-run
    for step in range(11, 21):
        t0 = time.monotonic()
        assert run.log_metrics(metrics(step), step=step) == len(KEYS)
        assert time.monotonic() - t0 < 2.0  # generous: it only appends to a local file
    assert not run.flush(1.0)  # nothing can be sent: all of it waits on disk
    assert spooled_bytes(spool, run.run_id) > 0

    own_server.restart()  # same store, same port: the logger's URI is valid again
    assert own_server.handle.uri == uri
    for step in range(21, 31):
        run.log_metrics(metrics(step), step=step)
    assert run.flush(60)
    run.end("FINISHED")

    client = MlflowClient(uri)
    assert_each_step_once(client, run.run_id, range(1, 31))
    assert spooled_bytes(spool, run.run_id) == 0 and not list(spool_dir_for(run.run_id, spool).glob("*"))
    finished = client.get_run(run.run_id)
    assert finished.info.status == "FINISHED" and float(finished.data.tags[HEARTBEAT_TAG]) > 0


class LosingProxy:
    """TCP proxy to a real server that, while `lose` is set, forwards log-batch requests but throws
    the server's answer away and hangs up: the values are stored, the client sees a failure.
    `posts` counts the log-batch requests it forwarded."""

    def __init__(self, upstream_port):
        self.lose = threading.Event()
        self.lost = 0
        self.posts = 0
        self._up = upstream_port
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._up))
            state = {"lose": False}
            threading.Thread(target=self._requests, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client, state), daemon=True).start()

    def _requests(self, client, upstream, state):
        while data := _recv(client):
            if b"log-batch" in data:
                state["lose"] = self.lose.is_set()
                self.posts += 1
            upstream.sendall(data)
        upstream.close()

    def _responses(self, upstream, client, state):
        while data := _recv(upstream):
            if state["lose"]:
                self.lost += 1
                break
            client.sendall(data)
        client.close()
        upstream.close()

    def close(self):
        self._sock.close()


def _recv(sock):
    try:
        return sock.recv(65536)
    except OSError:
        return b""


@pytest.mark.slow  # a server behind a proxy, answers dropped
def test_lost_answers_are_not_sent_twice(experiment, tmp_path):
    # A file store keeps every value it is sent (the SQL stores drop exact repeats themselves).
    server = start_server(str(tmp_path / "mlruns"), str(tmp_path / "artifacts"),
                          env={"MLFLOW_ALLOW_FILE_STORE": "true"})
    proxy = LosingProxy(server.port)
    spool = tmp_path / "spool"
    try:
        run = RunLogger.start(proxy.uri, experiment, "lossy", background=True, timeout_s=2.0,
                              spool_dir=spool, heartbeat_s=60.0)
        proxy.lose.set()
        for step in range(1, 11):
            run.log_metrics(metrics(step), step=step)
        direct = MlflowClient(server.uri)
        deadline = time.monotonic() + 30
        while len(direct.get_metric_history(run.run_id, KEYS[0])) < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        # Stored server-side, yet still spooled as unsent: a blind resend would duplicate them.
        assert len(direct.get_metric_history(run.run_id, KEYS[0])) == 10
        assert proxy.lost >= 1 and spooled_bytes(spool, run.run_id) > 0
        proxy.lose.clear()
        for step in range(11, 16):
            run.log_metrics(metrics(step), step=step)
        assert run.flush(30)
        run.end("FINISHED")
        assert_each_step_once(direct, run.run_id, range(1, 16))
    finally:
        proxy.close()
        server.stop()


def test_a_run_logging_every_step_posts_once_per_interval(mlflow_server, experiment, tmp_path):
    """60 steps logged 50 ms apart reach the server in about one request per SEND_INTERVAL_S,
    not one per step, and each step lands once."""
    proxy = LosingProxy(mlflow_server.port)
    try:
        run = RunLogger.start(proxy.uri, experiment, "every-step", background=True,
                              spool_dir=tmp_path / "spool", heartbeat_s=60.0)
        t0 = time.monotonic()
        for step in range(1, 61):
            run.log_metrics(metrics(step), step=step)
            time.sleep(0.05)
        assert run.flush(30)
        posts, elapsed = proxy.posts, time.monotonic() - t0
        run.end("FINISHED")
        assert_each_step_once(MlflowClient(mlflow_server.uri), run.run_id, range(1, 61))
        # one post per interval over the time it took (on any machine), plus the heartbeat's, the
        # first one (before the first interval) and the flush's
        assert posts <= elapsed / SEND_INTERVAL_S + 3, (posts, elapsed)
    finally:
        proxy.close()


def test_leftover_spool_of_a_dead_process_is_sent_once_by_the_next_start(mlflow_server, experiment, tmp_path):
    spool = tmp_path / "spool"
    first = RunLogger.start(mlflow_server.uri, experiment, "crashed", spool_dir=spool)
    for step in range(1, 4):
        first.log_metrics(metrics(step), step=step)
    # A process that spooled steps 1..6, sent 1..3 and died before emptying its spool.
    dead = MetricSpool(spool_dir_for(first.run_id, spool))
    for step in range(1, 7):
        dead.append(step, int(time.time() * 1000), metrics(step, offset=0.5 if step <= 3 else 0.0))
    os.close(dead._fd)  # what a SIGKILL leaves: the file, unlocked

    again = RunLogger.start(mlflow_server.uri, experiment, "crashed", spool_dir=spool)  # synchronous
    assert again.run_id == first.run_id and again.last_step == 6
    assert again.log_metrics(metrics(6, offset=9.0), step=6) == 0  # spooled steps count as logged
    again.end("FINISHED")
    assert_each_step_once(MlflowClient(mlflow_server.uri), first.run_id, range(1, 7))
    assert spooled_bytes(spool, first.run_id) == 0


def test_attached_worker_logger_needs_no_server_and_drops_replayed_steps(mlflow_server, experiment, tmp_path):
    spool, uri = tmp_path / "spool", mlflow_server.uri
    driver = RunLogger.start(uri, experiment, "attached", background=True, spool_dir=spool)
    for step in range(1, 6):
        driver.log_metrics(metrics(step), step=step)
    assert driver.flush(30)
    worker = RunLogger.attach(uri, driver.run_id, spool_dir=spool)
    for step in range(3, 9):  # a restarted worker replays from its checkpoint at step 2
        worker.log_metrics({**metrics(step, offset=0.0 if step > 5 else 7.0), "val/top1": 0.5}, step=step)
    assert worker.close(30)
    # Attaching makes no MLflow call: a worker (re)started while MLflow is unreachable trains on.
    cut_off = RunLogger.attach(f"http://127.0.0.1:{free_port()}", driver.run_id, spool_dir=spool, timeout_s=0.5)
    for step in (9, 10):
        assert cut_off.log_metrics(metrics(step), step=step) == len(KEYS)
    assert not cut_off.close(0.5) and spooled_bytes(spool, driver.run_id) > 0
    driver.end("FINISHED")  # takes over the ended worker's spool on this node and sends it

    client = MlflowClient(uri)
    assert_each_step_once(client, driver.run_id, range(1, 11))  # the first values of steps 3..5 kept
    assert sorted(m.step for m in client.get_metric_history(driver.run_id, "val/top1")) == list(range(3, 9))
    assert client.get_run(driver.run_id).info.status == "FINISHED"
    assert spooled_bytes(spool, driver.run_id) == 0


def test_a_checkpoints_backlog_arriving_after_later_steps_fills_the_gap_once(mlflow_server, experiment, tmp_path):
    """A rank 0 cut off from MLflow spools steps 1..8 and its node is lost with the spool; only the
    checkpoint's copy of its backlog survives. Its successor has sent steps 9..12 by the time the
    backlog comes in: the sender asks the server which steps it holds, not only its top one."""
    uri = mlflow_server.uri
    driver = RunLogger.start(uri, experiment, "late-backlog", background=True, spool_dir=tmp_path / "driver")
    for step in range(1, 4):
        driver.log_metrics(metrics(step), step=step)
    assert driver.flush(30)
    lost = tmp_path / "lost-node"
    cut_off = RunLogger.attach(f"http://127.0.0.1:{free_port()}", driver.run_id, spool_dir=lost, timeout_s=0.5)
    for step in range(1, 9):  # 1..3 again, other values: the server's stay
        cut_off.log_metrics(metrics(step, offset=5.0 if step <= 3 else 0.0), step=step)
    backlog = cut_off.backlog()
    assert [json.loads(line)["step"] for line in backlog.splitlines()] == list(range(1, 9))
    assert not cut_off.close(0.5)
    shutil.rmtree(lost)  # the node and its spool are gone

    successor = RunLogger.attach(uri, driver.run_id, spool_dir=tmp_path / "successor")
    for step in range(9, 13):
        successor.log_metrics(metrics(step), step=step)
    assert successor.flush(30)
    successor.take_backlog(backlog)
    assert successor.log_metrics(metrics(8, offset=9.0), step=8) == 0  # the backlog's steps count as logged
    successor.take_backlog(backlog)  # a second copy (a checkpoint resumed from twice) adds nothing
    assert successor.close(30)
    driver.end("FINISHED")
    assert_each_step_once(MlflowClient(uri), driver.run_id, range(1, 13))
    assert successor.backlog() == b""


@pytest.mark.slow  # the server stopped and started again
def test_end_while_down_keeps_the_spool_for_the_next_start(own_server, experiment, tmp_path, caplog):
    spool, uri = tmp_path / "spool", own_server.handle.uri
    run = RunLogger.start(uri, experiment, "ended-in-outage", background=True, timeout_s=2.0, spool_dir=spool)
    for step in range(1, 6):
        run.log_metrics(metrics(step), step=step)
    assert run.flush(30)
    own_server.handle.stop()
    for step in range(6, 11):
        run.log_metrics(metrics(step), step=step)
    with caplog.at_level(logging.WARNING, logger="vitp.tracking.runs"):
        run.end("FINISHED", timeout_s=1.0)  # must not raise
    assert "left RUNNING" in caplog.text and str(spool) in caplog.text
    assert spooled_bytes(spool, run.run_id) > 0

    own_server.restart()
    client = MlflowClient(uri)
    assert client.get_run(run.run_id).info.status == "RUNNING"
    again = RunLogger.start(uri, experiment, "ended-in-outage", run_id=run.run_id, background=True,
                            spool_dir=spool)
    assert again.last_step == 10
    again.log_metrics(metrics(11), step=11)
    assert again.flush(60)
    again.end("FINISHED")
    assert_each_step_once(client, run.run_id, range(1, 12))
    assert client.get_run(run.run_id).info.status == "FINISHED"
    assert spooled_bytes(spool, run.run_id) == 0


@pytest.mark.slow  # the server stopped and started again
def test_a_driver_opening_its_run_waits_out_a_server_that_does_not_answer(own_server, experiment, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries off: ours are tested
    uri, tries, lines = own_server.handle.uri, [], []

    def open_run():  # what a driver does as it starts: its run, then an artifact
        run = RunLogger.start(uri, experiment, "driver", background=True, spool_dir=tmp_path / "spool")
        tries.append(run.run_id)
        if len(tries) == 1:  # the server goes away between the run and its artifact, back in a while
            own_server.handle.stop()
            threading.Timer(6.0, own_server.restart).start()
        run.log_dict({"space": {"optim.lr": [0.1]}}, "sweep.json")
        return run

    run = through_mlflow_outages(open_run, "the sweep's parent run", lines.append, first_pause_s=1.0)
    assert len(tries) >= 2 and lines and all("MLflow does not answer" in line for line in lines), lines
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_id for r in runs] == [run.run_id] and set(tries) == {run.run_id}  # resumed, not twice
    assert [a.path for a in client.list_artifacts(run.run_id)] == ["sweep.json"]
    run.end("FINISHED")
    assert client.get_run(run.run_id).info.status == "FINISHED"

    # a request the server refuses is not an outage: raised at once, nothing waited for
    with pytest.raises(TrackingError, match="not found"):
        through_mlflow_outages(lambda: RunLogger.start(uri, experiment, "x", run_id="0" * 32), "x", lines.append)
    assert all("MLflow does not answer" in line for line in lines)
    assert not unreachable(MlflowException("RESOURCE_DOES_NOT_EXIST: run 0 not found"))


# Starts a background-logged run, says READY, then waits to be killed.
CHILD = textwrap.dedent("""
    import sys, time
    from vitp.tracking import RunLogger
    uri, experiment, spool = sys.argv[1:4]
    run = RunLogger.start(uri, experiment, "dead", background=True, heartbeat_s=0.5, spool_dir=spool)
    run.log_metrics({"train/loss": 1.0}, step=1)
    assert run.flush(30)
    print("READY", run.run_id, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow  # a child process killed, then heartbeats go stale
def test_sigkilled_run_is_marked_killed_and_a_live_one_is_left_alone(mlflow_server, experiment, tmp_path):
    uri = mlflow_server.uri
    proc = subprocess.Popen([sys.executable, "-c", CHILD, uri, experiment, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.poll() is not None else line
        dead_id = line.split()[1]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    alive = RunLogger.start(uri, experiment, "alive", background=True, heartbeat_s=0.5, spool_dir=tmp_path)
    client = MlflowClient(uri)
    assert client.get_run(dead_id).info.status == "RUNNING"  # nothing could end it
    with pytest.raises(TrackingError, match="stale_after_s"):
        mark_stale_runs(uri, experiment, stale_after_s=0)

    time.sleep(6.0)  # the live run beats every 0.5 s meanwhile
    marked = mark_stale_runs(uri, experiment, stale_after_s=5.0)
    assert [m.run_id for m in marked] == [dead_id] and marked[0].idle_s >= 5.0
    dead = client.get_run(dead_id)
    assert dead.info.status == "KILLED" and "no heartbeat" in dead.data.tags[STALE_TAG]
    assert dead.info.end_time == int(marked[0].last_seen * 1000)
    assert client.get_run(alive.run_id).info.status == "RUNNING"
    alive.end("FINISHED")
    assert mark_stale_runs(uri, experiment, stale_after_s=0.001) == []  # ended runs are never touched
    assert client.get_run(alive.run_id).info.status == "FINISHED"


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
@pytest.mark.slow  # a child process killed, then heartbeats go stale
def test_vitp_compare_shows_a_sigkilled_run_killed(mlflow_server, experiment, tmp_path):
    """`vitp compare` on the experiment first ends runs whose process died (no heartbeat) KILLED."""
    uri = mlflow_server.uri
    proc = subprocess.Popen([sys.executable, "-c", CHILD, uri, experiment, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.poll() is not None else line
        dead_id = line.split()[1]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    time.sleep(3.0)
    out = subprocess.run([sys.executable, "-m", "vitp.cli", "compare", "--tracking-uri", uri,
                          "--experiment", experiment, "--stale-after", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"marked run {dead_id}" in out.stderr and "KILLED" in out.stderr
    assert MlflowClient(uri).get_run(dead_id).info.status == "KILLED"
