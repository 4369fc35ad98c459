"""Checkpoints: the sharded DeepSpeed format with completion markers, RNG and data position, how
one is written and verified, and the run directory they live in (<work_dir>/runs/<run name>/
checkpoint_NNNNNNNN). Restoring one (at any world size) is restore.py. No Ray (Ray Train moves these
directories); torch only where one is written, so finding one (RankStreams) imports none.
"""
from __future__ import annotations

import gzip
import os
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..config import Run
from ..console import get_logger
from ..tracking.redact import redact
from .. import storage
from ..storage import join

log = get_logger(__name__)

# Layout of one checkpoint directory (the merge of every rank's files):
#     state/...                  DeepSpeed's files (model states, ZeRO optimizer shards)
#     rng/rank_00000.pt          each rank's torch / numpy / python RNG state
#     ema/rank_00000.safetensors with train.ema_decay: each rank's EMA fragments (ema.py)
#     complete/rank_00000.json   written by each rank *after* its files are in place: step, world,
#                                the worker group's attempt, and the size of every file it wrote
#     meta.json                  rank 0: step, world size, ZeRO stage, data position, config
#     metrics_backlog.jsonl.gz   rank 0, while MLflow lacks some: its spooled lines (tracking/runs.py)
# A checkpoint is complete only when meta.json and one marker per rank are present, all of one
# attempt, and every file a marker lists exists with its recorded size.
TAG = "state"
CHECKPOINT_NAME = re.compile(r"checkpoint_\d{8}$")  # Ray Train's own files beside them do not match
BACKLOG = "metrics_backlog.jsonl.gz"


def checkpoint_dir_name(step: int) -> str:
    """The directory name of the checkpoint at `step` (sorts by step)."""
    return f"checkpoint_{step:08d}"


@dataclass
class TrainState:
    """Where training stands: enough to continue exactly where a checkpoint left off."""

    step: int = 0  # optimizer steps done
    samples_seen: int = 0  # global images consumed (data position)
    epoch: int = 0  # epoch of the next sample
    epoch_offset: int = 0  # images of that epoch already consumed
    best_metric: float | None = None
    # worker counts the run trained with, [[world, samples_seen at its start], ...], and the
    # rows per read unit it started with: the data position at any world (data/position.py)
    worlds: list = field(default_factory=list)
    unit_rows: int = 0
    # how its epochs are dealt to the ranks (data/position.py, DEALING); absent in checkpoints
    # written before there was a choice: 1. A fresh run takes the newest.
    dealing: int = 1


