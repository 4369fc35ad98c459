"""Checkpoints that upload while training goes on: a rank's snapshot, staged on its node, is
reported in Ray Train's asynchronous mode with our upload function, which writes the rank's marker
after its files and only then removes the staged copy. One upload in flight per rank: a checkpoint
due meanwhile waits for it (and says so). Rules and metrics: docs/training.md.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray.train
from ray.train import CheckpointUploadMode

from .. import storage
from ..config import Run
from ..console import get_logger
from ..paths import staging_root
from .staging import clear_dead, new_stage
from . import checkpoint as ckpt
from .step import all_reduce_max, all_reduce_sum

_log = get_logger(__name__)


def report_metrics(metrics: dict[str, Any]) -> None:
    """Metrics without a checkpoint, queued behind an upload in flight instead of waiting for it
    (Ray Train hands reports on in order: a synchronous one would block until the upload ends)."""
    ray.train.report(metrics, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)


def commit_metrics(path: str) -> dict[str, float]:
    """The commit metrics of the complete checkpoint at `path`, from its markers: for a resume from
    a checkpoint whose commit the killed attempt had no time to log."""
    world = int(ckpt.read_meta(path)["world_size"])
    marks = [storage.read_json(storage.join(path, "complete", f"rank_{r:05d}.json")) for r in range(world)]
    if any("upload_s" not in m for m in marks):
        return {}  # written in place, not uploaded
    upload = max(m["upload_s"] for m in marks)
    mb = sum(sum(m["files"].values()) for m in marks) / 1e6
    return {"perf/ckpt_upload_s": upload, "perf/ckpt_commit_s": max(m["committed"] - m["started"] for m in marks),
            "perf/ckpt_write_mb_s": mb / max(upload, 1e-9)}


def _shared(value):
    """Rank 0's `value` on every rank (a collective)."""
    import torch

    if not torch.distributed.is_initialized():
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


@dataclass
class Upload:
    """One rank's upload of the checkpoint at `step`; times on this rank's clock."""

    step: int
    started: float  # time.time() when the snapshot began
    bytes: int
    upload_s: Optional[float] = None
    committed: Optional[float] = None  # time.time() once this rank's marker is in storage


WAIT_WARN_S = 1.0  # a checkpoint that waited this long for the previous upload says so


