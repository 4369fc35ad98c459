"""Peak memory per Ray Train worker of `vitp pretrain` against the memory model.

Run (from the repository root):

  # the must-show: ViT-H/14 at 224 px, ZeRO-3 on 2 CPU workers, micro-batch 1, 3 steps (~16 GB RAM)
  .venv/bin/python benchmarks/pretrain_memory.py --recipe h14_i21k --precision fp32 bf16
  # ZeRO 0/1/2/3 of one small model on 2 CPU workers: images/s relative to stage 0, peak vs model
  .venv/bin/python benchmarks/pretrain_memory.py --recipe b16_i21k --variant S/16 --zero 0 1 2 3 \\
      --steps 12 --micro-batch 4

Each case is one `vitp pretrain RECIPE` process (its own local Ray cluster, 2 workers, synthetic
data made by the command, no MLflow). While it runs, the resident set size (RSS) of every
RayTrainWorker process is sampled every 0.2 s; the peak of each worker is reported against the
memory model's per-worker figure (`vitp model VARIANT --zero S --workers N --micro-batch B`),
which counts model states, DeepSpeed's buffers and activations but not the Python/torch runtime
(a worker's RSS when first seen, also reported). Images/s: the mean over rank 0's progress
lines after step 1; step time = global batch / images/s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import psutil

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)

from vitp.recipes import resolve  # noqa: E402
from vitp.train.loop import memory_model  # noqa: E402


class WorkerRSS:
    """Peak RSS of each RayTrainWorker process (by pid), sampled in a thread."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.peak, self.first = every_s, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                try:
                    if "RayTrainWorker" not in " ".join(proc.info["cmdline"] or []):
                        continue
                    rss = proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.first.setdefault(proc.pid, rss)
                self.peak[proc.pid] = max(self.peak.get(proc.pid, 0), rss)
            self._stop.wait(self.every_s)

    def __enter__(self) -> "WorkerRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_case(args, precision: str, zero: int, work: str) -> dict:
    sets = [f"work_dir={work}", f"data.shards={work}/shards", "data.source=synthetic",
            "data.synth_classes=4", f"data.synth_images_per_class={max(8, args.steps * args.micro_batch)}",
            "data.val_fraction=0.25",
            f"data.image_size={args.image_size}", f"data.storage_size={args.image_size}",
            f"parallel.num_workers={args.workers}", "parallel.use_gpu=false", "parallel.cpus_per_worker=1",
            f"parallel.micro_batch={args.micro_batch}", "parallel.grad_accum=1",
            f"parallel.global_batch={args.micro_batch * args.workers}", f"parallel.zero_stage={zero}",
            f"parallel.precision={precision}", f"train.steps={args.steps}", "train.log_every=1",
            "train.checkpoint_every=0", "train.eval_every=0", "optim.warmup_steps=1"]
    if args.variant:
        sets.append(f"model.variant={args.variant}")
    cmd = [os.path.join(os.path.dirname(sys.executable), "vitp"), "pretrain", args.recipe, "--no-tracking",
           *[x for s in sets for x in ("--set", s)]]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with WorkerRSS() as rss:
        proc = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"vitp pretrain failed (exit {proc.returncode}) for {precision} ZeRO-{zero}")
    cfg = resolve(args.recipe, sets, check_paths=False)  # the config the run trained
    model = memory_model(cfg, args.workers)  # the figure training logs as perf/mem_model_gb
    # rank 0's progress lines: "step N/M loss L lr R X img/s ..." (N > 1: the first step warms up)
    ips = [float(x) for n, x in re.findall(r"step (\d+)/\d+ loss \S+ lr \S+ ([\d.]+) img/s", proc.stdout)
           if int(n) > 1]
    if not ips:
        raise SystemExit(f"no progress lines after step 1 in the output of {' '.join(cmd)}")
    images = sum(ips) / len(ips)
    peaks = sorted(rss.peak.values(), reverse=True)[:args.workers]
    base = min(rss.first.values()) if rss.first else 0
    return {"variant": cfg.model.variant, "precision": precision, "zero": zero, "wall_s": wall,
            "step_s": args.micro_batch * args.workers / images, "images_s": images,
            "peak_gb": [p / 1e9 for p in peaks], "first_rss_gb": base / 1e9, "model_gb": model.device / 1e9,
            "states_gb": model.states / 1e9, "activations_gb": model.activations / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="h14_i21k")
    ap.add_argument("--variant", default="", help="override the recipe's model.variant")
    ap.add_argument("--precision", nargs="+", default=["fp32"])
    ap.add_argument("--zero", nargs="+", type=int, default=[3])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=3)
    add_results_args(ap)
    args = ap.parse_args()
    rows = []
    for precision in args.precision:
        for zero in args.zero:
            with tempfile.TemporaryDirectory(prefix="vitp-mem-") as work:
                rows.append(run_case(args, precision, zero, work))
            print(json.dumps(rows[-1]), flush=True)
    base = {r["precision"]: r["images_s"] for r in rows if r["zero"] == 0}
    lines = ["| variant | precision | ZeRO | step s | images/s | vs ZeRO-0 | peak RSS per worker GB | "
             "model GB | peak / model | runtime RSS GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{r['images_s'] / base[r['precision']]:.2f}" if r["precision"] in base else "-"
        peaks = " / ".join(f"{p:.2f}" for p in r["peak_gb"])
        lines.append(f"| {r['variant']} | {r['precision']} | {r['zero']} | {r['step_s']:.2f} | {r['images_s']:.2f} | "
                     f"{rel} | {peaks} | {r['model_gb']:.2f} | {max(r['peak_gb']) / r['model_gb']:.2f} | "
                     f"{r['first_rss_gb']:.2f} |")
    table = "\n".join(lines)
    print(table)
    append_result(args.results, f"vitp pretrain {args.recipe}: peak memory per worker vs the memory model",
                  table)


if __name__ == "__main__":
    main()
