"""vitp/tracking/spoolfile.py, alone (no server): it appears only once locked, a line is in
it whole or not at all, its backlog is bounded, and a temp file left by a dead process goes."""
import errno
import json
import logging
import os
import time

import pytest

from vitp.tracking import spoolfile as spool_mod
from vitp.tracking.spoolfile import MetricSpool


def _lines(spool: MetricSpool) -> list[dict]:
    return [json.loads(line) for line in spool.path.read_bytes().splitlines()]


def test_the_spool_file_is_visible_only_once_it_is_locked(tmp_path, monkeypatch):
    seen_at_lock = []
    real_flock = spool_mod.fcntl.flock

    def flock(fd, op):  # what an adopter globbing the directory could see at this moment
        seen_at_lock.append(sorted(p.name for p in tmp_path.glob("*.jsonl")))
        return real_flock(fd, op)

    monkeypatch.setattr(spool_mod.fcntl, "flock", flock)
    live = MetricSpool(tmp_path)
    assert seen_at_lock[0] == []  # locked before it had its name
    assert [p.name for p in tmp_path.iterdir()] == [live.path.name]  # no temp file left
    live.append(1, 1000, {"loss": 2.0})
    monkeypatch.setattr(spool_mod.fcntl, "flock", real_flock)
    # another process's start adopting leftovers leaves a live writer's spool alone
    assert MetricSpool(tmp_path).adopt_leftovers() == {}
    assert _lines(live) == [{"step": 1, "ts": 1000, "m": {"loss": 2.0}}]


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(spool_mod.os, "write", lambda fd, data: real_write(fd, bytes(data)[:7]))
    s = MetricSpool(tmp_path)
    s.append(1, 1000, {"loss": 2.5, "lr": 0.001})
    s.append(2, 1001, {"loss": 2.25})
    metrics, used = s.read()
    assert [(m.key, m.step, m.value) for m in metrics] == [("loss", 1, 2.5), ("lr", 1, 0.001), ("loss", 2, 2.25)]
    assert used == s.path.stat().st_size


def test_a_write_the_disk_refuses_leaves_no_half_line(tmp_path, monkeypatch):
    real_write = os.write
    s = MetricSpool(tmp_path)
    s.append(1, 1000, {"loss": 2.0})
    size = s.path.stat().st_size
    calls = []

    def full_disk(fd, data):  # writes a piece of the line, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "write", full_disk)
    with pytest.raises(OSError):
        s.append(2, 1001, {"loss": 1.5})
    assert s.path.stat().st_size == size and s.failed == 1
    monkeypatch.setattr(spool_mod.os, "write", real_write)
    s.append(3, 1002, {"loss": 1.0})  # the next line is whole and readable
    assert [rec["step"] for rec in _lines(s)] == [1, 3]


def test_the_backlog_is_bounded_with_one_warning_naming_the_spool(tmp_path, caplog):
    s = MetricSpool(tmp_path, max_bytes=200)
    with caplog.at_level(logging.WARNING, logger=spool_mod.__name__):
        for step in range(1, 11):
            s.append(step, 1000 + step, {"train/loss": 1.0 / step})
    kept = [rec["step"] for rec in _lines(s)]
    assert s.path.stat().st_size <= 200 and kept == list(range(1, len(kept) + 1)) and s.dropped == 10 - len(kept)
    warnings = [r.getMessage() for r in caplog.records if "bound" in r.getMessage()]
    assert len(warnings) == 1 and str(s.path) in warnings[0] and "tracking.spool_max_mb" in warnings[0]
    _, used = s.read()
    s.advance(used)  # all of it sent: room again
    s.append(11, 1011, {"train/loss": 0.09})
    assert [rec["step"] for rec in _lines(s)] == [11]


def test_a_dead_processes_temp_file_is_removed_and_a_fresh_one_kept(tmp_path):
    old, fresh = tmp_path / ".123-deadbeef.jsonl.part", tmp_path / ".124-cafebabe.jsonl.part"
    old.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(old, (time.time() - 120, time.time() - 120))
    MetricSpool(tmp_path).adopt_leftovers()
    assert not old.exists() and fresh.exists()
