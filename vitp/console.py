"""How much third-party output a user sees: `vitp --verbose` (env VITP_VERBOSE=1) shows it all;
by default our lines, warnings and errors only; progress is a bar redrawn in place on a terminal,
a line per report elsewhere. Our library lines are `logging` records with time, level and rank,
as text or JSON (`vitp --log-format json`, env VITP_LOG_FORMAT), each masked by vitp.tracking.redact
(standard library only); no other pipeline imports.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import re
import shutil
import sys
import threading
from typing import Any, Callable, Iterator

from .errors import UserError

VERBOSE_ENV = "VITP_VERBOSE"
LOG_FORMAT_ENV = "VITP_LOG_FORMAT"
LOG_FORMATS = ("text", "json")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_env() -> dict[str, str]:
    """Environment for the driver and every Ray process of a local cluster, so a run prints our
    lines and errors only: Train's print patch off (it logs each print a second time), Ray Data's
    console at WARNING (its config ships with this package) and without progress bars, Tune's
    classic (silent) reporter. Empty with `vitp --verbose`. Set it before ray.data is imported
    (Ray Data reads it then)."""
    if verbose():
        return {}
    # Tune's newer console output prints a settings box even at verbose=0; the classic one does not
    return {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_AIR_NEW_OUTPUT": "0",
            # Ray Data's bars redraw in every task that runs a dataset (a log of escape codes);
            # our commands print their own progress lines
            "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
            # Ray folds lines that differ only in numbers into "[repeated Nx across cluster]":
            # that folds our progress lines; vitp.cluster.output drops repeats instead
            "RAY_DEDUP_LOGS": "0",
            # MLflow prints "View run ... at: URL" whenever a run on a server ends (every trial)
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
            # ... and redraws a bar for every artifact it downloads (a run's config, weights)
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
            "RAY_DATA_LOGGING_CONFIG": os.path.join(os.path.dirname(__file__), "cluster",
                                                    "ray_data_logging.yaml")}


# Driver-side loggers whose lines a user cannot act on: MLflow creating its SQLite tables, Ray's
# note that a local cluster uses token authentication, Ray Data's that its bars are off.
QUIET_LOGGERS = {"mlflow.store.db.utils": logging.WARNING, "alembic.runtime.migration": logging.WARNING,
                 "ray._private.authentication.authentication_token_setup": logging.ERROR,
                 "ray.data._internal.progress": logging.ERROR}


def quiet_loggers() -> None:
    """Raise QUIET_LOGGERS' levels in this process (not with `vitp --verbose`)."""
    if not verbose():
        for name, level in QUIET_LOGGERS.items():
            logging.getLogger(name).setLevel(level)


def library_log_level() -> str:
    """Ray's and Ray Train's own log level: WARNING quiets their INFO lines (worker group starts,
    every report) but keeps what a user may need to act on."""
    return "INFO" if verbose() else "WARNING"


@contextlib.contextmanager
def quiet_output() -> Iterator[None]:
    """Hold a library's stdout/stderr chatter (progress bars, "processing ..." lines); printed
    after all if the block raises, so nothing that explains an error is lost (but not for a
    UserError: its one line is the whole explanation)."""
    if verbose():
        yield
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield
    except UserError:
        raise
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise


def name_cpu_accelerator(use_gpu: bool) -> None:
    """Tell DeepSpeed the accelerator before it is imported, instead of letting it detect one and
    warn "Setting accelerator to CPU" in every process that has no GPU."""
    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


class LiveLine:
    """One terminal line that progress redraws in place (`\\r`, erase to the end). Output through
    `guard(stream)` ends that line first, so nothing is written over it."""

    BAR = 20

    def __init__(self, stream):
        self.stream, self.open, self.lock = stream, False, threading.Lock()

    def progress(self, line: str, done: int, total: int, eta: str) -> None:
        filled = self.BAR * min(done, total) // max(total, 1)
        text = f"[{'#' * filled}{'.' * (self.BAR - filled)}] ETA {eta} {line}"  # cut on the right
        width = shutil.get_terminal_size((120, 20)).columns - 1
        with self.lock:
            self.stream.write("\r\x1b[K" + text[:width])
            self.stream.flush()
            self.open = True

    def guard(self, stream) -> "_EndsLiveLine":
        return _EndsLiveLine(stream, self)


