"""Data throughput, and CPU time per image, on this machine's cores, over one JPEG corpus:

  (a) preprocess: JPEG corpus -> 256 px uint8 Parquet shards (and JPEG-q95 shards), the
      `vitp preprocess` code path (`run_preprocess`). A one-off cost: C_pre CPU-seconds.
  (b) ingest: shards -> inception crop + flip on Ray Data workers -> uint8 batches, what
      training runs (`build_train_dataset` + `iter_device_batches`).
  (c) the equal-work baseline: a plain torch DataLoader (map-style Dataset, shuffle, persistent
      workers) that reads the same uint8 shards with pyarrow and runs the same `augment_image`
      at the same batch size. (b) and (c) do the same work on the same CPU budget.
  (d) the JPEG baseline: a DataLoader that decodes the source JPEGs with Pillow every epoch,
      then the same augmentation. It also does the decode + resize that (a) did once, so it is
      compared with (b) plus C_pre spread over 10 and over 90 epochs.

Run:  .venv/bin/python benchmarks/data_throughput.py --images 2000 --cpus 2 --rounds 3
The tables are printed and appended, with this command line, the date and the machine, to
benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).

CPU budget: Ray num_cpus = DataLoader num_workers = --cpus, plus the consuming process (the
training loop's stand-in, torch on one thread) in both. Each pass reads --epochs epochs as
training does: one Ray Data stream, or one DataLoader with persistent workers, over all of them
(the default of 8 amortises the ~2 s at the start of a Ray Data execution, as training does).
CPU-seconds: user + system time of every process taking part, by psutil at the start and at the
end of each pass (before anything shuts down): the consuming process and the DataLoader's
workers, or it and all Ray processes (GCS, raylet, workers: descendants of this process, as
ray.init starts a local cluster). Reaped children count in their parent, so a Ray worker that
exits mid-pass is counted through the raylet. Wall-clock images/s moves with whatever else runs
on the machine; images per CPU-second much less.
Two consumers: "uint8" takes the uint8 batches as delivered (a GPU step normalises them on the
device); "float" also normalises them to float32 in the consuming process, on the same CPUs.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import shutil
import tempfile
import time

import numpy as np
import psutil
import pyarrow.parquet as pq
import torch
from PIL import Image

from vitp.data.commands import run_preprocess
from vitp.data.decode import decode_image
from vitp.data.augment import augment_image, row_rng
from vitp.data.ingest import build_train_dataset, iter_device_batches, normalize
from vitp.recipes import get_recipe
from vitp.config import Run
from record import add_results_args, append_result  # benchmarks/record.py, beside this script

EPOCHS_CHARGED = (90, 10)  # epochs over which (a)'s one-off cost is spread, for (d)


def make_corpus(root: str, n: int, classes: int, seed: int = 0) -> None:
    """Photo-like JPEGs (q90): gradients, blocks and noise, 320-480 x 240-400 px."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = int(rng.integers(320, 481)), int(rng.integers(240, 401))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        img = np.stack([x / w * 255 * rng.uniform(.3, 1), y / h * 255 * rng.uniform(.3, 1),
                        np.full_like(x, rng.uniform(0, 255))], -1)
        for _ in range(6):
            y0, x0 = rng.integers(0, h - 40), rng.integers(0, w - 40)
            img[y0:y0 + rng.integers(20, 120), x0:x0 + rng.integers(20, 120)] = rng.uniform(0, 255, 3)
        img += rng.normal(0, 12, img.shape)
        d = os.path.join(root, f"c{i % classes:03d}")
        os.makedirs(d, exist_ok=True)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
            os.path.join(d, f"{i:06d}.jpg"), quality=90)


def corpus_in(work: str, images: int, classes: int) -> str:
    """<work>/corpus, made with make_corpus unless it is there (a rerun with the same --workdir)."""
    corpus = os.path.join(work, "corpus")
    if not os.path.isdir(corpus):
        print(f"making {images} JPEGs in {corpus} ...", flush=True)
        make_corpus(corpus, images, classes)
    return corpus