def distributed() -> bool:
    import torch  # lazy: the run-directory functions below are read without torch (RankStreams)

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_world() -> tuple[int, int]:
    if distributed():
        import torch

        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def save(engine, directory: str, state: TrainState, cfg_dict: dict[str, Any] | None = None,
         mlflow_run_id: str | None = None, metrics: dict[str, float] | None = None, ema=None,
         mark: bool = True, attempt: str | None = None, backlog: bytes = b"") -> dict[str, Any]:
    """All ranks: write this rank's part of a checkpoint into `directory` (may be rank-local);
    returns this rank's completion marker.

    `metrics` (the step's logged metrics, e.g. val/top1) go into meta.json: a finished run that is
    started again reports them without training (`trainer.run_training`). `ema` (ema.WeightEMA):
    this rank's EMA fragments go into ema/, listed by the marker like the rest.

    DeepSpeed's save is collective. The marker is written last, after this rank's files are
    flushed, so a rank killed mid-save leaves no marker and the checkpoint stays incomplete.
    `mark=False` leaves it unwritten: an uploader writes it where the files went, after them.
    `attempt` (the same on every rank of one worker group) goes into meta.json and each marker:
    where a restarted group writes the same step again, parts of two attempts never count as one.
    `backlog` (rank 0): the metric lines MLflow lacks so far, kept with the steps they belong to.
    """
    import torch

    rank, world = rank_world()
    os.makedirs(directory, exist_ok=True)
    before = set(storage.file_sizes(directory, skip_dirs=("complete",)))
    engine.save_checkpoint(directory, tag=TAG, client_state={"train_state": asdict(state)},
                           save_latest=False)
    os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
    torch.save(
        {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        os.path.join(directory, "rng", f"rank_{rank:05d}.pt"),
    )
    if ema is not None:
        ema.save(directory, rank)
    if rank == 0:
        # the config redacted: a checkpoint is copied and shared; resuming reads only its seed,
        # steps and model shape from it (the run's own config comes from the command)
        meta = {"step": state.step, "world_size": world, "tag": TAG, "train_state": asdict(state), "attempt": attempt,
                "zero_stage": engine.zero_optimization_stage(), "config": redact(cfg_dict) if cfg_dict else cfg_dict,
                "mlflow_run_id": mlflow_run_id, "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
        storage.write_json(os.path.join(directory, "meta.json"), meta)
        if backlog:
            storage.write_bytes(os.path.join(directory, BACKLOG), gzip.compress(backlog, compresslevel=1))
    if distributed():
        torch.distributed.barrier()  # every rank's DeepSpeed files are written
    # Markers are left out: other ranks may be writing theirs into a shared directory now.
    files = {k: v for k, v in storage.file_sizes(directory, skip_dirs=("complete",)).items()
             if k not in before}
    marker = {"rank": rank, "world_size": world, "step": state.step, "attempt": attempt, "files": files}
    if mark:
        write_marker(directory, marker)
        if distributed():
            torch.distributed.barrier()  # every marker is written: a shared directory is complete
    return marker


def write_marker(directory: str, marker: dict[str, Any]) -> None:
    """Rank `marker["rank"]`'s completion marker in `directory` (a path or URI): only once every
    file it lists is there."""
    storage.write_json(join(directory, "complete", f"rank_{marker['rank']:05d}.json"), marker)


def _raise_if_unreachable(e: Exception) -> None:
    """An unreachable store says nothing of a checkpoint: raised, for the caller to wait it out
    (storage.through_outages), instead of the checkpoint being passed over as incomplete."""
    if isinstance(e, OSError) and not isinstance(e, storage.NOT_TRANSIENT):
        raise e


def verify(directory: str) -> tuple[bool, str]:
    """(complete?, reason). Complete = meta + a marker per rank + every listed file present with
    its recorded size. Works the same on a local directory and on object storage (one listing)."""
    try:
        meta = read_meta(directory)
        world = int(meta["world_size"])
    except FileNotFoundError:
        return False, f"{directory}: no meta.json (rank 0 never finished saving)"
    except (OSError, ValueError, KeyError, TypeError) as e:  # may be mid-copy
        _raise_if_unreachable(e)
        return False, f"{directory}: meta.json is unreadable ({e}); still being written?"
    present = storage.file_sizes(directory)
    for r in range(world):
        marker = f"complete/rank_{r:05d}.json"
        if marker not in present:
            return False, f"{directory}: rank {r} of {world} has no completion marker"
        try:
            mark = storage.read_json(join(directory, marker))
            listed = mark["files"]
        except (OSError, ValueError, KeyError) as e:
            _raise_if_unreachable(e)
            return False, f"{directory}: marker of rank {r} is unreadable ({e}); still being written?"
        if mark.get("attempt") != meta.get("attempt"):  # a restarted group is writing this step again
            return False, f"{directory}: rank {r}'s part is from another attempt than meta.json's"
        for rel, size in listed.items():
            if present.get(rel.replace(os.sep, "/")) != size:
                return False, f"{directory}: {rel} from rank {r} is missing or truncated"
    return True, "complete"


def read_backlog(directory: str, max_bytes: int) -> bytes:
    """The metric lines the checkpoint in `directory` kept for MLflow (b"" if none); at most
    `max_bytes` of them (tracking.spool_max_mb), a longer file is cut at a line's end."""
    path = join(directory, BACKLOG)
    if not storage.exists(path):
        return b""
    with storage.open_input(path) as raw, gzip.GzipFile(fileobj=raw) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        log.warning("%s holds more than %d MB of metric lines: only the first are sent", path, max_bytes // 2**20)
        data = data[:data.rfind(b"\n", 0, max_bytes) + 1]
    return data


def read_meta(directory: str) -> dict[str, Any]:
    return storage.read_json(join(directory, "meta.json"))


# --------------------------------------------------------------------------- run directory


def latest_complete_checkpoint(run: Run, warn=None) -> str | None:
    """Newest checkpoint directory of this run that passes `verify`, on local disk or object
    storage, whether or not Ray registered it (a worker killed inside `report` leaves one).
    `warn(line)` is told of each newer one passed over and why."""
    return latest_complete_in(run.dir, warn)


def latest_complete_in(root: str, warn=None) -> str | None:
    """latest_complete_checkpoint of the run directory `root`."""
    names = storage.listdir(root)
    fenced = storage.read_json(join(root, FENCE)) if FENCE in names else None
    for name in reversed(names):
        if not CHECKPOINT_NAME.match(name):  # e.g. checkpoint_manager_snapshot.json
            continue
        path = join(root, name)
        ok, reason = verify(path)
        if ok and fenced and name > fenced["from"] and read_meta(path).get("attempt") in fenced["stale_attempts"]:
            ok, reason = False, f"written by an attempt stopped at {fenced['from']} (a paused trial's)"
        if ok:
            return path
        if warn:
            warn(f"passing over {path}: {reason}")
    return None


FENCE = "fence.json"  # {"from": checkpoint name, "stale_attempts": [...]}: see fence()


def fence(run: Run, name: str) -> list[str]:
    """A restart from checkpoint `name` while the run's previous attempt may still be writing (a
    trial Tune paused, whose Train run ends only when its controller does): checkpoints after `name`
    by the attempts that wrote this run's checkpoints so far are never picked. Returns those attempts."""
    root = run.dir
    names = storage.listdir(root) if storage.exists(root) else []
    attempts = set(storage.read_json(join(root, FENCE))["stale_attempts"]) if FENCE in names else set()
    for n in names:
        if CHECKPOINT_NAME.match(n) and storage.exists(join(root, n, "meta.json")):
            attempts.add(read_meta(join(root, n)).get("attempt"))
    attempts.discard(None)
    storage.write_json(join(root, FENCE), {"from": name, "stale_attempts": sorted(attempts)})
    return sorted(attempts)


def rewind(run: Run, name: str, inclusive: bool = False) -> list[str]:
    """Delete this run's checkpoints after the one named `name` (and it, when `inclusive`), so a
    restart goes on from it or from what replaces it; their names."""
    root = run.dir
    gone = [n for n in (storage.listdir(root) if storage.exists(root) else [])
            if CHECKPOINT_NAME.match(n) and (n >= name if inclusive else n > name)]
    for old in gone:
        storage.rmtree(join(root, old), root)
    return gone


def adopt(checkpoint: str, run: Run) -> str:
    """Make another run's complete `checkpoint` the newest of `run`'s (a population-based
    search's exploit): this run's checkpoints at or after its step are deleted, the checkpoint is
    copied in under its own name, and its meta.json no longer names the donor's MLflow run (this
    run continues its own) but where it was copied from; the markers list its new size, so the copy
    verifies as complete. Returns the copy's path."""
    ok, reason = verify(checkpoint)
    if not ok:
        raise RuntimeError(f"cannot continue from another run's checkpoint: {reason}")
    name = storage.basename(checkpoint.rstrip("/"))
    rewind(run, name, inclusive=True)
    dest = join(run.dir, name)
    storage.copy_dir(checkpoint, dest)
    meta = {**read_meta(dest), "mlflow_run_id": None, "copied_from": checkpoint}
    storage.write_json(join(dest, "meta.json"), meta)
    size = storage.size(join(dest, "meta.json"))
    for r in range(int(meta["world_size"])):  # rank 0's lists it; another rank's may too (a shared directory)
        path = join(dest, "complete", f"rank_{r:05d}.json")
        marker = storage.read_json(path)
        if r == 0 or "meta.json" in marker["files"]:
            marker["files"]["meta.json"] = size
            storage.write_json(path, marker)
    return dest


def retain(run: Run) -> list[str]:
    """Delete the complete checkpoints of this run that retention does not keep; their names.

    Kept: the newest train.keep_checkpoints complete ones (0: all) and, with train.keep_every=M,
    every M-th (step a multiple of M x train.checkpoint_every). Only complete checkpoints older than
    those are deleted: never the newest complete one (a resume's pick) nor one still being written."""
    train = run.cfg.train
    keep, every = train.keep_checkpoints, train.keep_every * train.checkpoint_every
    if not keep:
        return []
    root = run.dir
    complete = [n for n in storage.listdir(root) if CHECKPOINT_NAME.match(n) and verify(join(root, n))[0]]
    kept = set(complete[-keep:]) | {n for n in complete if every and int(n.split("_")[1]) % every == 0}
    gone = [n for n in complete if n not in kept]
    for name in gone:
        storage.rmtree(join(root, name), root)
    return gone


def data_position(run: Run) -> dict[str, Any] | None:
    """The run's data position at its newest complete checkpoint (samples_seen, the worker
    counts it had, its unit_rows), None for a fresh run: where a (re)started attempt's streams
    start (RankStreams)."""
    latest = latest_complete_checkpoint(run)
    if latest is None:
        return None
    meta = read_meta(latest)
    state = meta["train_state"]
    return {"samples_seen": int(state["samples_seen"]), "unit_rows": int(state.get("unit_rows") or 0),
            "worlds": state.get("worlds") or [[int(meta["world_size"]), 0]],
            "dealing": int(state.get("dealing") or 1)}


def samples_consumed(run: Run) -> int:
    """Images the run consumed (all ranks) up to its newest complete checkpoint, 0 for a fresh run."""
    pos = data_position(run)
    return pos["samples_seen"] if pos else 0
