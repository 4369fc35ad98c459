"""What a pre-training run must have trained on, epoch by epoch, worked out from the shards, the seed
and the run's worker-count history alone: a second implementation of the dealing order that
docs/data.md ("Which rows each worker trains on") specifies, written from that text and not from
vitp.data.position, so that the soak's sample check does not grade the code with itself.

It walks each rank's stream slot by slot and row by row where vitp.data.position does arithmetic
on cumulative sizes; tests/benchmarks/test_soak_checks.py holds the two against each other.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

Slot = tuple[int, int, int]  # (unit, epoch, rows of it skipped)


def read_units(shards: str, unit_rows: int, split: str = "train") -> list[list[str]]:
    """The split's read units as key lists: each shard the manifest lists, in its order, cut into runs
    of `unit_rows` rows (the last may be shorter). Read with pyarrow from the manifest's files."""
    import pyarrow.parquet as pq

    from vitp import storage

    manifest = storage.read_json(storage.join(shards, "manifest.json"))
    units = []
    for shard in manifest["shards"].get(split, []):
        with storage.open_input(storage.join(shards, shard["file"])) as f:
            keys = [str(k) for k in pq.read_table(f, columns=["key"]).column("key").to_pylist()]
        units += [keys[a:a + unit_rows] for a in range(0, len(keys), unit_rows)]
    return units


def _permutation(n: int, *words: int) -> np.ndarray:
    return np.random.default_rng([w & 0xFFFFFFFF for w in words]).permutation(n)


def unit_keys_in_order(keys: list[str], seed: int, epoch: int) -> list[str]:
    """A unit's rows as a stream yields them in `epoch`: shuffled by (seed, epoch, the first 32 bits
    of the SHA-1 of its first key, 7); a unit of one row as it is."""
    if len(keys) < 2:
        return list(keys)
    first = int(hashlib.sha1(keys[0].encode()).hexdigest()[:8], 16)
    return [keys[i] for i in _permutation(len(keys), seed, epoch, first, 7)]


@dataclass
class _Stretch:
    """A stretch of the run at one worker count: its ranks share `pieces` round-robin, then deal whole
    epochs from `first_epoch` on, dealt as `dealing` says (docs/data.md)."""
    world: int
    dealing: int
    first_epoch: int = 0
    pieces: list[Slot] = field(default_factory=list)


def _slots(units: list, seed: int, stretch: _Stretch, rank: int):
    """Rank `rank`'s slots in a stretch, in order, without end: (unit, epoch, skip, own share?)."""
    for unit, epoch, skip in stretch.pieces[rank::stretch.world]:
        yield unit, epoch, skip, False
    epoch, w = stretch.first_epoch, stretch.world
    # under dealing 1, a rank with no unit of its own has no epochs
    while units and (stretch.dealing >= 2 or rank < len(units)):
        first = (rank + epoch) % w if stretch.dealing >= 2 else rank  # where its every w-th unit starts
        for unit in _permutation(len(units), seed, epoch, 11)[first::w]:
            yield int(unit), epoch, 0, True
        epoch += 1


def _take(units: list, seed: int, stretch: _Stretch, rank: int, rows: int):
    """Rank `rank` takes `rows` rows of its stream: ({epoch: keys taken}, the newest epoch of its own
    share it took rows of (first_epoch - 1 if none), and its stream from where it stopped)."""
    taken: dict[int, list[str]] = {}
    newest, stream = stretch.first_epoch - 1, _slots(units, seed, stretch, rank)
    while rows > 0:
        unit, epoch, skip, own = next(stream)
        keys = unit_keys_in_order(units[unit], seed, epoch)[skip:]
        taken.setdefault(epoch, []).extend(keys[:rows])
        newest = epoch if own else newest
        if rows < len(keys):
            def rest(first=(unit, epoch, skip + rows, own), stream=stream):
                yield first
                yield from stream
            return taken, newest, rest()
        rows -= len(keys)
    return taken, newest, stream


def dealt(units: list, seed: int, worlds: list[list[int]], samples_seen: int, dealing: int) -> dict[int, list[str]]:
    """{epoch: keys} the run's workers took, over all ranks, by `samples_seen` samples, the run having
    gone on with worlds[i][0] workers from worlds[i][1] samples on (an empty history: one worker),
    its epochs dealt as `dealing` (its checkpoint's train_state) says."""
    worlds = worlds or [[1, 0]]
    taken: dict[int, list[str]] = {}
    stretch = _Stretch(int(worlds[0][0]), dealing)
    ends = [int(start) for _, start in worlds[1:]] + [int(samples_seen)]
    for i, end in enumerate(ends):
        start = int(worlds[i][1])
        took = [_take(units, seed, stretch, r, (end - start) // stretch.world) for r in range(stretch.world)]
        for got, _, _ in took:
            for epoch, keys in got.items():
                taken.setdefault(epoch, []).extend(keys)
        if i + 1 == len(ends):
            break
        upto = max(newest for _, newest, _ in took)
        rests = []
        for _, _, stream in took:  # what each rank left of its share of every epoch up to `upto`
            rest = []
            for unit, epoch, skip, own in stream:
                if own and epoch > upto:
                    break
                rest.append((unit, epoch, skip))
            rests.append(rest)
        pieces = [rest[j] for j in range(max(map(len, rests), default=0)) for rest in rests if j < len(rest)]
        stretch = _Stretch(int(worlds[i + 1][0]), dealing, upto + 1, pieces)
    return taken