def kind(p: psutil.Process) -> str:
    """'consumer' (this process), 'ray workers' (tasks, actors: titled ray::*) or 'other'
    (DataLoader workers; Ray's GCS, raylet and agents)."""
    if p.pid == os.getpid():
        return "consumer"
    title = " ".join(p.cmdline())
    return "ray workers" if title.startswith("ray::") and not title.endswith("Agent") else "other"


def cpu_snapshot() -> dict:
    """{(pid, start time): (CPU-seconds, kind)} of this process and all its descendants: user +
    system, plus the time of the children each one has reaped."""
    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[(p.pid, p.create_time())] = (
                    t.user + t.system + t.children_user + t.children_system, kind(p))
        except psutil.Error:  # exited between listing and reading
            pass
    return out


def cpu_used(before: dict, after: dict, only=None, exclude=(), kinds=None) -> float:
    """CPU-seconds between two snapshots, over the pids in `only` (all when None) less `exclude`,
    and of `kinds` (all when None). Summing both whole snapshots keeps a process that exited and
    was reaped by one of ours right: its parent's children time now holds all of it."""
    def total(snap):
        return sum(v for (pid, _), (v, k) in snap.items() if (only is None or pid in only)
                   and pid not in exclude and (kinds is None or k in kinds))
    return total(after) - total(before)


@dataclasses.dataclass
class Pass:
    images: int
    wall: float
    cpu: float
    split: dict = dataclasses.field(default_factory=dict)  # CPU-seconds by process kind

    @property
    def rate(self):  # images/s, wall clock
        return self.images / self.wall

    @property
    def per_cpu(self):  # images per CPU-second; CPU time comes in 10 ms clock ticks
        return self.images / max(self.cpu, 0.01)


class WorkerRng:
    """One augmentation RNG per DataLoader worker, seeded by torch (a different seed per worker),
    and carried on from epoch to epoch by the persistent workers."""

    _rng = None

    def rng(self) -> np.random.Generator:
        self._rng = self._rng or np.random.default_rng(torch.initial_seed())
        return self._rng


class JpegFolder(WorkerRng):
    """(d): open, decode (Pillow), convert, augment: the baseline everyone writes."""

    def __init__(self, files, labels, size, scale_min):
        self.files, self.labels, self.size, self.scale_min = files, labels, size, scale_min

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            img = decode_image(f.read())
        out = augment_image(img, self.size, "inception_crop", self.rng(), self.scale_min, True)
        return torch.from_numpy(out), self.labels[i]


class ShardRows(WorkerRng):
    """(c): rows of the uint8 shards by index. Each worker reads every shard file of the split
    once (pyarrow, memory-mapped) on its first item and keeps the tables; an item is then a
    zero-copy (H, W, 3) view of its image cell, augmented like (b) does it."""

    def __init__(self, root, size, scale_min):
        with open(os.path.join(root, "manifest.json")) as f:
            shards = json.load(f)["shards"]["train"]
        self.files = [os.path.join(root, s["file"]) for s in shards]
        self.starts = np.cumsum([0] + [s["rows"] for s in shards]).tolist()
        self.size, self.scale_min, self.tables = size, scale_min, None

    def __len__(self):
        return self.starts[-1]

    def __getitem__(self, i):
        if self.tables is None:  # first item in this worker: read each shard once
            self.tables = []
            for path in self.files:
                t = pq.read_table(path, columns=["image", "height", "width", "label"], memory_map=True)
                self.tables.append((t.column("image"), t.column("height").to_numpy(),
                                    t.column("width").to_numpy(), t.column("label").to_numpy()))
        s = bisect.bisect_right(self.starts, i) - 1
        images, heights, widths, labels = self.tables[s]
        j = i - self.starts[s]
        img = np.frombuffer(images[j].as_buffer(), np.uint8).reshape(heights[j], widths[j], 3)
        out = augment_image(img, self.size, "inception_crop", self.rng(), self.scale_min, True)
        return torch.from_numpy(out), int(labels[j])


