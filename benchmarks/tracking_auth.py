"""What basic auth costs an MLflow tracking server: the same metric posts with the login cache off and on.

Run (from the repository root):

  .venv/bin/python benchmarks/tracking_auth.py --requests 200

For each --cache value (seconds a verified login is trusted: `vitp mlflow-server --auth-cache-s`,
MLflow's `auth_cache_ttl_seconds`; 0 = the password hash is checked on every request), a fresh
`mlflow server` with the basic-auth app on a SQLite store in a temp dir (one server worker, as
start_server starts it), then one client posting --requests `log_metric` calls to one run, one
after another, signed in as the admin. Measured: the client's wall time and the server's CPU
seconds (its process group, from psutil) over those posts only; server start-up is left out.
Appended to benchmarks/RESULTS.md (`--results`/`--no-results`).
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of the server process and everything it started."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one(cache_s: int, requests: int, tmp: str) -> tuple[float, float]:
    """(client wall seconds, server CPU seconds) for `requests` metric posts at this cache time."""
    from mlflow.tracking import MlflowClient

    from vitp.tracking.server import AuthSettings, start_server

    password = secrets.token_urlsafe(18)
    handle = start_server(f"sqlite:///{tmp}/mlflow.db", f"{tmp}/artifacts", log_path=f"{tmp}/server.log",
                          auth=AuthSettings(admin_password=password, cache_ttl_s=cache_s))
    try:
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = "admin", password
        client = MlflowClient(handle.uri)
        run = client.create_run(client.create_experiment("auth-cost")).info.run_id
        cpu0, t0 = server_cpu(handle.process.pid), time.perf_counter()
        for i in range(requests):
            client.log_metric(run, "m", float(i), step=i)
        return time.perf_counter() - t0, server_cpu(handle.process.pid) - cpu0
    finally:
        handle.stop()
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(key, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="metric posts per server (default 200)")
    ap.add_argument("--cache", type=int, nargs="+", default=[0, 60], metavar="S",
                    help="login cache times to compare, in seconds (default 0 60)")
    add_results_args(ap)
    args = ap.parse_args()
    if args.requests < 1 or any(c < 0 for c in args.cache):
        ap.error("--requests must be >= 1 and --cache values >= 0")
    rows = []
    for cache_s in args.cache:
        with tempfile.TemporaryDirectory(prefix="vitp-auth-") as tmp:
            wall, cpu = one(cache_s, args.requests, tmp)
        rows.append(f"| {cache_s} | {args.requests} | {wall:.1f} | {cpu:.1f} | {1000 * cpu / args.requests:.1f} |")
        print(rows[-1], flush=True)
    table = "\n".join(["| login cache s | posts | client wall s | server CPU s | server CPU ms/post |",
                       "|---:|---:|---:|---:|---:|", *rows])
    print(table)
    append_result(args.results, "Basic auth on the tracking server (`benchmarks/tracking_auth.py`)", table,
                  notes="One `log_metric` per request, one client, one server worker, SQLite store.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