class CheckpointWriter:
    """A rank's checkpoints: snapshot, background upload, the commit metrics and retention.

    `write` and `finish` are collectives (every rank calls them at the same steps)."""

    def __init__(self, run: Run, engine, rank: int, device, say: Callable[[str], None],
                 log_metrics: Optional[Callable[[dict[str, float], int], None]] = None,
                 mlflow_run_id: Optional[str] = None, ema=None, backlog: Optional[Callable[[], bytes]] = None):
        self.run, self.cfg = run, run.cfg
        self.engine, self.rank, self.device, self.say = engine, rank, device, say
        self.log_metrics, self.mlflow_run_id, self.ema = log_metrics, mlflow_run_id, ema
        self.backlog = backlog  # rank 0: the metric lines MLflow lacks, kept in each checkpoint
        # A worker killed mid-checkpoint leaves its staged copy: every start of the workers clears
        # those of dead processes on its node (staging.py)
        clear_dead()
        self.staging = os.path.join(staging_root(), run.name)
        self.attempt = _shared(uuid.uuid4().hex if rank == 0 else None)  # this worker group's, in every marker
        self._idle = threading.Event()
        self._idle.set()
        self.last: Optional[Upload] = None
        self._logged: Optional[int] = None  # the step whose commit is logged
        self.upload_s = 0.0  # the last committed upload's time, slowest rank

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def write(self, step: int, state: ckpt.TrainState, metrics: dict[str, float]) -> dict[str, float]:
        """The checkpoint at `step` (collective); its I/O metrics, the slowest rank's."""
        t0 = time.perf_counter()
        self._idle.wait()  # the rule: one upload in flight; a checkpoint due meanwhile waits for it
        waited = time.perf_counter() - t0
        self.commit()
        t1, started = time.perf_counter(), time.time()
        local = new_stage(self.cfg.run_name, step, self.rank)
        marker = ckpt.save(self.engine, local, state, self.cfg.to_dict() if self.rank == 0 else None,
                           mlflow_run_id=self.mlflow_run_id, metrics=metrics, ema=self.ema, mark=False,
                           attempt=self.attempt, backlog=self.backlog() if self.backlog else b"")
        t2 = time.perf_counter()
        previous, self.last = self.last, Upload(step, started, sum(storage.file_sizes(local).values()))
        self._idle.clear()
        try:
            ray.train.report({"step": step, **metrics}, checkpoint=ray.train.Checkpoint.from_directory(local),
                             checkpoint_dir_name=ckpt.checkpoint_dir_name(step),
                             checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                             delete_local_checkpoint_after_upload=False,  # ours deletes it, after the marker
                             checkpoint_upload_fn=self._upload_fn(local, marker, self.last))
        except BaseException:
            self._idle.set()
            raise
        slowest = all_reduce_max({"wait": waited, "save": t2 - t1, "blocked": time.perf_counter() - t0},
                                 self.device)
        mb = all_reduce_sum({"bytes": self.last.bytes}, self.device)["bytes"] / 1e6
        if slowest["wait"] >= WAIT_WARN_S and previous is not None:
            self.say(f"checkpoint {step} waited {slowest['wait']:.1f} s for the upload of checkpoint "
                     f"{previous.step}: uploads take longer than train.checkpoint_every="
                     f"{self.cfg.train.checkpoint_every} steps; checkpoint less often")
        return {"perf/ckpt_mb": mb, "perf/ckpt_wait_s": slowest["wait"], "perf/ckpt_save_s": slowest["save"],
                "perf/ckpt_blocked_s": slowest["blocked"]}

    def _upload_fn(self, local: str, marker: dict[str, Any], up: Upload):
        def upload(checkpoint, dir_name: str):  # in Ray Train's upload thread: an error ends the worker
            self._idle.clear()
            try:
                t0 = time.perf_counter()
                dest = storage.join(self.run.dir, dir_name)
                # a write the store dropped or a store cut off: tried again (storage.IncompleteCopy)
                storage.through_outages(lambda: storage.upload_dir(local, dest), f"[{self.cfg.run_name}] rank "
                                        f"{self.rank}'s upload of checkpoint {up.step}", _log.warning)
                up.upload_s, up.committed = time.perf_counter() - t0, time.time()
                # last: now this rank's part counts (with its times: a resume logs a commit it missed)
                ckpt.write_marker(dest, {**marker, "started": up.started, "upload_s": up.upload_s,
                                         "committed": up.committed})
                storage.rmtree(local, self.staging)
                fs, inner = storage.filesystem(dest)
                return ray.train.Checkpoint(inner, filesystem=fs)
            finally:
                self._idle.set()
        return upload

    def wait(self) -> None:
        """Until this rank's upload in flight (if any) has finished."""
        self._idle.wait()

    def commit(self) -> None:
        """Collective, with no upload in flight on any rank: the last checkpoint's upload time
        (slowest rank) and the time from its snapshot to its commit, logged at its step once;
        then retention (rank 0)."""
        up = self.last  # the same step on every rank: the same answer below
        if up is None or up.step == self._logged:
            return
        worst = all_reduce_max({"upload": up.upload_s or 0.0,
                                "commit": (up.committed or time.time()) - up.started}, self.device)
        mb = all_reduce_sum({"bytes": up.bytes}, self.device)["bytes"] / 1e6
        self._logged, self.upload_s = up.step, worst["upload"]
        if self.rank != 0:
            return
        self.say(f"checkpoint {up.step} committed: {mb:.1f} MB uploaded in {worst['upload']:.2f} s "
                 f"({mb / max(worst['upload'], 1e-9):.1f} MB/s), {worst['commit']:.2f} s after its snapshot began")
        if self.log_metrics:
            self.log_metrics({"perf/ckpt_upload_s": worst["upload"], "perf/ckpt_commit_s": worst["commit"],
                              "perf/ckpt_write_mb_s": mb / max(worst["upload"], 1e-9)}, up.step)
        for name in ckpt.retain(self.run):
            self.say(f"retention: removed {name} (train.keep_checkpoints={self.cfg.train.keep_checkpoints}, "
                     f"train.keep_every={self.cfg.train.keep_every})")

    def finish(self) -> None:
        """At the end of training (collective): the last upload finished and committed."""
        self.wait()
        all_reduce_max({"done": 1.0}, self.device)  # every rank's upload has finished
        self.commit()