def extra_work_ms(root: str) -> tuple[float, float]:
    """CPU ms per image of what (b) does each epoch and (c) does not, timed in this process:
    reading the rows from the shards (pyarrow; (c) keeps them after its first epoch), and an
    RNG per row from (seed, epoch, key) (`row_rng`; (c) has one RNG per worker)."""
    t, keys = time.process_time(), []
    for path in ShardRows(root, 0, 0).files:
        keys += pq.read_table(path, memory_map=True).column("key").to_pylist()
    read, t = time.process_time() - t, time.process_time()
    for k in keys:
        row_rng(0, 1, k)
    return 1000 * read / len(keys), 1000 * (time.process_time() - t) / len(keys)


def dataloader_pass(dl, workers, epochs, normalise) -> Pass:
    me = os.getpid()
    c0, t0, n = cpu_snapshot(), time.time(), 0
    for _ in range(epochs):  # persistent workers: one DataLoader for all epochs, as in training
        for x, y in dl:
            if normalise:
                x = normalize(x, (0.5,) * 3, (0.5,) * 3)
            n += len(y)
    wall, c1 = time.time() - t0, cpu_snapshot()
    return Pass(n, wall, cpu_used(c0, c1, only={me, *workers}))


def make_dataloader(dataset, args):
    """A DataLoader over `dataset` and its worker pids, after a warm-up epoch that starts them."""
    before = {p.pid for p in psutil.Process().children()}
    dl = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True,
                                     num_workers=args.cpus, persistent_workers=True,
                                     drop_last=True, prefetch_factor=4)
    dataloader_pass(dl, (), 1, True)  # warm-up: worker processes, and (c)'s shard tables
    return dl, {p.pid for p in psutil.Process().children()} - before


def ingest_pass(cfg, batch, first_epoch, epochs, normalise, exclude) -> Pass:
    c0, t0, n = cpu_snapshot(), time.time(), 0
    # one stream over all epochs, as a training run reads it
    ds = build_train_dataset(Run.of(cfg), start_epoch=first_epoch, num_epochs=epochs)
    for x, y in iter_device_batches(ds, batch, "cpu", raw=not normalise):
        n += len(y)
    wall, c1 = time.time() - t0, cpu_snapshot()
    split = {k: cpu_used(c0, c1, exclude=exclude, kinds={k}) for k in ("consumer", "ray workers", "other")}
    return Pass(n, wall, cpu_used(c0, c1, exclude=exclude), split)


def preprocess_pass(cfg) -> Pass:
    c0, t0 = cpu_snapshot(), time.time()
    res = run_preprocess(Run.of(cfg), overwrite=True, log=lambda s: None)
    return Pass(res["written"], time.time() - t0, cpu_used(c0, cpu_snapshot()))


def med(ps, f) -> float:
    return float(np.median([f(p) for p in ps]))


def ms(ps) -> float:  # CPU ms per image, median over rounds
    return 1000 * med(ps, lambda p: 1 / p.per_cpu)


