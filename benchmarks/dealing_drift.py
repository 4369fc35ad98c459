"""How far apart the ranks' epochs get under each dealing order (vitp/data/position.py, docs/data.md).

Run (from the repository root; a few seconds, no Ray):

  .venv/bin/python benchmarks/dealing_drift.py

Every rank reads as many rows a step; an epoch's units differ in rows (a shard's last unit is short),
so a rank's epochs drift from another's. For read-unit layouts of the chaos soak's kind (584 rows cut
into units of 40 at shard ends that fall at random), on 2 and 3 workers, it prints the most epochs
any two ranks were apart at a step over 40 epochs, under dealing 1 (from the r-th unit) and 2 (from
the (r + epoch) mod W-th).
"""
from __future__ import annotations

import numpy as np

from vitp.data.position import RankStream, Segment


def epochs_apart(sizes: np.ndarray, world: int, dealing: int, epochs: int = 40, batch: int = 8) -> int:
    """The most epochs two ranks were apart at any step of `epochs` epochs from step 0."""
    seg = Segment(world, 0, 0, dealing=dealing)
    streams = [RankStream(sizes, 1, seg, r) for r in range(world)]
    most = 0
    for consumed in range(0, int(sizes.sum()) * epochs // world, batch):
        now = [s.slot(s.position(consumed)[0])[1] for s in streams]
        most = max(most, max(now) - min(now))
    return most


def layouts(count: int, rows: int = 584, unit: int = 40, seed: int = 0) -> list[np.ndarray]:
    """Read-unit sizes of `rows` rows in 2-5 shards whose ends fall at random, cut into `unit` rows."""
    rng, out = np.random.default_rng(seed), []
    for _ in range(count):
        ends = np.sort(rng.choice(np.arange(1, rows), int(rng.integers(1, 5)), replace=False))
        sizes = [u for n in np.diff(np.concatenate([[0], ends, [rows]]))
                 for u in [unit] * (n // unit) + ([n % unit] if n % unit else [])]
        out.append(np.array(sizes, dtype=np.int64))
    return [np.array([unit] * (rows // unit) + [rows % unit], dtype=np.int64)] + out


def main() -> None:
    print("units  sizes (smallest)  workers  epochs apart: dealing 1  dealing 2")
    for sizes in layouts(6):
        for world in (2, 3):
            print(f"{len(sizes):5d}  {str(sorted(sizes.tolist())[:3]):17s}  {world:7d}  "
                  f"{epochs_apart(sizes, world, 1):21d}  {epochs_apart(sizes, world, 2):9d}")


if __name__ == "__main__":
    main()
