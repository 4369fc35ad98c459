"""Run a function on N local processes joined in a torch.distributed group, without Ray.

For single-node benchmarks and for engine/loop tests on CPU with gloo. `fn(rank, world, *args)`
must be a module-level function; results come back in rank order. Ranks fork from a forkserver
that imported torch and DeepSpeed once (see PRELOAD), with the launcher's environment at launch.
"""
from __future__ import annotations

import os
import tempfile
import traceback
from multiprocessing import reduction
from typing import Any, Callable

import torch.multiprocessing as mp

from ..console import get_logger
from ..net import free_port

log = get_logger(__name__)

# Imported once in the forkserver before any rank is forked from it: a 2-rank launch of a function that
# imports both took 3.5 s spawned, 0.03 s forked (2.4 s for the first, which starts the forkserver).
# Forking after these imports is what torch's DataLoader workers do; no CPU thread pool has run here.
# A rank takes the launcher's environment, cwd, sys.path and stdout/stderr at launch time, as a
# spawned process would, not the forkserver's from when it started.
# The last two are what the first engine build of a process imports: every torch optimizer's
# constructor imports torch._dynamo, and DeepSpeed's ZeRO optimizer check its Muon module (which
# imports inductor); 3.3 s of a 5.1 s first build of a pico ZeRO-3 engine, now paid once.
# (A name that no longer imports is skipped by the forkserver.)
PRELOAD = ["torch", "torch.distributed", "deepspeed", "torch._dynamo",
           "deepspeed.runtime.zero.muon.muon_optimizer"]


class _LauncherStdio:
    """Sent to a rank as the launcher's stdout and stderr at launch time (their file descriptors go
    along with the process object); on arrival they replace the rank's own, which it inherited from
    the forkserver. So a rank prints where a spawned one would: a terminal, a log, pytest's capture."""

    def __reduce__(self):
        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out, err) -> None:
    for fd, dup in ((1, out), (2, err)):
        src = dup.detach()
        os.dup2(src, fd)
        os.close(src)


def _entry(rank: int, world: int, port: int, env: dict[str, str], stdio: None, fn: Callable, args: tuple,
           queue) -> None:
    os.environ.clear()
    os.environ.update(env)  # the launcher's, now (the forkserver's dates from its start)
    tempfile.tempdir = None  # re-read TMPDIR
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report, don't hang the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600,
           port_retries: int = 2) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned processes; returns their results.

    The rendezvous port is picked free but bound only once rank 0 sets up its store, seconds
    later; if another process took it meanwhile ("address already in use"), the launch is
    retried on a new port up to `port_retries` times.
    """
    retries = 0
    while True:
        try:
            return _launch_once(fn, world_size, args, timeout, free_port())
        except RuntimeError as e:
            if retries == port_retries or "address already in use" not in str(e).lower():
                raise
            retries += 1
            log.warning("rendezvous port taken before rank 0 bound it; retrying on another (%.200s)", e)


def _launch_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, port: int) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts (first launch)
    queue = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, env, _LauncherStdio(), fn, args, queue),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
