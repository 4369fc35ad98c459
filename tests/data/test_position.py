"""Data position across worker counts: what every rank reads, and what is left, partition the
epochs exactly (no row twice, none skipped), however often the worker count changes."""
import random
from collections import Counter

import numpy as np
import pytest

from vitp.data.position import DEALING, RankStream, Segment, current_segment, next_segment, with_world


def taken(stream: RankStream, rows: int):
    """The (epoch, unit, row) a stream yields in its first `rows` rows."""
    out, s = [], 0
    while len(out) < rows:
        u, e, skip = stream.slot(s)
        out += [(e, u, i) for i in range(skip, int(stream.rows[u]))]
        s += 1
    return out[:rows]


def run(sizes, seed, worlds, final_seen, dealing=DEALING):
    """Rows each segment's ranks took for a history ending at `final_seen` samples, and the
    segment in force at the end."""
    rows, seg = [], Segment(worlds[0][0], worlds[0][1], dealing=dealing)
    bounds = [start for _, start in worlds[1:]] + [final_seen]
    for i, end in enumerate(bounds):
        per_rank = (end - seg.start) // seg.world
        rows += [r for k in range(seg.world) for r in taken(RankStream(sizes, seed, seg, k), per_rank)]
        if i + 1 < len(worlds):
            seg = next_segment(sizes, seed, seg, *worlds[i + 1])
    return rows, seg, (final_seen - seg.start) // seg.world


@pytest.mark.parametrize("dealing", [1, 2])
@pytest.mark.parametrize("case", range(12))
def test_taken_and_left_partition_every_epoch(case, dealing):
    rnd = random.Random(case)
    sizes = np.array([rnd.choice([8, 8, 8, 5]) for _ in range(rnd.randint(6, 15))], dtype=np.int64)
    per_epoch = int(sizes.sum())
    worlds, seen, world = [], 0, rnd.randint(1, 3)
    for _ in range(rnd.randint(1, 5)):
        worlds.append([world, seen])
        step = world * rnd.randint(1, 4)
        seen += step * rnd.randint(1, (2 * per_epoch) // step + 1)
        world = rnd.choice([w for w in (1, 2, 3, 4) if w != world and w <= len(sizes)])
    rows, seg, consumed = run(sizes, case, worlds, seen, dealing)
    assert len(rows) == len(set(rows)) == seen  # nothing read twice
    streams = [RankStream(sizes, case, seg, r) for r in range(seg.world)]
    upto = max(s.last_epoch(consumed) for s in streams)
    left = [(e, u, i) for s in streams for u, e, skip in s.leftover(consumed, upto)
            for i in range(skip, int(sizes[u]))]
    everything = Counter(rows) + Counter(left)
    assert max(everything.values()) == 1
    epochs = {e for e, _, _ in everything}
    assert epochs == set(range(max(epochs) + 1))
    for e in epochs:  # every epoch that was begun is taken or left in full, each row once
        assert sum(1 for k in everything if k[0] == e) == per_epoch, e


def test_one_world_resumes_like_an_uninterrupted_stream():
    sizes = np.array([8] * 10, dtype=np.int64)
    seg = current_segment(sizes, 3, with_world(None, 2, 50))
    assert seg == Segment(2, 0, 0) and with_world([[2, 0]], 2, 50) == [[2, 0]]
    assert with_world([[2, 0]], 1, 48) == [[2, 0], [1, 48]]
    one = RankStream(sizes, 3, seg, 1)
    s, extra = one.position(25)
    u, e, skip = one.slot(s)
    assert taken(one, 26)[-1] == (e, u, skip + extra)  # row 26 (index 25) is where it resumes


def _epochs_apart(sizes, seed, worlds, dealing, epochs):
    """The most epochs between the ranks' newest epochs, looked at every few steps of a run that goes
    on for `epochs` epochs after the history `worlds`."""
    final = worlds[-1][1] + epochs * int(sizes.sum())
    seg = current_segment(sizes, seed, worlds, dealing)
    streams = [RankStream(sizes, seed, seg, r) for r in range(seg.world)]
    apart = 0
    for consumed in range(0, (final - seg.start) // seg.world, 97):
        newest = [st.last_epoch(consumed) for st in streams]
        apart = max(apart, max(newest) - min(newest))
    return apart


@pytest.mark.parametrize("worlds", [[[2, 0]], [[3, 0]], [[2, 0], [3, 1500]], [[3, 0], [2, 901], [4, 2000]]])
def test_dealt_in_turn_ranks_of_equal_units_stay_within_an_epoch_of_each_other(worlds):
    """15 units that no worker count here divides, all of one size but the last (one shard of 584
    rows in units of 40): each rank reads the same rows a step, and dealt in turn (DEALING 2) no rank
    falls behind the others by more than an epoch over 40 epochs, resized or not. Dealt from a fixed
    start (1), the ranks holding the extra unit fell behind by it every epoch. (Units of many sizes
    part the ranks further: benchmarks/dealing_drift.py.)"""
    sizes = np.array([40] * 14 + [24], dtype=np.int64)
    assert _epochs_apart(sizes, 1, worlds, DEALING, 40) <= 1
    if worlds == [[2, 0]]:
        assert _epochs_apart(sizes, 1, worlds, 1, 40) >= 4  # what the soak found
