"""The ingest's crop + resize per output size: torch's uint8 kernel against Pillow's, per image.

Run (from the repository root):

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/crop_kernels.py

What a Ray Data reader does for each training image (vitp/data/ingest.py): a random inception crop
(whole-pixel box, scale 0.08-1) of an image stored at 256/224 of the output size, a flip for half
of them, resized into a preallocated (size, size, 3) uint8 array, in one thread (a reader task has
one CPU). Both kernels run on the same boxes: the torch path through `crop_resize`, the Pillow
path through `crop_resize` given the same box shifted by 1e-4 px (a fractional box takes Pillow);
the torch path at every size here, whatever size crop_resize would switch at.
Printed: the median over --rounds of the mean time per image, and which kernel `crop_resize` picks
at that size (vitp.data.decode.TORCH_CROP_MIN_SIZE). Also: what importing torch costs a process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from record import add_results_args, append_result  # benchmarks/record.py, beside this script
from vitp.data import decode
from vitp.data.decode import TORCH_CROP_MIN_SIZE, crop_resize, inception_crop_box

IMPORT_COST = ("import time; t = time.process_time(); import torch; "
               "rss = int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20; "
               "print(f'{time.process_time() - t:.2f} {rss:.0f}')")


def per_image_us(size: int, crops: int, rounds: int, seed: int) -> tuple[float, float]:
    """(torch, Pillow) median microseconds per image at output `size`."""
    rng = np.random.default_rng(seed)
    stored = round(size * 256 / 224)
    images = [rng.integers(0, 256, (stored, stored, 3), dtype=np.uint8) for _ in range(8)]
    boxes = [tuple(float(round(v)) for v in inception_crop_box(rng, stored, stored, 0.08))
             for _ in range(crops)]
    flips = rng.random(crops) < 0.5
    out = np.empty((size, size, 3), np.uint8)

    def one_pass(shift: float) -> float:
        t = time.perf_counter()
        for i, (box, flip) in enumerate(zip(boxes, flips)):
            crop_resize(images[i % 8], (box[0] + shift, *box[1:]), size, bool(flip), out=out)
        return (time.perf_counter() - t) / crops * 1e6

    decode.TORCH_CROP_MIN_SIZE = 0  # whole-pixel boxes: the torch kernel at every size
    try:
        one_pass(0.0), one_pass(1e-4)  # warm-up: torch's first call, Pillow's buffers
        times = [(one_pass(0.0), one_pass(1e-4)) for _ in range(rounds)]
    finally:
        decode.TORCH_CROP_MIN_SIZE = TORCH_CROP_MIN_SIZE
    return statistics.median(t for t, _ in times), statistics.median(p for _, p in times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 48, 64, 96, 128, 160, 224])
    ap.add_argument("--crops", type=int, default=2000, help="images per pass")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_results_args(ap)
    args = ap.parse_args()

    rows = ["| output px | torch kernel, us/image | Pillow, us/image | Pillow / torch | crop_resize uses |",
            "|---:|---:|---:|---:|---|"]
    for size in args.sizes:
        t, p = per_image_us(size, args.crops, args.rounds, args.seed)
        rows.append(f"| {size} | {t:.0f} | {p:.0f} | {p / t:.2f} | "
                    f"{'torch' if size >= TORCH_CROP_MIN_SIZE else 'Pillow'} |")
        print(rows[-1], flush=True)
    cpu, rss = subprocess.run([sys.executable, "-c", IMPORT_COST], capture_output=True, text=True,
                              check=True).stdout.split()
    table = "\n".join(rows + ["", f"Importing torch in a fresh process: {cpu} CPU-s, {rss} MB resident "
                                  "after it (what a reader process pays on its first torch crop)."])
    print(table)
    append_result(args.results, "Crop + resize kernels (`benchmarks/crop_kernels.py`)", table,
                  notes=f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


if __name__ == "__main__":
    main()
