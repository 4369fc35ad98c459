"""Checkpoints: the sharded DeepSpeed format with completion markers, RNG and data position, and
the run directory they live in (<work_dir>/runs/<run name>/checkpoint_NNNNNNNN).

An incomplete checkpoint is never restored. No Ray here: Ray Train moves these directories to
and from storage; this module only reads and writes them.
"""
from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..config import ExperimentConfig
from .. import storage
from ..storage import join

# Layout of one checkpoint directory (the merge of every rank's files):
#     state/...                  DeepSpeed's files (model states, ZeRO optimizer shards)
#     rng/rank_00000.pt          each rank's torch / numpy / python RNG state
#     complete/rank_00000.json   written by each rank *after* its files are on disk: step, world,
#                                and the size of every file it wrote
#     meta.json                  rank 0: step, world size, ZeRO stage, data position, config
# A checkpoint is complete only when meta.json and one marker per rank are present and every
# file a marker lists exists with its recorded size.
TAG = "state"


@dataclass
class TrainState:
    """Where training stands: enough to continue exactly where a checkpoint left off."""

    step: int = 0  # optimizer steps done
    samples_seen: int = 0  # global images consumed (data position)
    epoch: int = 0  # epoch of the next sample
    epoch_offset: int = 0  # images of that epoch already consumed
    best_metric: float | None = None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def save(engine, directory: str, state: TrainState, cfg_dict: dict[str, Any] | None = None,
         mlflow_run_id: str | None = None, metrics: dict[str, float] | None = None) -> str:
    """All ranks: write this rank's part of a checkpoint into `directory` (may be rank-local).

    `metrics` (the step's logged metrics, e.g. val/top1) go into meta.json: a finished run that is
    started again reports them without training (`trainer.run_training`).

    DeepSpeed's save is collective. The marker is written last, after this rank's files are
    flushed, so a rank killed mid-save leaves no marker and the checkpoint stays incomplete.
    """
    rank, world = _rank_world()
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
    if rank == 0:
        meta = {"step": state.step, "world_size": world, "tag": TAG, "train_state": asdict(state),
                "zero_stage": engine.zero_optimization_stage(), "config": cfg_dict,
                "mlflow_run_id": mlflow_run_id, "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
        storage.write_json(os.path.join(directory, "meta.json"), meta)
    if _distributed():
        torch.distributed.barrier()  # every rank's DeepSpeed files are written
    # Markers are left out: other ranks may be writing theirs into a shared directory now.
    files = {k: v for k, v in storage.file_sizes(directory, skip_dirs=("complete",)).items()
             if k not in before}
    storage.write_json(os.path.join(directory, "complete", f"rank_{rank:05d}.json"),
                {"rank": rank, "world_size": world, "step": state.step, "files": files})
    if _distributed():
        torch.distributed.barrier()  # every marker is written: a shared directory is complete
    return directory


def verify(directory: str) -> tuple[bool, str]:
    """(complete?, reason). Complete = meta + a marker per rank + every listed file present with
    its recorded size. Works the same on a local directory and on object storage (one listing)."""
    try:
        meta = read_meta(directory)
        world = int(meta["world_size"])
    except FileNotFoundError:
        return False, f"{directory}: no meta.json (rank 0 never finished saving)"
    except (OSError, ValueError, KeyError, TypeError) as e:  # may be mid-copy
        return False, f"{directory}: meta.json is unreadable ({e}); still being written?"
    present = storage.file_sizes(directory)
    for r in range(world):
        marker = f"complete/rank_{r:05d}.json"
        if marker not in present:
            return False, f"{directory}: rank {r} of {world} has no completion marker"
        try:
            listed = storage.read_json(join(directory, marker))["files"]
        except (OSError, ValueError, KeyError) as e:
            return False, f"{directory}: marker of rank {r} is unreadable ({e}); still being written?"
        for rel, size in listed.items():
            if present.get(rel.replace(os.sep, "/")) != size:
                return False, f"{directory}: {rel} from rank {r} is missing or truncated"
    return True, "complete"


def read_meta(directory: str) -> dict[str, Any]:
    return storage.read_json(join(directory, "meta.json"))


def load(engine, directory: str, load_optimizer: bool = True) -> TrainState:
    """All ranks: restore model, optimizer, LR scheduler, RNG and TrainState from `directory`.

    Raises if the checkpoint is incomplete, was written by another world size, or DeepSpeed finds
    nothing to load (its `load_checkpoint` returns None instead of raising).
    """
    ok, reason = verify(directory)
    if not ok:
        raise RuntimeError(f"refusing to restore an incomplete checkpoint: {reason}")
    rank, world = _rank_world()
    meta = read_meta(directory)
    if meta["world_size"] != world:
        raise RuntimeError(
            f"{directory} was saved by {meta['world_size']} ranks but {world} are running: ZeRO "
            "shards are per rank; resume with the same parallel.num_workers, or export the "
            "weights (`vitp export`) and start a new run from them"
        )
    path, client = engine.load_checkpoint(directory, tag=meta["tag"], load_optimizer_states=load_optimizer,
                                          load_lr_scheduler_states=load_optimizer)
    if path is None:
        raise RuntimeError(
            f"DeepSpeed found no checkpoint under {directory}/{meta['tag']} although a resume was "
            "expected: the directory is incomplete or from another layout"
        )
    rng_path = os.path.join(directory, "rng", f"rank_{rank:05d}.pt")
    if os.path.exists(rng_path):
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    state = (client or {}).get("train_state") or meta["train_state"]
    return TrainState(**state)


# --------------------------------------------------------------------------- run directory


def storage_path(cfg: ExperimentConfig) -> str:
    """Where Ray Train keeps this run's checkpoints: <work_dir>/runs (an absolute path or a URI)."""
    return join(storage.abspath(cfg.work_dir), "runs")


def run_dir(cfg: ExperimentConfig) -> str:
    return join(storage_path(cfg), cfg.run_name)


def latest_complete_checkpoint(cfg: ExperimentConfig) -> str | None:
    """Newest checkpoint directory of this run that passes `verify`, on local disk or object
    storage, whether or not Ray registered it (a worker killed inside `report` leaves one)."""
    root = run_dir(cfg)
    for name in reversed(storage.listdir(root)):
        path = join(root, name)
        if name.startswith("checkpoint_") and verify(path)[0]:
            return path
    return None


def samples_consumed(cfg: ExperimentConfig) -> int:
    """Images the run consumed (all ranks) up to its newest complete checkpoint, 0 for a fresh
    run: where a (re)started attempt's streams start (each rank its share, see RankStreams)."""
    latest = latest_complete_checkpoint(cfg)
    return int(read_meta(latest)["train_state"]["samples_seen"]) if latest else 0
