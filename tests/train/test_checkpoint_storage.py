"""Checkpoint completeness and the run directory on object storage (the S3 server) and local
disk alike: markers list objects with sizes; the newest complete checkpoint is found by listing."""
import pytest

from vitp import storage
from vitp.recipes import resolve
from vitp.train import checkpoint as ckpt


def _write_checkpoint(root: str, step: int, world: int = 2, *, markers=None, truncate=None,
                      offset: int = 0) -> str:
    """A checkpoint laid out as `checkpoint.save` leaves it after Ray merged every rank's files."""
    d = storage.join(root, f"checkpoint_{step:08d}")
    markers = range(world) if markers is None else markers
    for r in range(world):
        files = {f"state/zero_rank_{r}.pt": 100 + r, f"rng/rank_{r:05d}.pt": 10}
        for rel, n in files.items():
            storage.write_bytes(storage.join(d, rel), b"x" * (n - (1 if rel == truncate else 0)))
        if r in markers:
            storage.write_json(storage.join(d, f"complete/rank_{r:05d}.json"),
                               {"rank": r, "world_size": world, "step": step, "files": files})
    state = {"step": step, "samples_seen": step * 8, "epoch": 0, "epoch_offset": offset, "best_metric": None}
    storage.write_json(storage.join(d, "meta.json"), {"step": step, "world_size": world, "tag": "state",
                                                      "train_state": state, "zero_stage": 2})
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


def test_newest_complete_checkpoint_and_samples_consumed(work_dir):
    cfg = resolve("debug", [f"work_dir={work_dir}", "tracking.run_name=r"])
    assert ckpt.latest_complete_checkpoint(cfg) is None and ckpt.samples_consumed(cfg) == 0
    run = ckpt.run_dir(cfg)
    assert run == storage.join(work_dir if storage.is_uri(work_dir) else storage.abspath(work_dir), "runs", "r")
    _write_checkpoint(run, 10, offset=80)
    newest_complete = _write_checkpoint(run, 20, offset=160)
    _write_checkpoint(run, 30, markers=[1])  # rank 0 died before its marker: never restored
    assert ckpt.latest_complete_checkpoint(cfg) == newest_complete
    assert ckpt.samples_consumed(cfg) == 20 * 8  # the newest complete one's samples_seen
