"""Off-thread metric logging: the sender thread that posts a run's spool (spoolfile.py), the heartbeat.

log_metrics appends a line and returns; the sender posts in order, one post a second (SEND_INTERVAL_S;
more while a backlog fills whole batches), asking the server each key's steps first and after any
failure: each (metric, step) lands once. A dead process's spool goes with its run's next start. No torch/ray.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from functools import partial

from mlflow.entities import Metric, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.store.tracking.rest_store import RestStore
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.proto_json_utils import parse_dict
from mlflow.utils.rest_utils import http_request, verify_rest_response

from vitp.tracking.spoolfile import METRICS_PER_BATCH, SPOOL_MAX_MB, MetricSpool, spool_dir_for
from vitp.tracking.store import get_client, normalise_uri

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "vitp.heartbeat"  # unix seconds; refreshed by the sender, read by stale.py
# What a metric may wait in the spool before it is posted: one post per interval, whatever the
# logging rate. A run that logs every step at ~20 steps/s otherwise posts ~20 times a second, and the
# tracking server's work competes with training (tests/train/test_mlflow_outage.py on 2 cores, one
# run each: 14.5 steps/s before its outage with a post per step, 17.8 with one a second; up to 29
# while the server was down).
SEND_INTERVAL_S = 1.0
# A folder where each process appends every metric point the server acknowledged (run, key, step,
# timestamp; one file per process): an audit independent of MLflow, which keeps one of identical
# points, so a resend with the original timestamp is invisible there. The chaos soak sets it.
SEND_LOG_ENV = "VITP_METRIC_SEND_LOG"


class _OneShotRestStore(RestStore):
    """RestStore making one HTTP attempt per call, bounded by `timeout_s`.

    mlflow retries each request up to 7 times with doubling backoff and a 120 s timeout
    (MLFLOW_HTTP_REQUEST_MAX_RETRIES / _BACKOFF_FACTOR / _TIMEOUT): minutes. Those are process-wide
    environment settings, so the sender passes its own limits per request instead.
    """

    def __init__(self, uri: str, timeout_s: float):
        super().__init__(partial(get_default_host_creds, uri))
        self._timeout_s = timeout_s

    def _call_endpoint(self, api, json_body=None, endpoint=None, retry_timeout_seconds=None,
                       response_proto=None):
        default_endpoint, method = self._METHOD_TO_INFO[api]
        endpoint = endpoint or default_endpoint
        body = json.loads(json_body) if json_body is not None else None
        response = http_request(
            self.get_host_creds(), endpoint, method, max_retries=0, backoff_factor=0,
            timeout=self._timeout_s, **({"params": body} if method == "GET" else {"json": body}),
        )
        response = verify_rest_response(response, endpoint)
        proto = response_proto or api.Response()
        parse_dict(js_dict=json.loads(response.text or "{}"), message=proto)
        return proto


class SenderClient:
    """The calls the sender makes: one bounded attempt each against a server, plain calls on a DB."""

    def __init__(self, tracking_uri: str, timeout_s: float):
        uri = normalise_uri(tracking_uri)
        self.uri = uri
        self._rest = _OneShotRestStore(uri, timeout_s) if uri.startswith(("http://", "https://")) else None
        self._client = None if self._rest else get_client(uri)
        folder = os.environ.get(SEND_LOG_ENV)
        self._send_log = os.path.join(folder, f"sends-{os.getpid()}.tsv") if folder else None

    def log_batch(self, run_id: str, metrics=(), tags=()) -> None:
        if self._rest:
            self._rest.log_batch(run_id, list(metrics), [], list(tags))
        else:
            self._client.log_batch(run_id, metrics=list(metrics), tags=list(tags))
        if self._send_log and metrics:  # acknowledged: written down (SEND_LOG_ENV)
            try:
                os.makedirs(os.path.dirname(self._send_log), exist_ok=True)
                with open(self._send_log, "a") as f:
                    f.write("".join(f"{run_id}\t{m.key}\t{m.step}\t{m.timestamp}\n" for m in metrics))
            except OSError as e:  # the audit must not make a sent batch look unsent (it would be resent)
                log.warning("%s: cannot write %s (%s); metric posts are no longer written down",
                            SEND_LOG_ENV, self._send_log, e)
                self._send_log = None

    def steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in (self._rest or self._client).get_metric_history(run_id, key)}

    def terminate(self, run_id: str, status: str) -> None:
        end = int(time.time() * 1000)
        if self._rest:
            self._rest.update_run_info(run_id, RunStatus.from_string(status), end, None)
        else:
            self._client.set_terminated(run_id, status, end)


def _rejected(e: Exception) -> bool:
    """The server refused the batch itself (400/404): resending cannot help."""
    return isinstance(e, MlflowException) and e.get_http_status_code() in (400, 404)


class MetricSender:
    """A run's spool plus the daemon thread that posts it and refreshes the heartbeat tag.

    `known`: top step per key the server holds (None: not known). The sender reads the server's
    steps of each key before sending it first and again after any failed request (it may have
    succeeded server-side). A step above the key's top is sent; one at or below it (a line that came
    late: a dead rank's spool gathered after its successor logged on, a checkpoint's backlog) is
    sent only if the server lacks it, so each (key, step) lands once whatever order lines come in.
    """

    def __init__(self, tracking_uri: str, run_id: str, known: dict[str, int] | None, *, timeout_s: float = 5.0,
                 spool_dir: str | os.PathLike | None = None, heartbeat_s: float = 30.0,
                 retry_max_s: float = 15.0, spool_max_mb: float = SPOOL_MAX_MB,
                 send_interval_s: float = SEND_INTERVAL_S):
        self.client = SenderClient(tracking_uri, timeout_s)
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.spool = MetricSpool(spool_dir_for(run_id, spool_dir), max_bytes=int(spool_max_mb * 2**20))
        self.adopted = self.spool.adopt_leftovers()
        self.known = dict(known or {})
        self._checked = set(self.known)  # keys whose top step is confirmed since the last failure
        self.heartbeat_s = heartbeat_s
        self.retry_max_s = retry_max_s
        self.send_interval_s = send_interval_s
        self.last_error = ""
        self.left = 0
        self._wake = threading.Event()
        self._hurry = threading.Event()  # a flush or close waits: post now, not after the interval
        self._sent = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- caller side
    def start(self) -> "MetricSender":
        self._thread = threading.Thread(target=self._run, name=f"mlflow-sender-{self.run_id[:8]}", daemon=True)
        self._thread.start()
        return self

    def append(self, step: int, ts: int, values: dict[str, float]) -> None:
        self.spool.append(step, ts, values)
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the spool to empty (retrying twice a second meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while self.spool.pending_bytes() > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                self._hurry.clear()
                return False
            if self._thread is None or not self._thread.is_alive():
                if not self.drain():
                    time.sleep(min(left, 0.5))
                continue
            self._hurry.set()
            self._wake.set()
            with self._sent:
                self._sent.wait(min(left, 0.5))
        self._hurry.clear()
        return True

    def adopt(self) -> dict[str, int]:
        """Take over the spools of this run's processes that ended meanwhile (e.g. a Train worker's
        on this node); they may have sent part of them since the server's steps were read. Returns
        the adopted top step per key."""
        if top := self.spool.adopt_leftovers():
            self._checked.clear()
        return top

    def close(self, timeout_s: float) -> bool:
        """Adopt ended processes' spools, flush (bounded), stop the thread, release the spool
        (kept on disk if not empty)."""
        self.adopt()
        self.flush(timeout_s)
        self._stopping = True
        self._hurry.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1.0)  # at most one request in flight
        self.left = self.spool.pending_values()  # metric values kept on disk
        if self.spool.dropped or self.spool.failed:
            log.warning("run %s: %d metric lines were not spooled (%d past the spool's bound, %d refused by "
                        "the disk) and are not in MLflow", self.run_id, self.spool.dropped + self.spool.failed,
                        self.spool.dropped, self.spool.failed)
        self.spool.close()
        return self.left == 0

    # ---------------------------------------------------------------- sender side
    def drain(self, until_empty: bool = True) -> bool:
        """Send what is spooled; False at the first failure (the rest stays spooled). Not
        `until_empty`: stop after a batch that was not full, so steps appended while it was being
        posted wait for the next post instead of making one each."""
        have: dict[str, set[int]] = {}  # the server's steps of keys with late lines (this drain)
        while True:
            metrics, nbytes = self.spool.read(METRICS_PER_BATCH)
            if not nbytes:
                return True
            try:
                for key in {m.key for m in metrics} - self._checked:
                    have[key] = self.client.steps(self.run_id, key)
                    self.known[key] = max(self.known.get(key, -1), max(have[key], default=-1))
                    self._checked.add(key)
                for key in {m.key for m in metrics if m.step <= self.known.get(m.key, -1)} - have.keys():
                    have[key] = self.client.steps(self.run_id, key)
                batch = self._new(metrics, have)
                if batch:
                    self.client.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # noqa: BLE001 - any failure: keep it spooled and retry later
                if not _rejected(e):
                    self._failed(e)
                    return False
                log.warning("MLflow rejected %d metric values of run %s (dropped): %s", len(metrics), self.run_id, e)
                batch = []
            for m in batch:
                self.known[m.key] = max(self.known.get(m.key, -1), m.step)
                if m.key in have:
                    have[m.key].add(m.step)
            self.spool.advance(nbytes)
            if self.last_error:
                log.warning("MLflow at %s answers again: sending spooled metrics", self.client.uri)
                self.last_error = ""
            with self._sent:
                self._sent.notify_all()
            if not until_empty and len(metrics) < METRICS_PER_BATCH:
                return True

    def _new(self, metrics: list[Metric], have: dict[str, set[int]]) -> list[Metric]:
        """The metrics the server lacks, in step order, one per (key, step): above the key's top
        step, or at or below it and not among the server's steps (`have`)."""
        top, taken, batch = dict(self.known), set(), []
        for m in sorted(metrics, key=lambda m: m.step):
            if m.step > top.get(m.key, -1):
                top[m.key] = m.step
            elif m.step in have.get(m.key, ()) or (m.key, m.step) in taken:
                continue
            taken.add((m.key, m.step))
            batch.append(m)
        return batch

    def _failed(self, e: Exception) -> None:
        self._checked.clear()
        if not self.last_error:
            log.warning("MLflow at %s unreachable (%s): metrics spooled to %s and sent when it answers",
                        self.client.uri, str(e).splitlines()[0][:200], self.spool.path)
        self.last_error = str(e)

    def beat(self) -> bool:
        try:
            self.client.log_batch(self.run_id, tags=[RunTag(HEARTBEAT_TAG, str(int(time.time())))])
            return True
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return False

    def _run(self) -> None:
        backoff, last_beat, wait = 0.5, float("-inf"), 0.0
        while not self._stopping:
            self._wake.wait(wait)
            self._wake.clear()
            try:
                ok = self.drain(until_empty=self._hurry.is_set() or self._stopping)
            except Exception:  # noqa: BLE001 - e.g. the spool's disk failing: keep the thread, retry
                log.exception("MLflow sender of run %s", self.run_id)
                ok = False
            if ok and time.monotonic() - last_beat >= self.heartbeat_s:
                ok = self.beat()
                last_beat = time.monotonic() if ok else last_beat
            if ok:
                backoff, wait = 0.5, max(0.05, self.heartbeat_s - (time.monotonic() - last_beat))
                self._hurry.wait(self.send_interval_s)  # what is appended meanwhile goes in one post
            else:
                wait, backoff = backoff, min(backoff * 2, self.retry_max_s)

    def terminate(self, status: str) -> bool:
        try:
            self.client.terminate(self.run_id, status)
            return True
        except Exception as e:  # noqa: BLE001
            self.last_error = str(e)
            return False
