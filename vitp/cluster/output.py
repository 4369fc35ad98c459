"""What of the Ray processes' output reaches the driver's console: known chatter dropped, each
warning once per run, training progress as one redrawn bar on an interactive terminal. Wraps Ray's
printers (private hooks: if they move, Ray's own printers stay). `vitp --verbose` leaves them be.
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any, Callable

from ..console import TEXT_LOG_PREFIX, LiveLine, start_live_line

# Lines from Ray, Ray Data and DeepSpeed that a user cannot act on.
CHATTER = tuple(re.compile(p) for p in (
    r"DeepSpeed \S+ built successfully",  # every worker loads DeepSpeed's comm op
    r"core_worker\.cc:\d+: Actor with class name: '\w+' .* has constructor arguments in the object store",
    r"Progress bars disabled\. To enable",  # we turn Ray Data's bars off on purpose
    # Train's placement-group cleaner polls the State API, which a local Ray without its dashboard
    # does not serve: every second, harmless
    r"Failed to query Ray Train Controller actor state",
    # the raylet counting the worker processes a sweep's trials start (each trial's controller,
    # workers and data tasks): expected here, and nothing a user changes
    r"PYTHON worker processes have been started on node",
    r"^Reporting training result \d+: TrainingReport\(",  # Train logs every report at INFO on a path-named logger
))
# Deprecations raised inside installed libraries (torch calling its own deprecated API, Ray's
# options): only the library's authors can act on them
LIBRARY_DEPRECATION = re.compile(r"site-packages/.*: (\w*DeprecationWarning|FutureWarning): ")
# A training progress line (vitp.train.worker's log line, less its time, level and rank):
# "[run] step N/M ... ETA 0h01m02s"; one that also carries an evaluation ("| val top1 ...") is
# kept in the scrollback like any other line.
PROGRESS = re.compile(r"^\[[^\]]+\] step (\d+)/(\d+) [^|]*\bETA (\S+)$")
# "path:line: SomeWarning: message" as the warnings module prints it (the next line is the source)
WARNING_LINE = re.compile(r"^\S+:\d+: (\w*Warning): (.*)$")


class OutputFilter:
    """Filters the `lines` of Ray's worker-output records (thread-safe); with a `live` line,
    training progress goes there instead of scrolling."""

    def __init__(self, live: LiveLine | None = None):
        self.seen_warnings: set[str] = set()
        self.lock = threading.Lock()
        self.live = live

    def lines(self, lines: list[str]) -> list[str]:
        out, skip_source = [], False
        for line in lines:
            if skip_source and line.startswith("  "):  # the dropped warning's source line
                skip_source = False
                continue
            skip_source = False
            if any(p.search(line) for p in CHATTER):
                continue
            if LIBRARY_DEPRECATION.search(line):
                skip_source = True
                continue
            m = WARNING_LINE.match(line)
            if m:
                key = f"{m.group(1)}: {m.group(2)}"
                with self.lock:
                    repeat = key in self.seen_warnings
                    self.seen_warnings.add(key)
                if repeat:
                    skip_source = True
                    continue
            out.append(line)
        return out

    def wrap(self, printer: Callable[..., None]) -> Callable[..., None]:
        """`printer` (a Ray printer of output records: a dict with "lines") behind this filter; a
        record left with no lines is not printed."""
        def filtered(data: dict[str, Any], **kwargs: Any) -> None:
            lines = self.lines(list(data.get("lines") or []))
            if self.live:
                rest = []
                for line in lines:
                    message = TEXT_LOG_PREFIX.sub("", line, count=1)
                    m = PROGRESS.match(message)
                    if m:
                        self.live.progress(message, int(m.group(1)), int(m.group(2)), m.group(3))
                    else:
                        rest.append(line)
                lines = rest
            if lines:
                printer({**data, "lines": lines}, **kwargs)
        return filtered


def install() -> bool:
    """Put one OutputFilter in front of Ray's two printers (after ray.init): worker output, and
    the raylet's messages to the driver; False when this Ray has no such hook (its printers are
    left as they are)."""
    try:
        from ray._private import worker as w  # private: guarded, see the module docstring

        dispatcher = w.global_worker_stdstream_dispatcher
        if "ray_print_logs" not in [name for name, _ in dispatcher.handlers]:
            return False
        original = getattr(w.print_to_stdstream, "__wrapped__", w.print_to_stdstream)
        filtered = OutputFilter(start_live_line()).wrap(original)
        filtered.__wrapped__ = original  # installing twice wraps once
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", functools.partial(
            filtered, ignore_prefix=w._should_ignore_worker_log_prefix(w.global_worker)))
        w.print_to_stdstream = filtered  # what listen_error_messages calls for the raylet's lines
        return True
    except (ImportError, AttributeError, TypeError):
        return False
