"""A rank's training stream and where it stands, across restarts at any number of workers.

A run's data history is the list of worker counts it ran with ([world, samples_seen at the
start], ...); from it every rank of the current world gets the rest of each epoch exactly once.
Pure numpy, no I/O (units: ingest.plan_units); the order is docs/data.md's, which the soak re-implements.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Piece = tuple[int, int, int]  # (unit index, epoch, rows of it already consumed)

# How an epoch's units are dealt to the ranks, recorded in each checkpoint (TrainState.dealing) so a
# run keeps the order it started with. 1: rank r takes every world-th unit from the r-th, so where the
# units do not divide evenly the first ranks read one more unit every epoch and fall behind the
# others by one unit an epoch, without bound (2 workers, 15 units: 5 epochs apart after 35). 2: from
# the ((r + epoch) mod world)-th, so over any `world` epochs every rank reads the same number of
# units; what still parts their epochs is the units' sizes (benchmarks/dealing_drift.py).
DEALING = 2


def epoch_order(num_units: int, seed: int, epoch: int) -> np.ndarray:
    """Unit order of one epoch: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, 11]).permutation(num_units)


def first_unit(rank: int, world: int, epoch: int, dealing: int = DEALING) -> int:
    """Where in the epoch's order rank `rank` of `world` starts taking every world-th unit."""
    return (rank + epoch) % world if dealing >= 2 else rank


def rank_order(num_units: int, seed: int, epoch: int, rank: int = 0, world: int = 1,
               shuffle: bool = True, dealing: int = DEALING) -> np.ndarray:
    """The units rank `rank` of `world` reads in `epoch`, in order: every world-th unit of the
    epoch's order, so the ranks' streams are disjoint and together cover the epoch."""
    order = epoch_order(num_units, seed, epoch) if shuffle else np.arange(num_units)
    return order[first_unit(rank, world, epoch, dealing)::world]


def units_per_rank(num_units: int, rank: int, world: int, epoch: int = 0, dealing: int = DEALING) -> int:
    return len(range(first_unit(rank, world, epoch, dealing), num_units, world))


@dataclass
class Segment:
    """The stretch of a run trained with one worker count: its ranks first share `pieces`
    (what earlier worker counts left of their epochs, dealt round-robin), then deal whole
    epochs from `first_epoch` on, every world-th unit each."""

    world: int
    start: int = 0  # global samples_seen when it began
    first_epoch: int = 0
    pieces: list[Piece] = field(default_factory=list)
    dealing: int = DEALING


