"""A rank's training stream and where it stands, across restarts at any number of workers.

A run's data history is the list of worker counts it ran with ([world, samples_seen at the
start], ...); from it every rank of the current world gets the rest of each epoch exactly once.
Pure numpy, no I/O: the read units come from ingest.plan_units.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Piece = tuple[int, int, int]  # (unit index, epoch, rows of it already consumed)


def epoch_order(num_units: int, seed: int, epoch: int) -> np.ndarray:
    """Unit order of one epoch: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, 11]).permutation(num_units)


def rank_order(num_units: int, seed: int, epoch: int, rank: int = 0, world: int = 1,
               shuffle: bool = True) -> np.ndarray:
    """The units rank `rank` of `world` reads in `epoch`, in order: every world-th unit of the
    epoch's order, so the ranks' streams are disjoint and together cover the epoch."""
    order = epoch_order(num_units, seed, epoch) if shuffle else np.arange(num_units)
    return order[rank::world]


def units_per_rank(num_units: int, rank: int, world: int) -> int:
    return len(range(rank, num_units, world))


@dataclass
class Segment:
    """The stretch of a run trained with one worker count: its ranks first share `pieces`
    (what earlier worker counts left of their epochs, dealt round-robin), then deal whole
    epochs from `first_epoch` on, every world-th unit each."""

    world: int
    start: int = 0  # global samples_seen when it began
    first_epoch: int = 0
    pieces: list[Piece] = field(default_factory=list)


class RankStream:
    """Rank `rank`'s stream of a segment as numbered slots: slot s is one unit (or the rest of
    one) of one epoch. `unit_rows[u]` is the number of rows of unit u."""

    def __init__(self, unit_rows: np.ndarray, seed: int, seg: Segment, rank: int, shuffle: bool = True):
        self.rows, self.seed, self.seg, self.rank, self.shuffle = unit_rows, seed, seg, rank, shuffle
        self.prefix = seg.pieces[rank::seg.world]
        self.n = units_per_rank(len(unit_rows), rank, seg.world)  # slots per whole epoch
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_units(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, rank_order(len(self.rows), self.seed, epoch, self.rank,
                                             self.seg.world, self.shuffle))
        return self._order[1]

    def slot(self, s: int) -> Piece:
        """(unit, epoch, rows of it to skip) of slot s."""
        if s < len(self.prefix):
            return self.prefix[s]
        e, i = divmod(s - len(self.prefix), self.n)
        epoch = self.seg.first_epoch + e
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
            if not len(ends) or consumed < ends[-1]:
                j = int(np.searchsorted(ends, consumed, side="right")) if len(ends) else 0
                base = len(self.prefix) + (epoch - self.seg.first_epoch) * self.n
                return base + j, consumed - (int(ends[j - 1]) if j else 0)
            consumed -= int(ends[-1])
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
        end = len(self.prefix) + max(0, upto_epoch - self.seg.first_epoch + 1) * self.n
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
    return Segment(world, start, upto + 1, pieces)


def current_segment(unit_rows: np.ndarray, seed: int, worlds: list[list[int]]) -> Segment:
    """The segment of the last entry of a run's history [[world, samples_seen at start], ...]."""
    seg = Segment(int(worlds[0][0]), int(worlds[0][1]))
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
