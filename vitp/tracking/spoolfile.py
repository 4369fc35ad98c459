"""A run's metric spool file: JSON lines on local disk, one file per process, flock-ed while it lives.

Owns creating, appending, reading, adopting and handing over spool files (spool.py sends them).
A line is in a file whole or not at all; a file is visible only once locked. No torch, no ray,
and MLflow only where lines become metrics (`read`): the per-node spool tasks import this module.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from vitp.paths import spool_root

if TYPE_CHECKING:
    from mlflow.entities import Metric

try:
    import fcntl
except ImportError:  # Windows: no flock; a spool is then never adopted while its process lives
    fcntl = None

log = logging.getLogger(__name__)

METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
# The most a run's spool holds unsent (tracking.spool_max_mb): a line of ~20 metrics is ~600 bytes,
# so 512 MB is a day of one line per step at 10 steps/s while MLflow is down. Lines beyond it
# are dropped, counted and named in one warning; training never stops for it.
SPOOL_MAX_MB = 512.0
_READ_CHUNK = 1 << 20
_PART = ".part"  # a spool file under its temp name, before it is locked (never adopted)


def spool_dir_for(run_id: str, spool_dir: str | os.PathLike | None = None) -> Path:
    """Where a run's spool files live: <spool_dir>/<run_id>/, by default under this user's private
    <tmp>/vitp-<uid>/mlflow-spool (vitp.paths.spool_root; a spool_dir the user names is taken as it is)."""
    root = Path(spool_dir or spool_root())
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
            if fd is not None and os.fstat(fd).st_size == size:
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
    """An fd of `path` flock-ed by us, or None when it is gone (or unlinked after we opened it) or
    its process still holds it."""
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
        yield fd if os.fstat(fd).st_nlink else None  # unlinked by another adopter in between
    finally:
        os.close(fd)


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
        from mlflow.entities import Metric  # lazy: only the sender needs it (see the module doc)

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

    def unsent(self) -> bytes:
        """The whole lines not sent yet (what a checkpoint carries: tracking/runs.py backlog)."""
        data = self._unsent(max(self.pending_bytes(), 1))
        return data[:data.rfind(b"\n") + 1]

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
            with _unlocked(other) as fd:  # None: adopted meanwhile, or its process sends it itself
                if fd is None:
                    continue
                with open(other, "rb") as f:
                    for line in f:
                        if line.endswith(b"\n") and (rec := _parse(line, other)):
                            for k, v in rec["m"].items():
                                seen.setdefault((k, rec["step"]), (rec["ts"], v))
                os.unlink(other)
        lines: dict[tuple[int, int], dict[str, float]] = {}  # (step, ts) -> values, as logged
        for (k, step), (ts, v) in seen.items():
            lines.setdefault((step, ts), {})[k] = v
        top: dict[str, int] = {}
        for step, ts in sorted(lines):
            self.append(step, ts, lines[step, ts])
            top.update({k: step for k in lines[step, ts]})
        if top:
            log.debug("adopted %d leftover metric values (steps up to %d) into %s",
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
    with contextlib.suppress(FileNotFoundError):
        if time.time() - path.stat().st_mtime < min_age_s:
            return
    with _unlocked(path) as fd:
        if fd is not None:
            path.unlink()


def _parse(line: bytes, path: Path) -> dict | None:
    try:
        rec = json.loads(line)
        return {"step": int(rec["step"]), "ts": int(rec["ts"]), "m": dict(rec["m"])}
    except (ValueError, KeyError, TypeError):
        log.warning("%s: unreadable spool line skipped: %r", path, line[:200])
        return None
