"""Restoring a checkpoint (checkpoint.py's format) into a DeepSpeed engine on every rank: model,
optimizer, LR scheduler, RNG and TrainState. One of another world size (ZeRO-1/2/3 shards) is first
converted to DeepSpeed's universal layout, once per host, and loaded from there; an incomplete one
is never restored, and every file is read as data only (safe_load).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import socket
import tempfile
import time
from typing import Any, Iterator

import numpy as np

from .. import storage
from ..console import get_logger
from ..safe_load import weights_only
from .checkpoint import TrainState, distributed, rank_world, read_meta, verify

log = get_logger(__name__)


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
    rank, world = rank_world()
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


@contextlib.contextmanager
def node_copy(path: str, node: str) -> Iterator[str]:
    """Collective: the checkpoint at `path` as a local directory. From object storage the lowest
    rank of each `node` downloads it ($TMPDIR, the checkpoint's size) and the node's other ranks
    read the same copy, removed once all are done; a local path is used where it is."""
    if not storage.is_uri(path) or path.startswith("file://"):
        yield path.removeprefix("file://")
        return
    rank, _ = rank_world()
    nodes = _all_gather(node)
    leader = nodes.index(node)
    out, err, t0 = None, None, time.perf_counter()
    if rank == leader:
        tmp = tempfile.mkdtemp(prefix="restore_")
        try:
            size = storage.download_dir(path, tmp)
            out = tmp
            log.info("downloaded %s (%.1f MB) in %.1f s for %d rank(s) on this node", path, size / 1e6,
                     time.perf_counter() - t0, nodes.count(node))
        except Exception as e:  # share the failure: the other ranks must not wait forever
            storage.rmtree(tmp, tempfile.gettempdir())
            err = f"rank {rank}: downloading {path} failed: {e}"
    out = _from_leader(leader, out, err)
    try:
        yield out
    except BaseException:
        if rank == leader:
            storage.rmtree(out, tempfile.gettempdir())
        raise
    _all_gather(None)  # every rank on the node is done with the copy
    if rank == leader:
        storage.rmtree(out, tempfile.gettempdir())


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
    said = io.StringIO()  # the converter prints and draws progress bars: keep them for errors only
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal(args)
    except Exception as e:
        raise RuntimeError(f"{directory}: conversion to a universal checkpoint failed ({e!r}); "
                           f"converter output:\n{said.getvalue()[-2000:]}") from e
    return out_dir


def _load_resized(engine, directory: str, meta: dict[str, Any], load_optimizer: bool) -> TrainState:
    """Collective: one rank per (host, checkpoint path) converts into a temp dir ($TMPDIR, needs
    about the checkpoint's size), the others on that host wait and read the same copy."""
    rank, world = rank_world()
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
    out = _from_leader(leader, out, err)
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


def _from_leader(leader: int, out: Any, err: str | None) -> Any:
    """Collective: rank `leader`'s `out` on every rank, or the first rank's `err` raised on all
    (a failure is shared: the other ranks must not wait forever)."""
    results = _all_gather((out, err))
    errors = [e for _, e in results if e]
    if errors:
        raise RuntimeError(errors[0])
    return results[leader][0]


def _all_gather(obj: Any) -> list[Any]:
    import torch

    if not distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