def report(args, pre: dict, runs: dict, names: tuple, extra: tuple) -> tuple[str, str]:
    """The tables (all paths; (d) against (b) with preprocessing charged) and the notes."""
    B, C, D = names
    lines = ["| path | batches | images/s (median) | images per CPU-s (median) | vs (c) per CPU-s | "
             "vs (c) wall | cores busy | rounds: images/s | rounds: images per CPU-s |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    p = pre["uint8"]  # (a) to JPEG shards: in the notes
    lines.append(f"| (a) preprocess JPEG -> uint8 shards | - | {p.rate:.0f} | {p.per_cpu:.0f} | - | - | "
                 f"{p.cpu / p.wall:.2f} | {p.rate:.0f} | {p.per_cpu:.0f} |")
    for (name, consumer), ps in runs.items():
        rate, per_cpu = med(ps, lambda p: p.rate), med(ps, lambda p: p.per_cpu)
        ref = runs[(C, consumer)]
        lines.append(f"| {name} | {consumer} | {rate:.0f} | {per_cpu:.0f} | "
                     f"{per_cpu / med(ref, lambda p: p.per_cpu):.2f}x | "
                     f"{rate / med(ref, lambda p: p.rate):.2f}x | "
                     f"{med(ps, lambda p: p.cpu / p.wall):.2f} | {' '.join(f'{p.rate:.0f}' for p in ps)} | "
                     f"{' '.join(f'{p.per_cpu:.0f}' for p in ps)} |")

    # (d) against (b) with (a)'s one-off cost spread over E epochs: CPU ms per image, uint8
    n_pre, c_pre = p.images, p.cpu
    ms_b, ms_c, ms_d = ms(runs[(B, "uint8")]), ms(runs[(C, "uint8")]), ms(runs[(D, "uint8")])
    charged = [("JPEG DataLoader (d): decode + augment every epoch", ms_d),
               ("ingest (b), preprocessing not charged", ms_b)] + [
        (f"ingest (b) + preprocess (a) spread over {e} epochs", ms_b + 1000 * c_pre / (n_pre * e))
        for e in EPOCHS_CHARGED]
    lines += ["", "| uint8 batches | CPU ms per image | vs JPEG DataLoader (d) |", "|---|---:|---:|"]
    lines += [f"| {name} | {v:.3f} | {ms_d / v:.2f}x |" for name, v in charged]

    # where (b)'s CPU goes, and (c) charged with the work it skips
    split = {k: 1000 * med(runs[(B, "uint8")], lambda p: p.split[k] / p.images)
             for k in ("consumer", "ray workers", "other")}
    read_ms, rng_ms = extra
    notes = (f"Preprocess (a) to uint8 shards: C_pre = {c_pre:.1f} CPU-s for {n_pre} images "
             f"({1000 * c_pre / n_pre:.2f} ms each); to JPEG-q95 shards {pre['jpeg'].rate:.0f} images/s, "
             f"{pre['jpeg'].per_cpu:.0f} per CPU-s. Where (b)'s CPU goes (uint8 batches, ms per image): "
             f"consuming process {split['consumer']:.3f}, Ray workers {split['ray workers']:.3f}, other "
             f"Ray processes {split['other']:.3f}; (c) in all {ms_c:.3f}. Work (b) does each epoch and "
             f"(c) does not, timed in one process: reading the rows from the shards {read_ms:.3f} ms per "
             f"image ((c) keeps each shard in each worker's memory after its first epoch), an RNG per row "
             f"from (seed, epoch, key) {rng_ms:.3f} ms ((c): one per worker). Charged both, (c) would cost "
             f"{ms_c + read_ms + rng_ms:.3f} ms per image, and (b) be at "
             f"{(ms_c + read_ms + rng_ms) / ms_b:.2f}x of it per CPU-s.")
    return "\n".join(lines), notes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("images", 2000), ("classes", 10), ("storage", 256), ("size", 224),
                          ("batch", 64), ("rounds", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--cpus", type=int, default=os.cpu_count(),
                    help="the CPU budget: Ray num_cpus and DataLoader num_workers")
    ap.add_argument("--epochs", type=int, default=8, help="epochs per pass (per round and path)")
    ap.add_argument("--consumer-threads", type=int, default=1,
                    help="torch threads of the consuming process (normalisation), all paths")
    ap.add_argument("--workdir", default="")
    add_results_args(ap)
    args = ap.parse_args()

    import ray
    from ray.data import DataContext

    work = args.workdir or tempfile.mkdtemp(prefix="vitp-bench-")
    corpus = corpus_in(work, args.images, args.classes)
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(corpus) for f in fs)
    labels = [int(os.path.basename(os.path.dirname(f))[1:]) for f in files]
    loads = [os.getloadavg()[0]]

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    DataContext.get_current().enable_progress_bars = False
    base = get_recipe("debug")
    data = dataclasses.replace(base.data, source="imagefolder", path=corpus,
                               storage_size=args.storage, image_size=args.size,
                               num_classes=args.classes, val_fraction=0.0, shard_mb=64,
                               crop_scale_min=0.08)
    pre, cfgs = {}, {}
    for fmt in ("uint8", "jpeg"):
        cfg = dataclasses.replace(base, work_dir=work, data=dataclasses.replace(
            data, storage_format=fmt, shards=os.path.join(work, f"shards-{fmt}")))
        preprocess_pass(cfg)  # warm-up: Ray worker start-up
        pre[fmt] = preprocess_pass(cfg)
        cfgs[fmt] = cfg
        ingest_pass(cfg, args.batch, 0, 1, True, ())  # warm-up

    # The consuming process runs torch on one thread in every path: the --cpus cores belong to
    # the data workers, and OpenMP threads spin-waiting on cores the workers use cost more than
    # they give.
    torch.set_num_threads(args.consumer_threads)
    dl_shards, w_shards = make_dataloader(ShardRows(cfgs["uint8"].data.shards, args.size, 0.08), args)
    dl_jpeg, w_jpeg = make_dataloader(JpegFolder(files, labels, args.size, 0.08), args)
    idle = w_shards | w_jpeg  # idle DataLoader workers are no part of an ingest pass
    B, C, D = ("(b) ingest from uint8 shards", "(c) DataLoader, same uint8 shards + same aug",
               "(d) DataLoader, Pillow JPEG decode + same aug")
    # The passes are interleaved: on a shared machine the load drifts, and alternating keeps
    # that drift out of the ratios; medians are reported.
    paths = [  # (name, consumer, run(first epoch))
        (B, "uint8", lambda e: ingest_pass(cfgs["uint8"], args.batch, e, args.epochs, False, idle)),
        (C, "uint8", lambda e: dataloader_pass(dl_shards, w_shards, args.epochs, False)),
        (D, "uint8", lambda e: dataloader_pass(dl_jpeg, w_jpeg, args.epochs, False)),
        (B.replace("uint8", "jpeg"), "uint8",
         lambda e: ingest_pass(cfgs["jpeg"], args.batch, e, args.epochs, False, idle)),
        (B, "float", lambda e: ingest_pass(cfgs["uint8"], args.batch, e, args.epochs, True, idle)),
        (C, "float", lambda e: dataloader_pass(dl_shards, w_shards, args.epochs, True)),
    ]
    runs = {(n, c): [] for n, c, _ in paths}
    for r in range(args.rounds):
        for name, consumer, run in paths:
            runs[(name, consumer)].append(run(1 + r * args.epochs))
            loads.append(os.getloadavg()[0])
        x = {k: runs[(B, c)][-1].per_cpu / runs[(k, c)][-1].per_cpu for k, c in ((C, "uint8"), (D, "uint8"))}
        print(f"round {r}: ingest per CPU-s, uint8 batches: {x[C]:.2f}x (c), {x[D]:.2f}x (d)", flush=True)
    ray.shutdown()

    loads.append(os.getloadavg()[0])
    table, notes = report(args, pre, runs, (B, C, D), extra_work_ms(cfgs["uint8"].data.shards))
    size_mb = sum(os.path.getsize(f) for f in files) / 1e6
    setup = (f"{args.images} JPEGs ({size_mb:.0f} MB), storage {args.storage}px, train crop {args.size}px, "
             f"batch {args.batch}, CPU budget {args.cpus} (Ray num_cpus = DataLoader num_workers; the "
             f"consuming process on top, torch on {args.consumer_threads} thread), {args.rounds} "
             f"interleaved rounds of {args.epochs} epochs per pass. 1-min load average "
             f"{min(loads):.1f}-{max(loads):.1f} over the run (wall-clock figures move with the load, "
             f"images per CPU-s far less). CPU-s: user + system of the consuming process and the "
             f"DataLoader workers, or of it and all Ray processes (its descendants), psutil at the start "
             f"and end of each pass; 'cores busy' = CPU-s / wall-s.")
    print(f"\n{setup}\n\n{notes}\n")
    print(table)
    append_result(args.results, "Data throughput (`benchmarks/data_throughput.py`)", table,
                  notes=setup + "\n\n" + notes)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
