"""Checkpoints: the sharded DeepSpeed format with completion markers, RNG and data position, and
the run directory they live in (<work_dir>/runs/<run name>/checkpoint_NNNNNNNN).
An incomplete checkpoint is never restored; one of another world size is converted to DeepSpeed's
universal layout first. No Ray (Ray Train moves these directories); torch only where one is written
or restored, so finding one (RankStreams, in Train's dataset manager) imports none.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import re
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..config import ExperimentConfig
from ..console import get_logger
from ..paths import RunPaths
from ..safe_load import weights_only
from ..tracking.redact import redact
from .. import storage
from ..storage import join

log = get_logger(__name__)

# Layout of one checkpoint directory (the merge of every rank's files):
#     state/...                  DeepSpeed's files (model states, ZeRO optimizer shards)
#     rng/rank_00000.pt          each rank's torch / numpy / python RNG state
#     complete/rank_00000.json   written by each rank *after* its files are on disk: step, world,
#                                and the size of every file it wrote
#     meta.json                  rank 0: step, world size, ZeRO stage, data position, config
# A checkpoint is complete only when meta.json and one marker per rank are present and every
# file a marker lists exists with its recorded size.
TAG = "state"
CHECKPOINT_NAME = re.compile(r"checkpoint_\d{8}$")  # Ray Train's own files beside them do not match


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


def _distributed() -> bool:
    import torch  # lazy: the run-directory functions below are read without torch (RankStreams)

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _distributed():
        import torch

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
    import torch

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
        # the config redacted: a checkpoint is copied and shared; resuming reads only its seed,
        # steps and model shape from it (the run's own config comes from the command)
        meta = {"step": state.step, "world_size": world, "tag": TAG, "train_state": asdict(state),
                "zero_stage": engine.zero_optimization_stage(), "config": redact(cfg_dict) if cfg_dict else cfg_dict,
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

    A ZeRO-1/2/3 checkpoint of another world size is first converted to DeepSpeed's universal
    format (`to_universal`, one conversion per host) and loaded from there; the RNG is then
    re-seeded from the step instead of restored. Raises if the checkpoint is incomplete or
    DeepSpeed finds nothing to load (its `load_checkpoint` returns None instead of raising).
    """
    ok, reason = verify(directory)
    if not ok:
        raise RuntimeError(f"refusing to restore an incomplete checkpoint: {reason}")
    with weights_only(directory):  # DeepSpeed's loads, the converter's and ours: data only
        return _load(engine, directory, load_optimizer)


def _load(engine, directory: str, load_optimizer: bool) -> TrainState:
    rank, world = _rank_world()
    meta = read_meta(directory)
    if needs_universal(directory, world):
        return _load_resized(engine, directory, meta, load_optimizer)
    with _universal_flag(engine, False):
        path, client = engine.load_checkpoint(directory, tag=meta["tag"],
                                              load_optimizer_states=load_optimizer,
                                              load_lr_scheduler_states=load_optimizer)
    _check_loaded(path, directory, meta["tag"])
    if meta["world_size"] == world:
        _restore_rng(directory, rank)
    else:  # ZeRO-0: one unsharded copy, any world loads it; the per-rank RNG streams don't map
        _seed_rng(meta, rank)
    state = (client or {}).get("train_state") or meta["train_state"]
    return TrainState(**state)


@contextlib.contextmanager
def _universal_flag(engine, on: bool):
    """DeepSpeed reads `checkpoint.load_universal` from its config in `load_checkpoint` only
    (0.19.8): set it for one load, whatever the engine was built with (engine.build_engine)."""
    was = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = on
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = was


def _check_loaded(path, directory: str, tag: str) -> None:
    if path is None:
        raise RuntimeError(
            f"DeepSpeed found no checkpoint under {directory}/{tag} although a resume was "
            "expected: the directory is incomplete or from another layout"
        )


def _restore_rng(directory: str, rank: int) -> None:
    import torch

    rng_path = os.path.join(directory, "rng", f"rank_{rank:05d}.pt")
    if os.path.exists(rng_path):
        rng = torch.load(rng_path, weights_only=True)  # numpy's state: safe_load allows arrays
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


def _seed_rng(meta: dict[str, Any], rank: int) -> None:
    """A deterministic RNG for a rank of a new world: from (run seed, step, rank)."""
    seed = int(((meta.get("config") or {}).get("train") or {}).get("seed", 0))
    import torch

    s = (seed * 1_000_003 + int(meta["step"]) * 7919 + rank) % 2**32
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


# --------------------------------------------------------------------------- another world size


def needs_universal(directory: str, world: int) -> bool:
    """True when `directory` holds ZeRO shards (stage >= 1) of a world size other than `world`:
    DeepSpeed then loads it only after `to_universal`. ZeRO-0 keeps one full copy: never."""
    meta = read_meta(directory)
    return int(meta["world_size"]) != world and int(meta.get("zero_stage") or 0) >= 1


