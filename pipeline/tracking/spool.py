"""Off-thread metric logging: a JSON-lines spool on local disk, a sender thread, the heartbeat tag.

log_metrics appends a line and returns; the sender posts lines in order, one short HTTP attempt each,
asking the server for each key's top step first and after any failure: each (metric, step) lands once.
A spool left by a dead process is adopted by the next start of its run. No torch, no ray.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path

from mlflow.entities import Metric, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.store.tracking.rest_store import RestStore
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.proto_json_utils import parse_dict
from mlflow.utils.rest_utils import http_request, verify_rest_response

from pipeline.tracking.store import get_client, normalise_uri

try:
    import fcntl
except ImportError:  # Windows: no flock; a spool is then never adopted while its process lives
    fcntl = None

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "vitp.heartbeat"  # unix seconds; refreshed by the sender, read by stale.py
METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
# The most a run's spool holds unsent (tracking.spool_max_mb): a line of ~20 metrics is ~600 bytes,
# so 512 MB is a day of one line per step at 10 steps/s while MLflow is down. Lines beyond it
# are dropped, counted and named in one warning; training never stops for it.
SPOOL_MAX_MB = 512.0
_READ_CHUNK = 1 << 20
_PART = ".part"  # a spool file under its temp name, before it is locked (never adopted)


def spool_dir_for(run_id: str, spool_dir: str | os.PathLike | None = None) -> Path:
    """Where a run's spool files live: <spool_dir or $TMPDIR/vitp-mlflow-spool>/<run_id>/."""
    root = Path(spool_dir) if spool_dir else Path(tempfile.gettempdir()) / "vitp-mlflow-spool"
    return root / run_id


def has_leftovers(run_id: str, spool_dir: str | os.PathLike | None = None) -> bool:
    d = spool_dir_for(run_id, spool_dir)
    return d.is_dir() and any(p.stat().st_size for p in d.glob("*.jsonl"))


def ended_spools(run_id: str, spool_dir: str | os.PathLike | None = None) -> list[tuple[str, bytes]]:
    """(file name, contents) of this run's non-empty spool files here whose process has ended (not
    locked): what another node's driver must adopt. Read only; remove_spools deletes them."""
    out = []
    for path in sorted(spool_dir_for(run_id, spool_dir).glob("*.jsonl")):
        with _unlocked(path) as fd:
            if fd is not None and (data := os.pread(fd, os.fstat(fd).st_size, 0)):
                out.append((path.name, data))
    return out


def remove_spools(run_id: str, files: dict[str, int], spool_dir: str | os.PathLike | None = None) -> int:
    """Delete the spool files named in `files` ({name: size}) that are still unlocked and of that
    size (nothing was added since they were copied); returns how many."""
    removed = 0
    for name, size in files.items():
        path = spool_dir_for(run_id, spool_dir) / name
        with _unlocked(path) as fd:
            if fd is not None and os.fstat(fd).st_size == size and os.fstat(fd).st_nlink:
                path.unlink()
                removed += 1
    return removed


