"""Time to a resumed attempt's first training batch: starting at the data position vs replaying.

Run (from the repository root):

  .venv/bin/python benchmarks/resume_position.py --images-per-class 400 --cpus 2 --world 2

Preprocesses the debug recipe's synthetic corpus (10 classes x --images-per-class, 40 px uint8
shards) once into --workdir, then, on one local Ray with --cpus CPUs, times the first
micro-batch (--batch rows, the training order: preserve_order as RankStreams sets it) of rank 0
of --world Train workers (each rank reads its own share of every epoch):

  fresh    a new run: the rank's stream at epoch 0, nothing consumed
  resumed  a run resumed at --at (default 90%) of epoch 0: `build_train_dataset(consumed=...)`
           starts at the unit holding the rank's position and drops only that unit's consumed rows
  replay   the same position reached by replay: the rank's stream from the epoch's start, every
           consumed row read, augmented and discarded

All three read, decode and augment with the same code on the same CPUs; only the position
differs. The script checks, for every rank, that `resumed` and `replay` yield the same first
batch (same keys).
Median of --rounds interleaved rounds. Appended to benchmarks/RESULTS.md (`--results`/`--no-results`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)
from vitp.config import Run


def first_batch(ds, batch: int, skip_rows: int = 0) -> tuple[float, list[str]]:
    """Seconds until the first `batch` rows after `skip_rows` rows, and their keys."""
    ds.context.execution_options.preserve_order = True
    t0 = time.perf_counter()
    keys: list[str] = []
    for b in ds.iter_batches(batch_size=256, batch_format="numpy"):
        ks = list(b["key"])
        take = ks[skip_rows:] if skip_rows else ks
        skip_rows = max(0, skip_rows - len(ks))
        keys += take
        if len(keys) >= batch:
            return time.perf_counter() - t0, keys[:batch]
    raise RuntimeError("the stream ended before the first batch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images-per-class", type=int, default=400)
    ap.add_argument("--cpus", type=int, default=os.cpu_count())
    ap.add_argument("--at", type=float, default=0.9, help="resume position as a fraction of the epoch")
    ap.add_argument("--world", type=int, default=2, help="Train workers (rank 0 is timed)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", help="keep the shards here (default: a temporary directory)")
    add_results_args(ap)
    args = ap.parse_args()

    import ray

    from vitp.data.commands import run_preprocess
    from vitp.data.ingest import build_train_dataset, train_rows_per_epoch
    from vitp.recipes import resolve

    work = args.workdir or tempfile.mkdtemp(prefix="resume-bench-")
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    cfg = resolve("debug", [f"work_dir={work}", f"data.synth_images_per_class={args.images_per_class}",
                            "parallel.num_workers=1", f"parallel.micro_batch={args.batch}",
                            f"parallel.global_batch={args.batch}"])
    if not os.path.exists(os.path.join(work, "shards", cfg.data.source, "manifest.json")):
        run_preprocess(Run.of(cfg), log=lambda s: None)
    rows = train_rows_per_epoch(Run.of(cfg))
    offset = int(rows * args.at) // args.world  # rows each rank consumed

    def stream(rank: int, consumed: int = 0):
        return build_train_dataset(Run.of(cfg), num_epochs=1, rank=rank, world=args.world, consumed=consumed)

    times: dict[str, list[float]] = {"fresh": [], "resumed": [], "replay": []}
    first_batch(stream(0), args.batch)  # untimed: Ray Data's start-up
    for rank in range(1, args.world):  # untimed: every rank continues exactly
        if first_batch(stream(rank, offset), args.batch)[1] != first_batch(stream(rank), args.batch, offset)[1]:
            raise AssertionError(f"rank {rank}: the resumed stream does not continue where the replayed one does")
    for _ in range(args.rounds):
        times["fresh"].append(first_batch(stream(0), args.batch)[0])
        t_res, k_res = first_batch(stream(0, offset), args.batch)
        t_rep, k_rep = first_batch(stream(0), args.batch, skip_rows=offset)
        if k_res != k_rep:
            raise AssertionError("the resumed stream does not continue where the replayed one does")
        times["resumed"].append(t_res)
        times["replay"].append(t_rep)
    ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    table = "\n".join(
        [f"Epoch of {rows} train rows (40 px uint8 shards) over {args.world} ranks, rank 0's first "
         f"batch of {args.batch} at {args.at:.0%} of the epoch ({offset} rows consumed per rank), "
         f"{args.cpus} Ray CPUs, median of {args.rounds}.", "",
         "| start | seconds to first batch | x fresh |", "|---|---|---|"] +
        [f"| {k} | {v:.2f} | {v / med['fresh']:.2f} |" for k, v in med.items()])
    print(table)
    append_result(args.results, "Resume at a data position (`benchmarks/resume_position.py`)", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
