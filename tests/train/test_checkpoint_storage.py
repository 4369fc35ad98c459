"""Checkpoint completeness and the run directory on object storage (the S3 server) and local
disk alike: markers list objects with sizes; the newest complete checkpoint is found by listing."""
import pytest

from vitp import storage
from vitp.recipes import resolve
from vitp.train import checkpoint as ckpt
from vitp.config import Run


def _write_checkpoint(root: str, step: int, world: int = 2, *, markers=None, truncate=None,
                      offset: int = 0, attempts=None) -> str:
    """A checkpoint laid out as `checkpoint.save` leaves it after every rank's upload (`attempts`:
    each rank's worker-group attempt, meta.json has rank 0's)."""
    attempts = attempts or ["a"] * world
    d = storage.join(root, f"checkpoint_{step:08d}")
    markers = range(world) if markers is None else markers
    for r in range(world):
        files = {f"state/zero_rank_{r}.pt": 100 + r, f"rng/rank_{r:05d}.pt": 10}
        for rel, n in files.items():
            storage.write_bytes(storage.join(d, rel), b"x" * (n - (1 if rel == truncate else 0)))
        if r in markers:
            storage.write_json(storage.join(d, f"complete/rank_{r:05d}.json"),
                               {"rank": r, "world_size": world, "step": step, "attempt": attempts[r],
                                "files": files})
    state = {"step": step, "samples_seen": step * 8, "epoch": 0, "epoch_offset": offset, "best_metric": None}
    storage.write_json(storage.join(d, "meta.json"), {"step": step, "world_size": world, "tag": "state",
                                                      "train_state": state, "zero_stage": 2,
                                                      "attempt": attempts[0]})
    return d


@pytest.fixture(params=["s3", "local", "file-uri"])
def work_dir(request, tmp_path):
    if request.param == "s3":
        return storage.join(request.getfixturevalue("s3").bucket(), "vit")
    return str(tmp_path) if request.param == "local" else "file://" + str(tmp_path)


def test_completeness_on_any_storage(work_dir):
    ok = _write_checkpoint(work_dir, 10)
    assert ckpt.verify(ok) == (True, "complete")
    no_marker = _write_checkpoint(storage.join(work_dir, "a"), 20, markers=[0])
    assert "rank 1 of 2 has no completion marker" in ckpt.verify(no_marker)[1]
    short = _write_checkpoint(storage.join(work_dir, "b"), 30, truncate="state/zero_rank_1.pt")
    assert "state/zero_rank_1.pt from rank 1 is missing or truncated" in ckpt.verify(short)[1]
    assert "no meta.json" in ckpt.verify(storage.join(work_dir, "nothing"))[1]
    # a restarted worker group writing the same step again: rank 1's part is still the old attempt's
    mixed = _write_checkpoint(storage.join(work_dir, "c"), 40, attempts=["new", "old"])
    assert "rank 1's part is from another attempt" in ckpt.verify(mixed)[1]


def test_newest_complete_checkpoint_and_samples_consumed(work_dir):
    cfg = resolve("debug", [f"work_dir={work_dir}", "tracking.run_name=r"])
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)) is None and ckpt.samples_consumed(Run.of(cfg)) == 0
    run = Run.of(cfg).dir
    assert run == storage.join(work_dir if storage.is_uri(work_dir) else storage.abspath(work_dir), "runs", "r")
    _write_checkpoint(run, 10, offset=80)
    newest_complete = _write_checkpoint(run, 20, offset=160)
    _write_checkpoint(run, 30, markers=[1])  # rank 0 died before its marker: never restored
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)) == newest_complete
    assert ckpt.samples_consumed(Run.of(cfg)) == 20 * 8  # the newest complete one's samples_seen


def test_retention_keeps_the_newest_k_and_every_mth_complete_one(work_dir):
    """10 checkpoints every 10 steps, K=2, M=5: steps 50 and 100 (every 5th) and 90, 100 (the newest two)
    stay; an incomplete one newer than all is neither kept nor deleted, and a resume finds step 100."""
    cfg = resolve("debug", [f"work_dir={work_dir}", "tracking.run_name=r", "train.steps=200",
                            "train.checkpoint_every=10", "train.keep_checkpoints=2", "train.keep_every=5"])
    run = Run.of(cfg).dir
    for step in range(10, 101, 10):
        _write_checkpoint(run, step)
    partial = _write_checkpoint(run, 110, markers=[0])  # still uploading (or its rank 1 died)
    gone = ckpt.retain(Run.of(cfg))
    assert gone == [f"checkpoint_{s:08d}" for s in (10, 20, 30, 40, 60, 70, 80)]
    left = [n for n in storage.listdir(run)]
    assert left == [f"checkpoint_{s:08d}" for s in (50, 90, 100, 110)]
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)) == storage.join(run, "checkpoint_00000100")
    assert ckpt.retain(Run.of(cfg)) == [] and storage.exists(storage.join(partial, "meta.json"))
    keep_all = resolve("debug", [f"work_dir={work_dir}", "tracking.run_name=r", "train.keep_checkpoints=0"])
    assert ckpt.retain(Run.of(keep_all)) == []


def test_a_checkpoints_metric_backlog_is_read_in_whole_lines_within_its_bound(work_dir):
    import gzip
    import json

    d = _write_checkpoint(work_dir, 10)
    assert ckpt.read_backlog(d, 1 << 20) == b""  # MLflow had every step: no file
    lines = b"".join(json.dumps({"step": s, "ts": 1, "m": {"train/loss": 1.0 / s}}).encode() + b"\n"
                     for s in range(1, 11))
    storage.write_bytes(storage.join(d, ckpt.BACKLOG), gzip.compress(lines))
    assert ckpt.read_backlog(d, 1 << 20) == lines
    bound = len(lines) // 2
    cut = ckpt.read_backlog(d, bound)  # past tracking.spool_max_mb: the first whole lines only
    assert cut and len(cut) <= bound and lines.startswith(cut) and cut.endswith(b"\n")


def test_a_checkpoint_is_not_passed_over_while_the_store_is_cut_off(s3):
    """S3 cut off (tests/netproxy.py) while a checkpoint is verified: the error is raised for the
    caller to wait out, not read as an incomplete checkpoint (a resume would have started from an
    older one, or from step 0); once S3 is back the newest complete one is found."""
    cfg = resolve("debug", [f"work_dir={storage.join(s3.bucket(), 'vit')}", "tracking.run_name=r"])
    newest = _write_checkpoint(Run.of(cfg).dir, 10)
    s3.proxy.cut()
    try:
        with pytest.raises(OSError) as raised:
            ckpt.verify(newest)
        assert not isinstance(raised.value, storage.NOT_TRANSIENT)
    finally:
        s3.proxy.restore()
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)) == newest
