"""Data throughput on this machine's cores, in one run over the same JPEG corpus:

  (a) preprocess: JPEG corpus -> uint8 Parquet shards (Ray Data, `vitp preprocess` code path)
  (b) ingest: shards -> random-resized crop + flip on Ray Data workers -> normalised batches
      (uint8 shards, and JPEG-q95 shards for comparison)
  (c) baseline: torch DataLoader, Pillow decode of the JPEGs + the same augmentation function

Run:  .venv/bin/python benchmarks/data_throughput.py --images 2000 --cpus 2 --rounds 3
Every path gets the same number of CPUs (Ray num_cpus = DataLoader workers = --cpus).
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


def dataloader_pass(dl):
    from pipeline.data.ingest import normalize

    t0, n = time.time(), 0
    for x, y in dl:
        x = normalize(x, (0.5,) * 3, (0.5,) * 3)
        n += len(y)
    return n / (time.time() - t0)


def ingest_pass(cfg, batch, epoch):
    from pipeline.data.ingest import build_train_dataset, iter_device_batches

    ds = build_train_dataset(cfg, start_epoch=epoch, num_epochs=1)
    t0, n = time.time(), 0
    for x, y in iter_device_batches(ds, batch, "cpu"):
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
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()

    import ray
    from ray.data import DataContext

    from pipeline.data.commands import run_preprocess
    from pipeline.recipes import debug

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
    base = debug()
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
        ingest_pass(cfg, args.batch, 0)  # warm-up

    import torch

    dl = torch.utils.data.DataLoader(JpegFolder(files, labels, args.size, 0.08), batch_size=args.batch,
                                     shuffle=True, num_workers=args.cpus, persistent_workers=True,
                                     drop_last=True, prefetch_factor=4)
    dataloader_pass(dl)  # warm-up: worker processes
    # Interleave the passes: on a shared machine the load drifts, and alternating rounds keeps
    # that drift out of the ratios. Each path reports the median of its rounds.
    names = ["(b) ingest from uint8 shards", "(b) ingest from jpeg shards",
             "(c) DataLoader, Pillow decode + same aug"]
    for r in range(args.rounds):
        results.setdefault(names[0], []).append(ingest_pass(cfgs["uint8"], args.batch, r + 1))
        results.setdefault(names[1], []).append(ingest_pass(cfgs["jpeg"], args.batch, r + 1))
        results.setdefault(names[2], []).append(dataloader_pass(dl))
        print(f"round {r}: " + ", ".join(f"{n.split(' ', 1)[1]} {results[n][-1]:.0f}/s" for n in names),
              flush=True)
    ray.shutdown()

    ref = float(np.median(results[names[2]]))
    size_mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"\n{args.images} JPEGs ({size_mb:.0f} MB), storage {args.storage}px, train crop "
          f"{args.size}px, batch {args.batch}, {args.cpus} CPUs, {args.rounds} interleaved rounds, "
          f"load average at end {os.getloadavg()[0]:.1f}\n")
    print("| path | images/s (median) | images/s per core | vs DataLoader | rounds |")
    print("|---|---:|---:|---:|---|")
    for name, rates in results.items():
        med = float(np.median(rates))
        print(f"| {name} | {med:.0f} | {med / args.cpus:.0f} | {med / ref:.2f}x | "
              f"{' '.join(f'{x:.0f}' for x in rates)} |")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
