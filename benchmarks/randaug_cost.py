"""RandAugment's cost on the Ray Data workers: training ingest over the same uint8 shards with
RandAugment off and at AugReg's settings (2 ops at magnitude 10, 15, 20), images/s and images per
CPU-second, on this machine's cores.

Each pass is what training reads: `build_train_dataset` + `iter_device_batches` (uint8 batches), one
stream over --epochs epochs, inception crop + flip on the workers, then RandAugment on the same
workers when it is on. The passes are interleaved over --rounds rounds (the load drifts; medians
reported). CPU-seconds: user + system of this process and all Ray processes, by psutil at the start
and the end of each pass (benchmarks/data_throughput.py's accounting). Also the cost of
`rand_augment` alone, per image in one process (no Ray), for each magnitude.

Run:  .venv/bin/python benchmarks/randaug_cost.py --images 2000 --cpus 2 --rounds 3
The table is printed and appended, with this command line, the date and the machine, to
benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from data_throughput import Pass, corpus_in, cpu_snapshot, cpu_used, med  # benchmarks/, beside this script
from record import add_results_args, append_result
from vitp.data.augment import row_rng
from vitp.data.commands import run_preprocess
from vitp.data.ingest import build_train_dataset, iter_device_batches
from vitp.data.randaug import rand_augment
from vitp.recipes import get_recipe
from vitp.config import Run

SETTINGS = [("off", (0, 0.0)), ("2 ops, M=10 (light2)", (2, 10.0)), ("2 ops, M=15 (medium1/2)", (2, 15.0)),
            ("2 ops, M=20 (strong1/2)", (2, 20.0))]


def ingest_pass(cfg, batch: int, first_epoch: int, epochs: int) -> Pass:
    c0, t0, n = cpu_snapshot(), time.time(), 0
    ds = build_train_dataset(Run.of(cfg), start_epoch=first_epoch, num_epochs=epochs)
    for _, y in iter_device_batches(ds, batch, "cpu", raw=True):
        n += len(y)
    return Pass(n, time.time() - t0, cpu_used(c0, cpu_snapshot()))


def op_ms(size: int, layers: int, magnitude: float, n: int = 200) -> float:
    """rand_augment alone: ms per (size x size) image, one process."""
    imgs = np.random.default_rng(0).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    t0 = time.process_time()
    for i in range(n):
        rand_augment(imgs[i], layers, magnitude, row_rng(0, 0, str(i)))
    return 1000 * (time.process_time() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("images", 2000), ("classes", 10), ("storage", 256), ("size", 224),
                          ("batch", 64), ("rounds", 3), ("epochs", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="the CPU budget: Ray num_cpus")
    ap.add_argument("--workdir", default="")
    add_results_args(ap)
    args = ap.parse_args()

    import ray
    from ray.data import DataContext

    work = args.workdir or tempfile.mkdtemp(prefix="vitp-bench-")
    corpus = corpus_in(work, args.images, args.classes)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    DataContext.get_current().enable_progress_bars = False
    torch.set_num_threads(1)  # the consuming process: the --cpus cores are the workers'
    base = get_recipe("debug")
    data = dataclasses.replace(base.data, source="imagefolder", path=corpus, storage_size=args.storage,
                               image_size=args.size, num_classes=args.classes, val_fraction=0.0, shard_mb=64,
                               crop_scale_min=0.08, shards=os.path.join(work, "shards-uint8"))
    cfg = dataclasses.replace(base, work_dir=work, data=data)
    if not os.path.exists(os.path.join(data.shards, "manifest.json")):
        run_preprocess(Run.of(cfg), log=lambda s: None)
    cfgs = {name: dataclasses.replace(cfg, data=dataclasses.replace(data, randaug_layers=ra[0],
                                                                     randaug_magnitude=ra[1]))
            for name, ra in SETTINGS}
    ingest_pass(cfgs["off"], args.batch, 0, 1)  # warm-up: Ray workers
    runs = {name: [] for name in cfgs}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, c in cfgs.items():
            runs[name].append(ingest_pass(c, args.batch, 1 + r * args.epochs, args.epochs))
            loads.append(os.getloadavg()[0])
        print(f"round {r}: " + ", ".join(f"{n} {runs[n][-1].per_cpu:.0f}/CPU-s" for n in runs), flush=True)
    ray.shutdown()

    off_cpu, off_rate = med(runs["off"], lambda p: p.per_cpu), med(runs["off"], lambda p: p.rate)
    lines = ["| RandAugment | images/s (median) | images per CPU-s (median) | vs off per CPU-s | vs off wall | "
             f"rand_augment alone, ms per {args.size} px image | rounds: images per CPU-s |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, ra in SETTINGS:
        ps = runs[name]
        per_cpu, rate = med(ps, lambda p: p.per_cpu), med(ps, lambda p: p.rate)
        alone = f"{op_ms(args.size, *ra):.2f}" if ra[0] else "-"
        lines.append(f"| {name} | {rate:.0f} | {per_cpu:.0f} | {per_cpu / off_cpu:.2f}x | {rate / off_rate:.2f}x | "
                     f"{alone} | {' '.join(f'{p.per_cpu:.0f}' for p in ps)} |")
    table = "\n".join(lines)
    notes = (f"{args.images} JPEGs, storage {args.storage}px as uint8 shards, train crop {args.size}px (inception "
             f"crop + flip, then RandAugment), batch {args.batch}, Ray num_cpus {args.cpus} plus the consuming "
             f"process (torch on 1 thread), {args.rounds} interleaved rounds of {args.epochs} epochs per setting; "
             f"1-min load average {min(loads):.1f}-{max(loads):.1f}. Every setting reads the same shards and "
             f"does the same crop; 'alone' is `rand_augment` timed in one process on random pixels "
             f"(process CPU time).")
    print(f"\n{notes}\n\n{table}")
    append_result(args.results, "RandAugment on the Ray Data workers (`benchmarks/randaug_cost.py`)", table,
                  notes=notes)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
