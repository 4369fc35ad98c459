"""`vitp doctor`'s check lines: one Check per line, the exit code, a timeout around each check.

Owns the line format, EXIT_FAILED and each check's timeout; the checks themselves are doctor.py's,
doctor_storage.py's and doctor_mlflow.py's.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from vitp.errors import UserError

EXIT_FAILED = 3  # `vitp doctor` when a check fails (a bad recipe or --set: 2, as everywhere)
TIMEOUTS = {"cluster": 45.0, "storage here": 60.0, "storage on cluster": 240.0, "mlflow": 90.0,
            "mlflow from cluster": 5.0, "data": 30.0, "all-reduce": 900.0}  # seconds, each check


@dataclass
class Check:
    name: str
    ok: bool
    detail: str  # ok: what was found; FAIL: what failed
    fix: str = ""

    def line(self) -> str:
        return f"ok   {self.name}: {self.detail}" if self.ok else f"FAIL {self.name}: {self.detail} -> {self.fix}"


def exit_code(checks: list[Check]) -> int:
    return 0 if checks and all(c.ok for c in checks) else EXIT_FAILED


def first_line(text: str, limit: int = 300) -> str:
    from vitp.tracking.redact import redact_text  # lazy: mlflow
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return redact_text(lines[0] if lines else "")[:limit]


def timed(name: str, fn: Callable[[], Check], timeout: float, fix: str) -> Check:
    """fn() in a daemon thread: a FAIL naming `fix` when it raises or gives no answer in `timeout` s."""
    box: list[Check] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line, never a traceback
            what = first_line(str(e)) if isinstance(e, UserError) else f"{type(e).__name__}: {first_line(str(e))}"
            box.append(Check(name, False, what, fix))

    (t := threading.Thread(target=target, name=f"doctor-{name}", daemon=True)).start()
    t.join(timeout)
    return box[0] if box else Check(name, False, f"no answer within {timeout:.0f}s", fix)