class _EndsLiveLine:
    """A text stream (sys.stdout / sys.stderr) whose writes first end the live line."""

    def __init__(self, stream, live: LiveLine):
        self._stream, self._live = stream, live

    def write(self, text: str) -> int:
        with self._live.lock:
            if text and self._live.open:
                self._live.stream.write("\n")
                self._live.open = False
            return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_live: LiveLine | None = None


def start_live_line() -> LiveLine | None:
    """On an interactive terminal (and not `--verbose`), this process's LiveLine, with sys.stdout
    and sys.stderr guarded by it; None elsewhere (logs, pipes, CI)."""
    global _live
    if _live is None and sys.stdout.isatty() and not verbose():
        _live = LiveLine(sys.stdout)
        sys.stdout, sys.stderr = _live.guard(sys.stdout), _live.guard(sys.stderr)
    return _live


def duration(seconds: float) -> str:
    """A progress line's duration: `42s`, `3m07s`."""
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress(line: str, done: int, total: int, eta: str, log: Callable[[str], None] = print) -> None:
    """A progress report of the driver: the redrawn bar where there is a live line, else `line`
    through `log` (one line per report in logs and CI)."""
    if _live is not None:
        _live.progress(line, done, total, eta)
    else:
        log(line)


# ------------------------------------------------------------------------------ library log lines

_rank: int | None = None  # this process's world rank, once it is a Train worker


def set_log_rank(rank: int | None) -> None:
    """Name `rank` in this process's log records (a Train worker's world rank; None: the driver)."""
    global _rank
    _rank = rank


def log_format() -> str:
    """"text" or "json", from VITP_LOG_FORMAT (what `vitp --log-format` sets; any other value: text)."""
    fmt = os.environ.get(LOG_FORMAT_ENV, "")
    return fmt if fmt in LOG_FORMATS else "text"


def log_env() -> dict[str, str]:
    """The log format for every Ray process of a job (set only where it is not the default)."""
    return {LOG_FORMAT_ENV: log_format()} if log_format() != "text" else {}


# What LogFormatter puts before a text line's message (time, level, rank)
TEXT_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ [A-Z]+ \[[^\]]+\] ")


class LogFormatter(logging.Formatter):
    """Text: `2026-11-28 03:05:01Z INFO [rank 0] message` (UTC; `driver` where there is no rank).
    JSON: one object a line with time (ISO 8601, UTC), level, rank (null on the driver), logger
    and message, plus the traceback of an exception."""

    def format(self, record: logging.LogRecord) -> str:
        # every line leaves through the one redaction of messages: a known secret value, a URI's
        # password, a signed URL's signature or a token is masked in whatever a library logs too
        from vitp.tracking.redact import redact_message  # lazy: vitp.tracking imports config

        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        trace = redact_message(self.formatException(record.exc_info)) if record.exc_info else ""
        message = redact_message(record.getMessage())
        if log_format() == "json":
            entry = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                     "level": record.levelname, "rank": _rank, "logger": record.name, "message": message}
            if trace:
                entry["exception"] = trace
            return json.dumps(entry)
        who = "driver" if _rank is None else f"rank {_rank}"
        line = f"{when:%Y-%m-%d %H:%M:%S}Z {record.levelname} [{who}] {message}"
        return line + ("\n" + trace if trace else "")


class _StdHandler(logging.Handler):
    """INFO to sys.stdout, WARNING and above to sys.stderr, looked up at each record: the live
    line's guard (and a test's capture) replace them after this handler is made."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # a closed stream must not end the work
            self.handleError(record)


def get_logger(name: str) -> logging.Logger:
    """The logger of a vitp module. The first call gives the `vitp` logger its one handler (INFO;
    DEBUG with `--verbose`), so a run prints its lines whether it is driven by `vitp` or from
    Python; the records do not also reach the root logger (Ray installs handlers there)."""
    top = logging.getLogger("vitp")
    if not any(isinstance(h, _StdHandler) for h in top.handlers):
        handler = _StdHandler()
        handler.setFormatter(LogFormatter())
        top.addHandler(handler)
        top.propagate = False
    top.setLevel(logging.DEBUG if verbose() else logging.INFO)
    return logging.getLogger(name)
