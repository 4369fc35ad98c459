"""`vitp` commands that talk to a cluster or serve one: submit, jobs, doctor, mlflow-server.

Each parser sits beside its handler. Spec checks live in vitp/cluster/jobspec.py, the Jobs API
client in vitp/cluster/jobs.py, the checks in vitp/cluster/doctor.py, the server in
vitp/tracking/server.py. Must not contain logic, print a secret value, or bind beyond 127.0.0.1 by default.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from vitp.cli.args import Handler, add_address, add_recipe, add_set, add_tracking, positive, run_from
from vitp.errors import ConfigError

# What `vitp submit` exits with once the job has ended (3, cluster unreachable, is ClusterError's).
JOB_EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 4}


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ------------------------------------------------------------------------------ submit


def cmd_submit(args: argparse.Namespace) -> int:
    from vitp.cluster import jobs  # lazy: keeps vitp --help fast (mlflow, via redaction)
    from vitp.cluster.jobspec import load_spec  # lazy: keeps vitp --help fast (mlflow, via redaction)
    from vitp.cluster.upload import check_upload_size  # lazy: keeps vitp --help fast (mlflow, via redaction)

    spec = load_spec(args.spec, args.overrides, forward_env=args.forward_env,
                     job_tracking_uri=args.job_tracking_uri or "")
    for line in spec.warnings():
        print(f"vitp submit: warning: {line}", file=sys.stderr)
    notes = check_upload_size(spec)
    address = jobs.jobs_address(args.address)
    if not args.job_tracking_uri:  # the user's own --job-tracking-uri is taken as it is
        env = (spec.kwargs.get("runtime_env") or {}).get("env_vars") or {}
        jobs.check_job_tracking(env, address, lambda: jobs.node_ips(jobs.client(address)))
    print(f"job spec {args.spec}: recipe(s) "
          f"{', '.join(dict.fromkeys(r for c in spec.calls for r in c.recipes)) or '(none)'} resolve")
    for line in spec.describe() + notes:
        print(f"  {line}")
    client, job_id = jobs.submit(address, spec.kwargs, spec.mask)
    print(f"submitted {job_id} to {address}")
    print(f"  logs: vitp jobs logs {job_id} --address {address}")
    print(f"  stop: vitp jobs stop {job_id} --address {address}")
    sys.stdout.flush()
    if args.no_wait:
        return 0
    with jobs.cluster_errors(address, spec.mask):
        if args.follow:
            jobs.follow_logs(client, job_id, spec.mask, _write)
        info = jobs.wait_for_job(client, job_id)
    status = jobs.status_of(info)
    if status == "SUCCEEDED":
        print(f"job {job_id} SUCCEEDED")
    else:
        print(f"vitp submit: job {job_id} {status}: {spec.mask(info.message or '')}".rstrip(), file=sys.stderr)
    return JOB_EXIT_CODES[status]


def _add_submit(sub) -> Handler:
    p = sub.add_parser("submit", help="submit a Ray job spec (jobs/*.yaml) through the Ray Jobs API",
                       description="Validate a job spec, resolve its recipe, check the working_dir "
                                   "size, submit it and wait. Exit 0 when the job SUCCEEDED, 1 "
                                   "FAILED, 4 STOPPED, 3 cluster unreachable or refused, 2 bad spec.")
    p.add_argument("spec", help="job spec YAML, e.g. jobs/pretrain_h14_i21k.yaml")
    add_address(p, jobs_api=True)
    add_set(p, help="config override appended to every `vitp COMMAND RECIPE` of the spec's entrypoint "
                    "(no re-quoting: $VARS and shell operators stay as written); RECIPE:KEY=VALUE "
                    "for one recipe's command (repeatable)")
    add_job_tracking(p)
    p.add_argument("--forward-env", action="append", default=[], metavar="NAME",
                   help="send this shell's $NAME to the job too (repeatable; a credential's value is "
                        "never printed). Nothing else from this shell goes unless the spec names it")
    p.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    p.add_argument("--no-wait", action="store_true", help="return once submitted")
    return cmd_submit


# -------------------------------------------------------------------------------- jobs


def cmd_jobs(args: argparse.Namespace) -> int:
    from vitp.cluster import jobs  # lazy: keeps vitp --help fast (mlflow, via redaction)
    from vitp.tracking.redact import redact_text  # lazy: keeps vitp --help fast (mlflow)

    address = jobs.jobs_address(args.address)
    if args.action != "list" and not args.job_id:
        raise ConfigError(f"{args.action} needs a job id, e.g. vitp jobs {args.action} raysubmit_...")
    client = jobs.client(address)
    with jobs.cluster_errors(address):
        if args.action == "list":
            listed = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
            if not listed:
                print(f"no jobs on {address}")
            for j in listed:
                started = time.strftime("%Y-%m-%d %H:%M", time.localtime((j.start_time or 0) / 1000))
                print(f"{j.submission_id or j.job_id:28s} {jobs.status_of(j):10s} {started}  "
                      f"{redact_text(j.entrypoint or '')[:100]}")
        elif args.action == "stop":
            stopped = client.stop_job(args.job_id)
            print(f"{args.job_id}: {'stop requested' if stopped else 'already finished'}")
        elif args.follow:
            jobs.follow_logs(client, args.job_id, redact_text, _write)
        else:
            _write(redact_text(client.get_job_logs(args.job_id)))
    return 0


def _add_jobs(sub) -> Handler:
    p = sub.add_parser("jobs", help="list Ray jobs, stop one, or print its logs")
    p.add_argument("action", nargs="?", choices=["list", "stop", "logs"], default="list")
    p.add_argument("job_id", nargs="?", help="submission id (for stop / logs)")
    add_address(p, jobs_api=True)
    p.add_argument("--follow", action="store_true", help="logs: stream until the job ends")
    return cmd_jobs


# ------------------------------------------------------------------------------ doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    from vitp.cluster import doctor  # lazy: keeps vitp --help fast (ray, mlflow)

    run = run_from(args, check_paths=False)  # data.path may live on the cluster only
    if args.min_busbw < 0 or args.min_busbw != args.min_busbw:
        raise ConfigError(f"--min-busbw {args.min_busbw}: give a bandwidth in GB/s, 0 or more (e.g. 100)")
    allreduce = args.min_busbw if (args.allreduce or args.min_busbw) else None
    checks = doctor.run_checks(run, args.address, lambda c: print(c.line(), flush=True), args.job_tracking_uri,
                               allreduce)
    return doctor.exit_code(checks)


def _add_doctor(sub) -> Handler:
    p = sub.add_parser("doctor", help="preflight: check the cluster, token, storage, MLflow and shards",
                       description="Before a long job: check that the cluster answers at --address and "
                                   "accepts the token, that work_dir can be written, listed, read and "
                                   "deleted from this machine and from the cluster's other nodes, that "
                                   "MLflow accepts a run, and that the recipe's shards exist (--allreduce: "
                                   "and the bandwidth between the Train workers). One line "
                                   "per check ('ok' or 'FAIL ... -> fix'). Exit 0 when all pass, 3 when "
                                   "any fails, 2 bad recipe or --set.")
    add_recipe(p)
    p.add_argument("--address", help="Ray dashboard / Jobs API address http://<head>:8265 (default "
                                     "$RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, then http://127.0.0.1:8265), "
                                     "or a GCS host:port / ray:// address; a token from $RAY_AUTH_TOKEN "
                                     "or $RAY_AUTH_TOKEN_PATH is sent when set")
    add_tracking(p, can_disable=False, help="MLflow tracking URI to check from this machine (default: the "
                                            "config's, sqlite in work_dir)")
    add_job_tracking(p)
    p.add_argument("--allreduce", action="store_true",
                   help="also all-reduce across the recipe's Train workers (the GPUs a run takes, for a few "
                        "seconds) and report the bus bandwidth in GB/s (docs/cluster.md, 'Bandwidth between nodes')")
    p.add_argument("--min-busbw", type=float, default=0.0, metavar="GBPS",
                   help="with --allreduce (implied): FAIL below this bus bandwidth, e.g. 100 on p5.48xlarge to catch "
                        "NCCL falling back to TCP (docs/cluster.md, 'Bandwidth between nodes')")
    return cmd_doctor


def add_job_tracking(p) -> None:
    p.add_argument("--job-tracking-uri", metavar="URI", default=os.environ.get("VITP_JOB_TRACKING_URI"),
                   help="the MLflow address the jobs use on the cluster, where it differs from this machine's "
                        "(e.g. http://mlflow.mlflow.svc.cluster.local:5000 while this machine uses a "
                        "port-forward); default $VITP_JOB_TRACKING_URI, else this machine's")


# ----------------------------------------------------------------------- mlflow-server


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_mlflow_server(args: argparse.Namespace) -> int:
    from vitp.tracking.redact import redact_text
    from vitp.tracking.secret_values import add_uri_passwords
    from vitp.tracking.server import AuthSettings, start_server  # lazy: keeps vitp --help fast (mlflow)

    add_uri_passwords(args.backend_store_uri)  # the database password: masked in whatever this prints
    allowed = [h for h in (args.allowed_hosts or "").split(",") if h]
    # a process manager's stop (SIGTERM) also stops the server's own process group, which would
    # otherwise outlive this command; Ctrl-C is ignored only where the shell said so (nohup, `&`).
    # Set before the server starts: a stop at any moment after is a Ctrl-C (a start cut short
    # stops what it started)
    signal.signal(signal.SIGTERM, _interrupt)
    handle = start_server(  # TrackingError (e.g. the old default admin password) -> exit 2
        args.backend_store_uri, args.artifacts_destination, host=args.host, port=args.port,
        allowed_hosts=allowed or None, workers=args.workers,
        auth=AuthSettings(cache_ttl_s=args.auth_cache_s) if args.auth else None, log_path=args.log,
    )
    try:
        print(f"mlflow server at {handle.uri} (backend {redact_text(args.backend_store_uri)}, artifacts "
              f"{args.artifacts_destination}, auth {'basic' if args.auth else 'off'}); log {handle.log_path}")
        print(f"  clients: export MLFLOW_TRACKING_URI={handle.uri}"
              + ("  MLFLOW_TRACKING_USERNAME=... MLFLOW_TRACKING_PASSWORD=..." if args.auth else ""))
        print("  Ctrl-C stops it", flush=True)
        while handle.alive():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
    return 0 if not handle.process.returncode else 1


def _add_mlflow_server(sub) -> Handler:
    p = sub.add_parser("mlflow-server", help="run an MLflow tracking server (SQL store, proxied artifacts)",
                       description="Binds 127.0.0.1 unless --host says otherwise; a non-loopback "
                                   "host needs --auth (basic auth; admin password from "
                                   "$MLFLOW_AUTH_ADMIN_PASSWORD, never the old default).")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5000, help="port to listen on")
    p.add_argument("--backend-store-uri",
                   default=os.environ.get("MLFLOW_BACKEND_STORE_URI") or "sqlite:///mlflow-server/mlflow.db",
                   help="SQL store: sqlite:///path.db or postgresql://... (default $MLFLOW_BACKEND_STORE_URI, "
                        "else sqlite:///mlflow-server/mlflow.db); a URI with a password belongs in that "
                        "variable, not on a command line others can read")
    p.add_argument("--artifacts-destination", default="mlflow-server/artifacts",
                   help="artifact store the server proxies: a directory or s3://, gs:// URI")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host header values to accept (DNS-rebinding guard), "
                        "e.g. mlflow.example.com,mlflow.mlflow.svc")
    p.add_argument("--auth", action="store_true",
                   help="basic auth (MLflow's basic-auth app); its user store is $MLFLOW_AUTH_DATABASE_URI "
                        "(any characters in its password), else auth.db beside a SQLite tracking store")
    p.add_argument("--auth-cache-s", type=int, default=60, metavar="S",
                   help="with --auth: trust a verified login for S seconds instead of hashing the "
                        "password on every request (each hash costs about 0.2 s of server CPU); a "
                        "password changed through the API is refused at once by the worker that "
                        "changed it, by the other workers within S; 0 = hash every request")
    p.add_argument("--workers", type=positive(), default=2, help="server worker processes")
    p.add_argument("--log", help="server log file (default a temp file)")
    return cmd_mlflow_server


def add_parsers(sub) -> dict[str, Handler]:
    """Add this group's subcommands to `sub`; returns {command name: handler}."""
    return {"submit": _add_submit(sub), "jobs": _add_jobs(sub), "doctor": _add_doctor(sub),
            "mlflow-server": _add_mlflow_server(sub)}
