"""What of the Ray processes' output reaches the driver's console: known chatter dropped, each
warning once per run. Replaces Ray's printer of worker output (a private Ray hook: if it moves,
Ray's own printer stays and nothing breaks). `vitp --verbose` leaves Ray's printer alone.
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any

# Lines from Ray, Ray Data and DeepSpeed that a user cannot act on.
CHATTER = tuple(re.compile(p) for p in (
    r"DeepSpeed \S+ built successfully",  # every worker loads DeepSpeed's comm op
    r"core_worker\.cc:\d+: Actor with class name: '\w+' .* has constructor arguments in the object store",
    r"Progress bars disabled\. To enable",  # we turn Ray Data's bars off on purpose
    # Train's placement-group cleaner polls the State API, which a local Ray without its dashboard
    # does not serve: every second, harmless
    r"Failed to query Ray Train Controller actor state",
    r"^Reporting training result \d+: TrainingReport\(",  # Train logs every report at INFO on a path-named logger
))
# Deprecations raised inside installed libraries (torch calling its own deprecated API, Ray's
# options): only the library's authors can act on them
LIBRARY_DEPRECATION = re.compile(r"site-packages/.*: (\w*DeprecationWarning|FutureWarning): ")
# "path:line: SomeWarning: message" as the warnings module prints it (the next line is the source)
WARNING_LINE = re.compile(r"^\S+:\d+: (\w*Warning): (.*)$")


class OutputFilter:
    """Filters the `lines` of Ray's worker-output records (thread-safe)."""

    def __init__(self):
        self.seen_warnings: set[str] = set()
        self.lock = threading.Lock()

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

    def __call__(self, printer, data: dict[str, Any]) -> None:
        lines = self.lines(list(data.get("lines") or []))
        if lines:
            printer({**data, "lines": lines})


def install() -> bool:
    """Put an OutputFilter in front of Ray's printer of worker output (after ray.init); False
    when this Ray has no such hook (its printer is left as it is)."""
    try:
        from ray._private import worker as w  # private: guarded, see the module docstring

        dispatcher = w.global_worker_stdstream_dispatcher
        names = [name for name, _ in dispatcher.handlers]
        if "ray_print_logs" not in names:
            return False
        printer = functools.partial(w.print_to_stdstream,
                                    ignore_prefix=w._should_ignore_worker_log_prefix(w.global_worker))
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", functools.partial(OutputFilter(), printer))
        return True
    except (ImportError, AttributeError, TypeError):
        return False