def to_universal(directory: str, out_dir: str) -> str:
    """Convert the complete checkpoint `directory` (ZeRO-1/2/3, any world) into DeepSpeed's
    universal layout under `out_dir` (<out_dir>/<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt
    plus the model-state files, which keep the LR scheduler and client state). Single process,
    no collectives: any rank holding a full copy may call it. Returns `out_dir`."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # lazy: slow import

    ok, reason = verify(directory)
    if not ok:
        raise RuntimeError(f"refusing to convert an incomplete checkpoint: {reason}")
    meta = read_meta(directory)
    if int(meta.get("zero_stage") or 0) < 1:
        raise ValueError(f"{directory}: a ZeRO-0 checkpoint is not sharded; load it as it is "
                         "at any world size")
    args = argparse.Namespace(
        input_folder=os.path.join(directory, meta["tag"]), output_folder=os.path.join(out_dir, meta["tag"]),
        num_extract_workers=1, num_merge_workers=1,  # >1 forks a process pool inside a Ray worker
        keep_temp_folder=False, strict=True,
        inject_missing_state=True)  # our model sets no `universal_checkpoint_info`: no TP patterns
    log = io.StringIO()  # the converter prints and draws progress bars: keep them for errors only
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal(args)
    except Exception as e:
        raise RuntimeError(f"{directory}: conversion to a universal checkpoint failed ({e!r}); "
                           f"converter output:\n{log.getvalue()[-2000:]}") from e
    return out_dir


def _load_resized(engine, directory: str, meta: dict[str, Any], load_optimizer: bool) -> TrainState:
    """Collective: one rank per (host, checkpoint path) converts into a temp dir ($TMPDIR, needs
    about the checkpoint's size), the others on that host wait and read the same copy."""
    rank, world = _rank_world()
    key = (socket.gethostname(), os.path.realpath(directory))
    keys = _all_gather(key)
    leader = keys.index(key)  # lowest rank with this host and path
    out, err, t0 = None, None, time.perf_counter()
    if rank == leader:
        # $TMPDIR, not the run directory: a crash must leave nothing among the checkpoints
        tmp = tempfile.mkdtemp(prefix="universal_")
        try:
            out = to_universal(directory, tmp)
        except Exception as e:  # share the failure: the other ranks must not wait forever
            storage.rmtree(tmp, tempfile.gettempdir())  # nor leave a half-converted copy
            err = f"rank {rank}: {e}"
    results = _all_gather((out, err))
    errors = [e for _, e in results if e]
    if errors:
        raise RuntimeError(errors[0])
    out = results[leader][0]
    seconds = time.perf_counter() - t0
    if rank == 0:
        log.info("checkpoint of %d ranks -> %d ranks: converted to universal in %.1f s",
                 meta["world_size"], world, seconds)
    try:
        with _universal_flag(engine, True):
            path, _ = engine.load_checkpoint(out, tag=meta["tag"], load_optimizer_states=load_optimizer,
                                             load_lr_scheduler_states=load_optimizer)
        _check_loaded(path, out, meta["tag"])
        if load_optimizer and engine.zero_optimization_stage() == 3:
            _repair_zero3_load(engine.optimizer.optimizer, os.path.join(out, meta["tag"]))
    except BaseException:
        if rank == leader:  # failing anyway: leave no copy behind
            storage.rmtree(out, tempfile.gettempdir())
        raise
    _all_gather(None)  # every rank on the host has read the copy
    if rank == leader:
        storage.rmtree(out, tempfile.gettempdir())
    _seed_rng(meta, rank)
    return TrainState(**meta["train_state"])


def _repair_zero3_load(optimizer, universal_dir: str) -> None:
    """Undo two slips of DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3) on the torch optimizer it wraps:
    1. every param group gets group 0's hyperparameters: our no-decay group (biases, norms, class
       token, position embedding) would decay; each group gets its own back, as saved;
    2. every sub-group's Adam state gets the *same* `step` tensor, which torch's Adam increments
       in place once per group per step: bias correction would run ahead; each gets a copy."""
    import torch

    for st in optimizer.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].clone()
    sd = torch.load(os.path.join(universal_dir, "zero", "optimizer_state.pt"), weights_only=True)
    saved = sd["optimizer_state_dict"]["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError(
            f"{universal_dir}: the checkpoint has {len(saved)} optimizer param groups, the engine "
            f"{len(optimizer.param_groups)}: resume with the model and optimizer config it was saved with")
    for group, old in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in old.items() if k != "params"})


def _all_gather(obj: Any) -> list[Any]:
    import torch

    if not _distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- run directory


def storage_path(cfg: ExperimentConfig) -> str:
    """Where Ray Train keeps this run's checkpoints: <work_dir>/runs (an absolute path or a URI)."""
    return RunPaths.of(cfg.work_dir).runs


def run_dir(cfg: ExperimentConfig) -> str:
    return RunPaths.of(cfg.work_dir).run(cfg.run_name)


def latest_complete_checkpoint(cfg: ExperimentConfig, warn=None) -> str | None:
    """Newest checkpoint directory of this run that passes `verify`, on local disk or object
    storage, whether or not Ray registered it (a worker killed inside `report` leaves one).
    `warn(line)` is told of each newer one passed over and why."""
    root = run_dir(cfg)
    for name in reversed(storage.listdir(root)):
        if not CHECKPOINT_NAME.match(name):  # e.g. checkpoint_manager_snapshot.json
            continue
        path = join(root, name)
        ok, reason = verify(path)
        if ok:
            return path
        if warn:
            warn(f"passing over {path}: {reason}")
    return None


def data_position(cfg: ExperimentConfig) -> dict[str, Any] | None:
    """The run's data position at its newest complete checkpoint (samples_seen, the worker
    counts it had, its unit_rows), None for a fresh run: where a (re)started attempt's streams
    start (RankStreams)."""
    latest = latest_complete_checkpoint(cfg)
    if latest is None:
        return None
    meta = read_meta(latest)
    state = meta["train_state"]
    return {"samples_seen": int(state["samples_seen"]), "unit_rows": int(state.get("unit_rows") or 0),
            "worlds": state.get("worlds") or [[int(meta["world_size"]), 0]]}


def samples_consumed(cfg: ExperimentConfig) -> int:
    """Images the run consumed (all ranks) up to its newest complete checkpoint, 0 for a fresh run."""
    pos = data_position(cfg)
    return pos["samples_seen"] if pos else 0