class RankStream:
    """Rank `rank`'s stream of a segment as numbered slots: slot s is one unit (or the rest of
    one) of one epoch. `unit_rows[u]` is the number of rows of unit u."""

    def __init__(self, unit_rows: np.ndarray, seed: int, seg: Segment, rank: int, shuffle: bool = True):
        self.rows, self.seed, self.seg, self.rank, self.shuffle = unit_rows, seed, seg, rank, shuffle
        self.prefix = seg.pieces[rank::seg.world]
        self.rotates = seg.dealing >= 2 and seg.world > 1
        self._order: tuple[int, np.ndarray] | None = None

    def _count(self, epoch: int) -> int:
        """Slots of its own share of `epoch`."""
        return units_per_rank(len(self.rows), self.rank, self.seg.world, epoch, self.seg.dealing)

    def _epoch_units(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, rank_order(len(self.rows), self.seed, epoch, self.rank,
                                             self.seg.world, self.shuffle, self.seg.dealing))
        return self._order[1]

    def epoch_start(self, epoch: int) -> int:
        """The slot its share of `epoch` (>= first_epoch) begins at. Dealt in turn, every `world`
        epochs hold every unit once: the count repeats with that period."""
        k, first = epoch - self.seg.first_epoch, self.seg.first_epoch
        if not self.rotates:
            return len(self.prefix) + k * self._count(first)
        cycles, rest = divmod(k, self.seg.world)
        base = first + cycles * self.seg.world
        return len(self.prefix) + cycles * len(self.rows) + sum(self._count(base + i) for i in range(rest))

    def slot(self, s: int) -> Piece:
        """(unit, epoch, rows of it to skip) of slot s."""
        if s < len(self.prefix):
            return self.prefix[s]
        i, epoch = s - len(self.prefix), self.seg.first_epoch
        if self.rotates:
            cycles, i = divmod(i, len(self.rows))
            epoch += cycles * self.seg.world
            while i >= self._count(epoch):
                i, epoch = i - self._count(epoch), epoch + 1
        else:
            e, i = divmod(i, self._count(epoch))
            epoch += e
        return int(self._epoch_units(epoch)[i]), epoch, 0

    def position(self, consumed: int) -> tuple[int, int]:
        """(slot, rows of it already taken beyond its own skip) after `consumed` rows."""
        if self.prefix:
            sizes = np.array([self.rows[u] - skip for u, _, skip in self.prefix], dtype=np.int64)
            ends = np.cumsum(sizes)
            if consumed < ends[-1]:
                j = int(np.searchsorted(ends, consumed, side="right"))
                return j, consumed - (int(ends[j - 1]) if j else 0)
            consumed -= int(ends[-1])
        epoch = self.seg.first_epoch
        while True:
            ends = np.cumsum(self.rows[self._epoch_units(epoch)])
            if (not len(ends) and not self.rotates) or (len(ends) and consumed < ends[-1]):
                # (a rank that never has a unit of its own stays where its pieces end)
                j = int(np.searchsorted(ends, consumed, side="right")) if len(ends) else 0
                return self.epoch_start(epoch) + j, consumed - (int(ends[j - 1]) if j else 0)
            consumed -= int(ends[-1]) if len(ends) else 0
            epoch += 1

    def last_epoch(self, consumed: int) -> int:
        """The newest epoch it has taken rows of from its own share (first_epoch - 1 if none)."""
        if consumed <= 0:
            return self.seg.first_epoch - 1
        s, _ = self.position(consumed - 1)
        return self.seg.first_epoch - 1 if s < len(self.prefix) else self.slot(s)[1]

    def leftover(self, consumed: int, upto_epoch: int) -> list[Piece]:
        """What it has not taken of its pieces and of its shares of epochs up to `upto_epoch`."""
        s, extra = self.position(consumed)
        end = self.epoch_start(upto_epoch + 1) if upto_epoch >= self.seg.first_epoch else len(self.prefix)
        out = []
        for k in range(s, end):
            u, e, skip = self.slot(k)
            out.append((u, e, skip + (extra if k == s else 0)))
        return out


def next_segment(unit_rows: np.ndarray, seed: int, seg: Segment, world: int, start: int) -> Segment:
    """The segment that takes over from `seg` when the run goes on with `world` workers after
    `start` samples: the old ranks' leftovers are shared out first, then whole epochs follow."""
    consumed = (start - seg.start) // seg.world
    streams = [RankStream(unit_rows, seed, seg, r) for r in range(seg.world)]
    upto = max(s.last_epoch(consumed) for s in streams)
    rests = [s.leftover(consumed, upto) for s in streams]
    pieces = [rest[i] for i in range(max(map(len, rests), default=0)) for rest in rests if i < len(rest)]
    return Segment(world, start, upto + 1, pieces, seg.dealing)


def current_segment(unit_rows: np.ndarray, seed: int, worlds: list[list[int]], dealing: int = DEALING) -> Segment:
    """The segment of the last entry of a run's history [[world, samples_seen at start], ...],
    dealt as the run's checkpoints say (TrainState.dealing)."""
    seg = Segment(int(worlds[0][0]), int(worlds[0][1]), dealing=dealing)
    for world, start in worlds[1:]:
        seg = next_segment(unit_rows, seed, seg, int(world), int(start))
    return seg


def with_world(worlds: list[list[int]] | None, world: int, samples_seen: int) -> list[list[int]]:
    """The history once the run goes on with `world` workers at `samples_seen` (a new entry
    only when the count changes; an empty history is a run that always had `world`)."""
    worlds = [list(w) for w in (worlds or [[world, 0]])]
    if worlds[-1][0] != world:
        worlds.append([world, samples_seen])
    return worlds
