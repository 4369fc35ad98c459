"""Checkpoint staging on a node's own disk (uploads.py snapshots into it, then uploads): each staged
copy is named after the process that made it, so copies whose process died (killed mid-upload, a
trial stopped) are found and removed, on this node at every worker start and on every live node
when a driver ends (`clear_dead_everywhere`). A live process's copy is never touched."""
from __future__ import annotations

import logging
import os
import re
import tempfile

import ray

from .. import storage
from ..paths import staging_root

log = logging.getLogger(__name__)

STAGE = re.compile(r"ckpt-\d+-r\d+-p(\d+)-")  # ckpt-<step>-r<rank>-p<pid>-<random>
TIMEOUT_S = 30.0


def new_stage(run_name: str, step: int, rank: int) -> str:
    """An empty directory for this process's snapshot of `run_name`'s checkpoint at `step`."""
    run = os.path.join(staging_root(), run_name)  # the root: this user's only (vitp.paths.private_dir)
    os.makedirs(run, 0o700, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"ckpt-{step}-r{rank}-p{os.getpid()}-", dir=run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def clear_dead() -> list[str]:
    """Remove this node's staged copies whose process is no longer alive; the paths removed."""
    root, gone = staging_root(), []
    for run in (os.listdir(root) if os.path.isdir(root) else []):
        run_dir = os.path.join(root, run)
        for name in (os.listdir(run_dir) if os.path.isdir(run_dir) else []):
            m = STAGE.match(name)
            if m and not _alive(int(m[1])):
                storage.rmtree(os.path.join(run_dir, name), root)
                gone.append(os.path.join(run_dir, name))
    return gone


_clear_dead = ray.remote(num_cpus=0, max_retries=0)(clear_dead)


def clear_dead_everywhere() -> int:
    """clear_dead on every live node of the cluster this driver is connected to (bounded, never
    raises: a node that does not answer is cleared by its next worker start); how many removed."""
    from .spools import on_node

    if not ray.is_initialized():
        return 0
    try:
        refs = [on_node(n["NodeID"], _clear_dead) for n in ray.nodes() if n.get("Alive")]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=TIMEOUT_S)
        gone = [p for ref in ready for p in ray.get(ref)]
    except Exception as e:  # noqa: BLE001 - the copies stay until a worker starts on that node
        log.warning("staged checkpoint copies of dead workers not cleared: %s", e)
        return 0
    if gone:
        log.info("removed %d staged checkpoint copy(ies) of workers that died: %s", len(gone), ", ".join(gone[:3]))
    return len(gone)
