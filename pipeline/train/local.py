"""Run a function on N local processes joined in a torch.distributed group, without Ray.

For single-node benchmarks (one process per GPU) and for tests of the engine/loop on CPU with
gloo. `fn(rank, world, *args)` must be importable (a module-level function); each rank's
return value comes back in rank order.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from ..net import free_port


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
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
            print(f"rendezvous port taken before rank 0 bound it; retrying on another ({e!s:.200})",
                  flush=True)


def _launch_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, port: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False)
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
