"""Checkpoint staging (vitp/train/staging.py): a staged copy whose process died is removed, on this
node and, from a driver, on every node; a live process's copy and other files are never touched."""
import os
import subprocess
import sys

from vitp.paths import staging_root
from vitp.train.staging import clear_dead, clear_dead_everywhere, new_stage


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stage_of(pid: int, run: str, step: int) -> str:
    """What new_stage makes in process `pid` (a real snapshot's file inside)."""
    mine = new_stage(run, step, 0)
    other = mine.replace(f"-p{os.getpid()}-", f"-p{pid}-")
    os.rename(mine, other)
    with open(os.path.join(other, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 64)
    return other


def test_a_dead_process_stage_goes_and_a_live_one_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # the temp dir read again from TMPDIR
    assert staging_root().startswith(str(tmp_path))
    live = new_stage("run-a", 20, 1)
    assert f"ckpt-20-r1-p{os.getpid()}-" in os.path.basename(live)
    dead = _stage_of(_dead_pid(), "run-a", 40)
    other_run = _stage_of(_dead_pid(), "run-b", 20)
    stray = os.path.join(staging_root(), "run-a", "notes.txt")  # not a stage: not ours to remove
    open(stray, "w").close()
    assert sorted(clear_dead()) == sorted([dead, other_run])
    assert os.path.isdir(live) and os.path.exists(stray)
    assert not os.path.exists(dead) and not os.path.exists(other_run)
    assert clear_dead() == []


def test_a_driver_clears_dead_stages_on_the_cluster_nodes(ray_session):
    """Ray's workers here share this process's TMPDIR (one node): the task finds what it left."""
    dead = _stage_of(_dead_pid(), "run-c", 60)
    live = new_stage("run-c", 80, 0)
    assert clear_dead_everywhere() >= 1
    assert not os.path.exists(dead) and os.path.isdir(live)
    os.rmdir(live)
