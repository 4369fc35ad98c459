"""Training steps/s of a Ray Train run with Ray Data's scheduling loop paced (vitp/data/
executor.py) against unpaced, the same run otherwise.

Run (from the repository root):

  .venv/bin/python benchmarks/executor_pacing.py --steps 1500

The debug recipe (pico/8 at 32 px, 2 Ray Train workers, gloo, fp32) on its synthetic corpus,
`run_training` as `vitp pretrain` runs it, logging every step to an `mlflow server` on 127.0.0.1
(its SQLite store in --workdir), as a user's run logs. Each mode runs in its own process with
its own local Ray of --cpus logical CPUs and VITP_RAY_DATA_ROUND_S set before Ray starts (the
Train workers inherit it): `paced` the default round, `unpaced` 0. steps/s is read from the
train/loss timestamps (rank 0 logs each step when it is taken): over the whole run and over each
fifth of it, so a phase where the executors spin shows. Appended to benchmarks/RESULTS.md
(`--results`/`--no-results`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)


def one_mode(args) -> dict:
    """In this process: a local Ray, the debug shards (made once per --workdir), one run."""
    import ray

    from vitp.data.commands import run_preprocess
    from vitp.recipes import resolve
    from vitp.net import free_port
    from vitp.tracking.server import start_server
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.trainer import run_training

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    shards = os.path.join(args.workdir, "shards")
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        run_preprocess(Run.of(resolve("debug", [f"data.shards={shards}"])), log=lambda s: None)
    name = f"pace-{args.one}".replace(".", "_")
    server = start_server(f"sqlite:///{os.path.join(args.workdir, 'mlflow.db')}",
                          os.path.join(args.workdir, "artifacts"), port=free_port(),
                          log_path=os.path.join(args.workdir, f"{name}-mlflow.log"))
    uri = server.uri
    cfg = resolve("debug", [f"work_dir={args.workdir}", f"data.shards={shards}", f"tracking.uri={uri}",
                            f"tracking.run_name={name}", f"train.steps={args.steps}", "train.log_every=1",
                            "train.eval_every=0", "train.checkpoint_every=0", "train.resume=never"])
    try:
        summary = run_training(Run.of(cfg), with_val=False)
        history = get_client(uri).get_metric_history(summary.mlflow_run_id, "train/loss")
        stamps = sorted(m.timestamp / 1000 for m in history)
    finally:
        server.stop()
    fifth = len(stamps) // 5
    parts = [fifth / max(stamps[(i + 1) * fifth - 1] - stamps[i * fifth], 1e-9) for i in range(5)]
    return {"steps": len(stamps), "steps_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "fifths": parts, "wall_s": summary.seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--cpus", type=int, default=4, help="logical CPUs of each mode's local Ray")
    ap.add_argument("--workdir", default="/tmp/vitp-executor-pacing")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one mode's round seconds
    add_results_args(ap)
    args = ap.parse_args(argv)
    if args.one is not None:
        print("RESULT " + json.dumps(one_mode(args)), flush=True)
        return 0
    from vitp.data.executor import ROUND_ENV, ROUND_S

    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    for mode, round_s in (("paced", ROUND_S), ("unpaced", 0.0)):
        print(f"{mode}: {args.steps} steps ...", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", repr(round_s), "--steps", str(args.steps),
               "--cpus", str(args.cpus), "--workdir", args.workdir, "--no-results"]
        env = {**os.environ, ROUND_ENV: repr(round_s)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
            return 1
        rows.append((mode, round_s, json.loads(line[len("RESULT "):])))
    base = rows[0][2]["steps_per_s"]
    lines = ["| mode | round s | steps | steps/s | each fifth of the run, steps/s | run s | paced / this |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for mode, round_s, r in rows:
        lines.append(f"| {mode} | {round_s:g} | {r['steps']} | {r['steps_per_s']:.1f} | "
                     f"{', '.join(f'{v:.1f}' for v in r['fifths'])} | {r['wall_s']:.0f} | "
                     f"{base / r['steps_per_s']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    title = "Ray Data's executor in a Train worker (`benchmarks/executor_pacing.py`)"
    append_result(args.results, title, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
