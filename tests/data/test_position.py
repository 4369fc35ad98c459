"""Data position across worker counts: what every rank reads, and what is left, partition the
epochs exactly (no row twice, none skipped), however often the worker count changes."""
import random
from collections import Counter

import numpy as np
import pytest

from vitp.data.position import RankStream, Segment, current_segment, next_segment, with_world


def taken(stream: RankStream, rows: int):
    """The (epoch, unit, row) a stream yields in its first `rows` rows."""
    out, s = [], 0
    while len(out) < rows:
        u, e, skip = stream.slot(s)
        out += [(e, u, i) for i in range(skip, int(stream.rows[u]))]
        s += 1
    return out[:rows]


def run(sizes, seed, worlds, final_seen):
    """Rows each segment's ranks took for a history ending at `final_seen` samples, and the
    segment in force at the end."""
    rows, seg = [], Segment(worlds[0][0], worlds[0][1])
    bounds = [start for _, start in worlds[1:]] + [final_seen]
    for i, end in enumerate(bounds):
        per_rank = (end - seg.start) // seg.world
        rows += [r for k in range(seg.world) for r in taken(RankStream(sizes, seed, seg, k), per_rank)]
        if i + 1 < len(worlds):
            seg = next_segment(sizes, seed, seg, *worlds[i + 1])
    return rows, seg, (final_seen - seg.start) // seg.world


@pytest.mark.parametrize("case", range(12))
def test_taken_and_left_partition_every_epoch(case):
    rnd = random.Random(case)
    sizes = np.array([rnd.choice([8, 8, 8, 5]) for _ in range(rnd.randint(6, 15))], dtype=np.int64)
    per_epoch = int(sizes.sum())
    worlds, seen, world = [], 0, rnd.randint(1, 3)
    for _ in range(rnd.randint(1, 5)):
        worlds.append([world, seen])
        step = world * rnd.randint(1, 4)
        seen += step * rnd.randint(1, (2 * per_epoch) // step + 1)
        world = rnd.choice([w for w in (1, 2, 3, 4) if w != world and w <= len(sizes)])
    rows, seg, consumed = run(sizes, case, worlds, seen)
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
