"""Data throughput on this machine's cores, in one run over the same JPEG corpus:

  (a) preprocess: JPEG corpus -> uint8 Parquet shards (Ray Data, `vitp preprocess` code path)
  (b) ingest: shards -> random-resized crop + flip on Ray Data workers -> uint8 batches
      (uint8 shards, and JPEG-q95 shards for comparison)
  (c) baseline: torch DataLoader, Pillow decode of the JPEGs + the same augmentation function

Run:  .venv/bin/python benchmarks/data_throughput.py --images 2000 --cpus 2 --rounds 3
The table is printed and appended, with this command line, the date and the machine, to
benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).
Every path gets the same number of CPUs (Ray num_cpus = DataLoader workers = --cpus), and each
pass reads --epochs epochs the way training does: one Ray Data stream over all of them, one
DataLoader with persistent workers. The default of 8 epochs amortises the ~2 s at the start of
each Ray Data execution during which it runs one task at a time, as a training run does.
Two consumers, the same for both paths: "uint8" takes the uint8 batches as delivered (a GPU
step normalises them on the device); "float" also normalises them to float32 in the consuming
process, on the same CPUs.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time

import numpy as np
from PIL import Image

from record import add_results_args, append_result  # benchmarks/record.py, beside this script


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


class JpegFolder:
    """torch Dataset: the baseline everyone writes (open, decode, convert, augment)."""

    def __init__(self, files, labels, size, scale_min):
        self.files, self.labels, self.size, self.scale_min = files, labels, size, scale_min

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import torch

        from pipeline.data.decode import decode_image
        from pipeline.data.ingest import augment_image

        with open(self.files[i], "rb") as f:
            img = decode_image(f.read())
        rng = np.random.default_rng([0, 0, i])
        out = augment_image(img, self.size, "inception_crop", rng, self.scale_min, True)
        return torch.from_numpy(out), self.labels[i]


def dataloader_pass(dl, epochs, normalise):
    from pipeline.data.ingest import normalize

    t0, n = time.time(), 0
    for _ in range(epochs):  # persistent workers: one DataLoader for all epochs, as in training
        for x, y in dl:
            if normalise:
                x = normalize(x, (0.5,) * 3, (0.5,) * 3)
            n += len(y)
    return n / (time.time() - t0)


def ingest_pass(cfg, batch, first_epoch, epochs, normalise):
    from pipeline.data.ingest import build_train_dataset, iter_device_batches

    # one stream over all epochs, as a training run reads it
    ds = build_train_dataset(cfg, start_epoch=first_epoch, num_epochs=epochs)
    t0, n = time.time(), 0
    for x, y in iter_device_batches(ds, batch, "cpu", raw=not normalise):
        n += len(y)
    return n / (time.time() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--cpus", type=int, default=os.cpu_count())
    ap.add_argument("--storage", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=8, help="epochs per pass (per round and path)")
    ap.add_argument("--consumer-threads", type=int, default=1,
                    help="torch threads of the consuming process (normalisation), both paths")
    ap.add_argument("--workdir", default="")
    add_results_args(ap)
    args = ap.parse_args()

    import ray
    from ray.data import DataContext

    from pipeline.data.commands import run_preprocess
    from pipeline.recipes import get_recipe

    work = args.workdir or tempfile.mkdtemp(prefix="vitp-bench-")
    corpus = os.path.join(work, "corpus")
    if not os.path.isdir(corpus):
        print(f"making {args.images} JPEGs in {corpus} ...", flush=True)
        make_corpus(corpus, args.images, args.classes)
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(corpus) for f in fs)
    labels = [int(os.path.basename(os.path.dirname(f))[1:]) for f in files]

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    DataContext.get_current().enable_progress_bars = False
    base = get_recipe("debug")
    data = dataclasses.replace(base.data, source="imagefolder", path=corpus,
                               storage_size=args.storage, image_size=args.size,
                               num_classes=args.classes, val_fraction=0.0, shard_mb=64,
                               crop_scale_min=0.08)
    results, cfgs = {}, {}
    for fmt in ("uint8", "jpeg"):
        cfg = dataclasses.replace(base, work_dir=work, data=dataclasses.replace(
            data, storage_format=fmt, shards=os.path.join(work, f"shards-{fmt}")))
        run_preprocess(cfg, overwrite=True, log=lambda s: None)  # warm-up: worker start-up
        res = run_preprocess(cfg, overwrite=True, log=lambda s: None)
        results[f"(a) preprocess JPEG -> {fmt} shards"] = [res["images_per_sec"]]
        cfgs[fmt] = cfg
        ingest_pass(cfg, args.batch, 0, 1, True)  # warm-up

    import torch

    # The consuming process (the training loop's stand-in) runs torch on one thread in both
    # paths: the --cpus cores belong to the data workers, and OpenMP threads spin-waiting on
    # cores the workers are using cost more than they give.
    torch.set_num_threads(args.consumer_threads)
    dl = torch.utils.data.DataLoader(JpegFolder(files, labels, args.size, 0.08), batch_size=args.batch,
                                     shuffle=True, num_workers=args.cpus, persistent_workers=True,
                                     drop_last=True, prefetch_factor=4)
    dataloader_pass(dl, 1, True)  # warm-up: worker processes
    # Two consumers: "uint8" takes the (B, S, S, 3) uint8 batches as delivered (what a GPU
    # step receives; it normalises on the device), "float" also normalises them to float32 in
    # the consuming process, on the same CPUs. Each ingest path is compared with the
    # DataLoader under the same consumer. The passes are interleaved: on a shared machine the
    # load drifts, and alternating keeps that drift out of the ratios; medians are reported.
    paths = [  # (name, consumer, run)
        ("(b) ingest from uint8 shards", "uint8", lambda e: ingest_pass(cfgs["uint8"], args.batch, e, args.epochs, False)),
        ("(c) DataLoader, Pillow decode + same aug", "uint8", lambda e: dataloader_pass(dl, args.epochs, False)),
        ("(b) ingest from jpeg shards", "uint8", lambda e: ingest_pass(cfgs["jpeg"], args.batch, e, args.epochs, False)),
        ("(b) ingest from uint8 shards", "float", lambda e: ingest_pass(cfgs["uint8"], args.batch, e, args.epochs, True)),
        ("(c) DataLoader, Pillow decode + same aug", "float", lambda e: dataloader_pass(dl, args.epochs, True)),
    ]
    rates = {(n, c): [] for n, c, _ in paths}
    for r in range(args.rounds):
        for name, consumer, run in paths:
            rates[(name, consumer)].append(run(1 + r * args.epochs))
        ratio = {c: rates[("(b) ingest from uint8 shards", c)][-1] /
                 rates[("(c) DataLoader, Pillow decode + same aug", c)][-1] for c in ("uint8", "float")}
        print(f"round {r}: uint8 shards vs DataLoader {ratio['uint8']:.2f}x (uint8 batches), "
              f"{ratio['float']:.2f}x (float batches)", flush=True)
    ray.shutdown()

    size_mb = sum(os.path.getsize(f) for f in files) / 1e6
    setup = (f"{args.images} JPEGs ({size_mb:.0f} MB), storage {args.storage}px, train crop "
             f"{args.size}px, batch {args.batch}, {args.cpus} CPUs, {args.rounds} interleaved rounds of "
             f"{args.epochs} epochs")
    lines = ["| path | batches | images/s (median) | images/s per core | vs DataLoader | rounds |",
             "|---|---|---:|---:|---:|---|"]
    for name, rate in results.items():
        lines.append(f"| {name} | - | {rate[0]:.0f} | {rate[0] / args.cpus:.0f} | - | {rate[0]:.0f} |")
    for (name, consumer), rs in rates.items():
        med = float(np.median(rs))
        ref = float(np.median(rates[("(c) DataLoader, Pillow decode + same aug", consumer)]))
        lines.append(f"| {name} | {consumer} | {med:.0f} | {med / args.cpus:.0f} | {med / ref:.2f}x | "
                     f"{' '.join(f'{x:.0f}' for x in rs)} |")
    table = "\n".join(lines)
    print(f"\n{setup}, load average at end {os.getloadavg()[0]:.1f}\n")
    print(table)
    append_result(args.results, "Data throughput (`benchmarks/data_throughput.py`)", table, notes=setup + ".")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
