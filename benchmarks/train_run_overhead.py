"""What one small Ray Train run costs besides its steps: the fixed price every pre-training,
fine-tuning and sweep-trial test pays, and what Ray Train's controller poll adds to it.

Run (from the repository root):

  .venv/bin/python benchmarks/train_run_overhead.py --poll 2.0 --poll 0.5 --repeats 2

For each `--poll` value (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: how often Ray Train's controller polls
its workers; Ray's default is 2.0, the test suite uses 0.5) a fresh local Ray (`--cpus` logical
CPUs) runs `--repeats` debug-recipe pre-trainings (pico/8 on the synthetic fractal shards, made
once, `--workers` Train workers, ZeRO `--zero`, `--steps` steps, a checkpoint every 4 steps,
validation at the end, MLflow on SQLite) through `run_training`, the same call `vitp pretrain`
makes. Printed: each run's wall time and the median per poll value. Each value runs in its own
process, since Ray reads the variable when it starts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_setting(args: argparse.Namespace) -> None:
    """Child process: start Ray, make the shards, time the runs; prints 'run SECONDS' lines."""
    import ray

    sys.path.insert(0, ROOT)
    from vitp.data.commands import run_preprocess
    from vitp.recipes import resolve, with_overrides
    from vitp.config import Run
    from vitp.train.trainer import run_training

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    root = tempfile.mkdtemp(prefix="vitp-overhead-")
    run_preprocess(Run.of(resolve("debug", [f"data.shards={root}/shards"])), log=lambda s: None)
    warmup = min(args.steps, with_overrides("debug").optim.warmup_steps)  # --steps below it is valid
    for i in range(args.repeats):
        cfg = resolve("debug", [f"work_dir={root}", f"data.shards={root}/shards", f"tracking.run_name=r{i}",
                                f"train.steps={args.steps}", "train.checkpoint_every=4", "train.log_every=1",
                                "train.eval_every=0", f"optim.warmup_steps={warmup}",
                                f"parallel.num_workers={args.workers}",
                                f"parallel.grad_accum={2 // args.workers}", f"parallel.zero_stage={args.zero}"])
        t0 = time.time()
        run_training(Run.of(cfg))
        print(f"run {time.time() - t0:.2f}", flush=True)
    ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--poll", type=float, action="append", help="controller poll seconds (repeatable)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, choices=(1, 2))
    ap.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--cpus", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _one_setting(args)
    for poll in args.poll or [2.0, 0.5]:
        env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(poll)}
        child = [sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(args.repeats),
                 "--steps", str(args.steps), "--workers", str(args.workers), "--zero", str(args.zero),
                 "--cpus", str(args.cpus)]
        out = subprocess.run(child, env=env, capture_output=True, text=True, cwd=ROOT)
        times = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("run ")]
        if out.returncode or len(times) != args.repeats:
            sys.exit(f"poll {poll}: the runs failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        print(f"poll {poll:4.1f} s: runs {', '.join(f'{t:.1f}' for t in times)} s; "
              f"median {statistics.median(times):.1f} s", flush=True)


if __name__ == "__main__":
    main()