def add_leftover(run_id: str, name: str, data: bytes, spool_dir: str | os.PathLike | None = None) -> Path:
    """Write `data` (another node's spool) as a leftover spool of this run here, whole or not at
    all (temp name, fsync, rename): the next adopt_leftovers sends it."""
    directory = spool_dir_for(run_id, spool_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    part = directory / f".{name}{_PART}"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(part, path)
    return path


@contextlib.contextmanager
def _unlocked(path: Path):
    """An fd of `path` flock-ed by us, or None when it is gone or its process still holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        yield None
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
        yield fd
    finally:
        os.close(fd)


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

    def log_batch(self, run_id: str, metrics=(), tags=()) -> None:
        if self._rest:
            self._rest.log_batch(run_id, list(metrics), [], list(tags))
        else:
            self._client.log_batch(run_id, metrics=list(metrics), tags=list(tags))

    def max_step(self, run_id: str, key: str) -> int:
        history = (self._rest or self._client).get_metric_history(run_id, key)
        return max((m.step for m in history), default=-1)

    def terminate(self, run_id: str, status: str) -> None:
        end = int(time.time() * 1000)
        if self._rest:
            self._rest.update_run_info(run_id, RunStatus.from_string(status), end, None)
        else:
            self._client.set_terminated(run_id, status, end)


def _rejected(e: Exception) -> bool:
    """The server refused the batch itself (400/404): resending cannot help."""
    return isinstance(e, MlflowException) and e.get_http_status_code() in (400, 404)


class MetricSpool:
    """One process's spool <dir>/<pid>-<hex>.jsonl, flock-ed while the process lives.

    Lines {"step", "ts", "m": {key: value}} in log order; bytes before `_offset` are sent.
    The file is emptied whenever all of it is sent, so it holds only the backlog. It appears under
    its name only once locked (created as .<name>.part, locked, renamed), so no adopter can take it
    from a live writer; a line is in it whole or not at all; it holds at most `max_bytes`.
    """

    def __init__(self, directory: Path, max_bytes: int = int(SPOOL_MAX_MB * 2**20)):
        self.dir = directory
        self.path = directory / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        part = directory / f".{self.path.name}{_PART}"
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        except FileNotFoundError:  # another process's close() removed the empty directory just now
            directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(part, self.path)  # the lock goes with the file: adopters only ever see it locked
        self._lock = threading.Lock()
        self._offset = 0
        self._closed = False  # a sender thread stuck in a request may outlive close()
        self.max_bytes = max_bytes
        self.dropped = 0  # lines refused because the unsent backlog had reached max_bytes
        self.failed = 0  # lines the disk refused (each removed whole, never left half-written)

    def append(self, step: int, ts: int, values: dict[str, float]) -> None:
        """Add one line, whole: a short write is completed; a write that fails is cut back to the
        line's start (then OSError). Past `max_bytes` of backlog the line is dropped and counted."""
        line = (json.dumps({"step": step, "ts": ts, "m": values}) + "\n").encode()
        with self._lock:
            if self._closed:
                raise OSError(f"spool {self.path} is closed")
            start = os.fstat(self._fd).st_size
            if start - self._offset + len(line) > self.max_bytes:
                if not self.dropped:
                    log.warning("metric spool %s holds %d MB unsent, its bound: further metrics are dropped "
                                "until MLflow takes some (raise tracking.spool_max_mb to keep more)",
                                self.path, self.max_bytes // 2**20)
                self.dropped += 1
                return
            written = 0
            try:
                while written < len(line):  # os.write may write less than asked
                    written += os.write(self._fd, line[written:])
            except OSError:
                self.failed += 1
                if written:
                    with contextlib.suppress(OSError):
                        os.ftruncate(self._fd, start)  # only this process writes to it (locked)
                raise

    def pending_bytes(self) -> int:
        with self._lock:
            return 0 if self._closed else os.fstat(self._fd).st_size - self._offset

    def _unsent(self, limit: int) -> bytes:
        with self._lock:
            size = limit
            while not self._closed:
                data = os.pread(self._fd, size, self._offset)
                if b"\n" in data or len(data) < size:
                    return data
                size *= 2  # one line longer than `limit`
            return b""

    def read(self, max_values: int = METRICS_PER_BATCH) -> tuple[list[Metric], int]:
        """The metrics of the next unsent whole lines (at most max_values unless one line has
        more) and how many bytes they take."""
        metrics: list[Metric] = []
        used = 0
        for line in self._unsent(_READ_CHUNK).splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # being written
            rec = _parse(line, self.path)
            if metrics and rec and len(metrics) + len(rec["m"]) > max_values:
                break
            if rec:
                metrics += [Metric(k, v, rec["ts"], rec["step"]) for k, v in rec["m"].items()]
            used += len(line)
        return metrics, used

    def pending_values(self) -> int:
        data = self._unsent(max(self.pending_bytes(), 1))
        return sum(len(rec["m"]) for line in data.splitlines() if (rec := _parse(line, self.path)))

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._offset += nbytes
            if self._offset >= os.fstat(self._fd).st_size:
                os.ftruncate(self._fd, 0)
                self._offset = 0

    def adopt_leftovers(self) -> dict[str, int]:
        """Move the lines of spool files whose process is gone into this one: oldest file first,
        the first value of each (key, step) kept, in step order. Returns the top step per key."""
        seen: dict[tuple[str, int], tuple[int, float]] = {}
        for part in self.dir.glob(f".*{_PART}"):  # a process that died before its rename: empty
            _remove_if_unlocked(part)
        for other in sorted(self.dir.glob("*.jsonl"), key=lambda p: os.path.getmtime(p) if p.exists() else 0):
            if other == self.path:
                continue
            try:
                fd = os.open(other, os.O_RDWR)
            except FileNotFoundError:
                continue  # adopted by another start meanwhile
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # its process is alive and sends it itself
                if os.fstat(fd).st_nlink == 0:
                    continue  # another start adopted it between our open and our lock
                with open(other, "rb") as f:
                    for line in f:
                        if line.endswith(b"\n") and (rec := _parse(line, other)):
                            for k, v in rec["m"].items():
                                seen.setdefault((k, rec["step"]), (rec["ts"], v))
                os.unlink(other)
            finally:
                os.close(fd)
        lines: dict[tuple[int, int], dict[str, float]] = {}  # (step, ts) -> values, as logged
        for (k, step), (ts, v) in seen.items():
            lines.setdefault((step, ts), {})[k] = v
        top: dict[str, int] = {}
        for step, ts in sorted(lines):
            self.append(step, ts, lines[step, ts])
            top.update({k: step for k in lines[step, ts]})
        if top:
            log.info("adopted %d leftover metric values (steps up to %d) into %s",
                     len(seen), max(top.values()), self.path)
        return top

    def close(self) -> None:
        """Release the file; removed when empty, else left for the next start of the run."""
        with self._lock:
            if self._closed:
                return
            if os.fstat(self._fd).st_size - self._offset <= 0:
                self.path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.dir.rmdir()  # only when no other process's spool is in it
            os.close(self._fd)
            self._closed = True


def _remove_if_unlocked(path: Path, min_age_s: float = 60.0) -> None:
    """Remove a spool's temp file left by a process that died between creating and renaming it
    (microseconds apart): only when older than `min_age_s` and not locked."""
    try:
        if time.time() - path.stat().st_mtime < min_age_s:
            return
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # being created right now
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _parse(line: bytes, path: Path) -> dict | None:
    try:
        rec = json.loads(line)
        return {"step": int(rec["step"]), "ts": int(rec["ts"]), "m": dict(rec["m"])}
    except (ValueError, KeyError, TypeError):
        log.warning("%s: unreadable spool line skipped: %r", path, line[:200])
        return None


class MetricSender:
    """A run's spool plus the daemon thread that posts it and refreshes the heartbeat tag.

    `known`: top step per key the server holds (None: not known). The sender reads the server's top
    step of each key before sending it first and again after any failed request (it may have
    succeeded server-side), and drops every (key, step) at or below it; per key the spool is in
    step order, so the top step suffices.
    """

    def __init__(self, tracking_uri: str, run_id: str, known: dict[str, int] | None, *, timeout_s: float = 5.0,
                 spool_dir: str | os.PathLike | None = None, heartbeat_s: float = 30.0,
                 retry_max_s: float = 15.0, spool_max_mb: float = SPOOL_MAX_MB):
        self.client = SenderClient(tracking_uri, timeout_s)
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.spool = MetricSpool(spool_dir_for(run_id, spool_dir), max_bytes=int(spool_max_mb * 2**20))
        self.adopted = self.spool.adopt_leftovers()
        self.known = dict(known or {})
        self._checked = set(self.known)  # keys whose top step is confirmed since the last failure
        self.heartbeat_s = heartbeat_s
        self.retry_max_s = retry_max_s
        self.last_error = ""
        self.left = 0
        self._wake = threading.Event()
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
                return False
            if self._thread is None or not self._thread.is_alive():
                if not self.drain():
                    time.sleep(min(left, 0.5))
                continue
            self._wake.set()
            with self._sent:
                self._sent.wait(min(left, 0.5))
        return True

    def adopt(self) -> None:
        """Take over the spools of this run's processes that ended meanwhile (e.g. a Train worker's
        on this node); they may have sent part of them since the server's steps were read."""
        if self.spool.adopt_leftovers():
            self._checked.clear()

    def close(self, timeout_s: float) -> bool:
        """Adopt ended processes' spools, flush (bounded), stop the thread, release the spool
        (kept on disk if not empty)."""
        self.adopt()
        self.flush(timeout_s)
        self._stopping = True
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
    def drain(self) -> bool:
        """Send everything spooled now; False at the first failure (the rest stays spooled)."""
        while True:
            metrics, nbytes = self.spool.read(METRICS_PER_BATCH)
            if not nbytes:
                return True
            try:
                for key in {m.key for m in metrics} - self._checked:
                    self.known[key] = max(self.known.get(key, -1), self.client.max_step(self.run_id, key))
                    self._checked.add(key)
                batch = self._new(metrics)
                if batch:
                    self.client.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # noqa: BLE001 - any failure: keep it spooled and retry later
                if not _rejected(e):
                    self._failed(e)
                    return False
                log.warning("MLflow rejected %d metric values of run %s (dropped): %s", len(metrics), self.run_id, e)
                batch = []
            for m in batch:
                self.known[m.key] = m.step
            self.spool.advance(nbytes)
            if self.last_error:
                log.warning("MLflow at %s answers again: sending spooled metrics", self.client.uri)
                self.last_error = ""
            with self._sent:
                self._sent.notify_all()

    def _new(self, metrics: list[Metric]) -> list[Metric]:
        """The metrics the server lacks, in step order, one per (key, step)."""
        top = dict(self.known)
        batch = []
        for m in sorted(metrics, key=lambda m: m.step):
            if m.step > top.get(m.key, -1):
                top[m.key] = m.step
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
                ok = self.drain()
            except Exception:  # noqa: BLE001 - e.g. the spool's disk failing: keep the thread, retry
                log.exception("MLflow sender of run %s", self.run_id)
                ok = False
            if ok and time.monotonic() - last_beat >= self.heartbeat_s:
                ok = self.beat()
                last_beat = time.monotonic() if ok else last_beat
            if ok:
                backoff, wait = 0.5, max(0.05, self.heartbeat_s - (time.monotonic() - last_beat))
            else:
                wait, backoff = backoff, min(backoff * 2, self.retry_max_s)

    def terminate(self, status: str) -> bool:
        try:
            self.client.terminate(self.run_id, status)
            return True
        except Exception as e:  # noqa: BLE001
            self.last_error = str(e)
            return False
