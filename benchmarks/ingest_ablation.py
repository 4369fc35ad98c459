"""Ablation of the training stream's task sizing, uint8 consumer.

Reads the uint8 shards that `data_throughput.py --workdir DIR` left in DIR/shards-uint8 and
streams --epochs epochs per pass through `build_train_dataset` with one unit per Ray task and
with TASK_ROWS rows per task, for each unit size; plus, for reference, one-unit tasks with Ray
Data's per-operator reservation and downstream-capacity rule turned off (faster, but then
nothing bounds the blocks a slow consumer leaves in the object store, so the pipeline does not
ship it). Interleaved rounds, medians reported.

Run:  .venv/bin/python benchmarks/data_throughput.py --images 2000 --cpus 2 --workdir /tmp/vbench
      .venv/bin/python benchmarks/ingest_ablation.py --workdir /tmp/vbench --cpus 2
The table is printed and appended, with this command line, the date and the machine, to
benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from record import add_results_args, append_result  # benchmarks/record.py, beside this script
from vitp.config import Run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="the --workdir of a data_throughput.py run")
    ap.add_argument("--cpus", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--units", default="128,256")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--memory-check", choices=["defaults", "no-reservation"],
                    help="instead: peak object-store use under a slow consumer (0.2 s per batch) "
                         "on a 2 GiB object store, for one setting (run each in its own process: "
                         "an abandoned stream keeps producing until its executor shuts down)")
    add_results_args(ap)
    args = ap.parse_args()

    import ray
    import torch
    from ray.data import DataContext

    import vitp.data.ingest as ingest
    from vitp.data.ingest import build_train_dataset, iter_device_batches
    from vitp.data.shards import read_manifest
    from vitp.recipes import get_recipe

    shards = os.path.join(args.workdir, "shards-uint8")
    manifest = read_manifest(shards)  # a clear error if data_throughput.py has not run there
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             object_store_memory=2 * 1024 ** 3 if args.memory_check else None)
    DataContext.get_current().enable_progress_bars = False
    base = get_recipe("debug")
    cfg = dataclasses.replace(base, work_dir=args.workdir, data=dataclasses.replace(
        base.data, source="imagefolder", shards=shards, image_size=args.size,
        num_classes=manifest["num_classes"],
        val_fraction=0.0, crop_scale_min=0.08, storage_format="uint8"))

    task_rows = ingest.TASK_ROWS

    def run(unit: int, variant: str, epoch: int) -> float:
        ingest.TASK_ROWS = unit if variant != "TASK_ROWS" else task_rows
        ds = build_train_dataset(Run.of(cfg), start_epoch=epoch, num_epochs=args.epochs, unit_rows=unit)
        if variant == "no reservation":
            ds.context.op_resource_reservation_enabled = False
            ds.context.downstream_capacity_backpressure_ratio = None
        t0, n = time.time(), 0
        for _, y in iter_device_batches(ds, args.batch, "cpu", raw=True):
            n += len(y)
        return n / (time.time() - t0)

    title = "Ingest task sizing (`benchmarks/ingest_ablation.py`)"
    if args.memory_check:
        v = "no reservation" if args.memory_check == "no-reservation" else "TASK_ROWS"
        line = (f"{args.memory_check}: peak object store "
                f"{slow_consumer_peak_mib(build_train_dataset, cfg, v):.0f} MiB of 2048")
        print(line, flush=True)
        append_result(args.results, title + ", memory check", line)
        return
    units = [int(u) for u in args.units.split(",")]
    variants = ["1 unit", "TASK_ROWS", "no reservation"]
    run(units[-1], "TASK_ROWS", 0)  # warm-up: worker processes
    res: dict = {}
    for r in range(args.rounds):
        for unit in units:
            for v in variants:
                res.setdefault((unit, v), []).append(run(unit, v, 1 + args.epochs * r))
        print(f"round {r} done", flush=True)
    ray.shutdown()
    lines = ["| unit rows | rows per task | Ray Data settings | images/s (median) | rounds |",
             "|---:|---:|---|---:|---|"]
    for (unit, v), rates in res.items():
        rows = task_rows if v == "TASK_ROWS" else unit
        settings = "reservation + downstream rule off" if v == "no reservation" else "defaults"
        lines.append(f"| {unit} | {rows} | {settings} | {np.median(rates):.0f} | "
                     f"{' '.join(f'{x:.0f}' for x in rates)} |")
    table = "\n".join(lines)
    print("\n" + table)
    n_train = manifest.get("counts", {}).get("train", "?")
    append_result(args.results, title, table,
                  notes=f"Shards {shards} ({n_train} training images), {args.cpus} CPUs, crop "
                        f"{args.size}px, batch {args.batch}, {args.rounds} interleaved rounds of "
                        f"{args.epochs} epochs, uint8 consumer.")


def slow_consumer_peak_mib(build, cfg, variant: str, rows: int = 2500) -> float:
    """Stream 6 epochs, take a 64-row batch every 0.2 s (~320 img/s, slower than the readers)
    until `rows` are consumed; return the peak plasma use seen by a 0.5 s poller."""
    import re
    import threading

    from ray._private.internal_api import memory_summary

    def plasma_mib() -> float:
        m = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
        return float(m.group(1)) if m else 0.0

    # start from an empty store: blocks of an earlier stream must not count against this one
    deadline = time.time() + 60
    while plasma_mib() > 16 and time.time() < deadline:
        time.sleep(0.5)
    ds = build(cfg, start_epoch=0, num_epochs=6)
    if variant == "no reservation":
        ds.context.op_resource_reservation_enabled = False
        ds.context.downstream_capacity_backpressure_ratio = None
    peak, stop = [0.0], threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], plasma_mib())
            time.sleep(0.5)

    threading.Thread(target=poll, daemon=True).start()
    n = 0
    for b in ds.iter_batches(batch_size=64, batch_format="numpy"):
        n += len(b["label"])
        time.sleep(0.2)
        if n >= rows:
            break
    stop.set()
    return peak[0]


if __name__ == "__main__":
    main()
