"""How long a Train run waits for its gang (the worker group's placement group: one bundle of
resources per worker) and the one line it ends with when the cluster cannot place it. Kept by
Train's controller (controller.py); reads the cluster's nodes, never trains or touches storage.
"""
from __future__ import annotations

import math
import time
from typing import Optional

from ..errors import ClusterError

TIMEOUT_KEY = "parallel.placement_timeout_s"


class GangNotPlaced(ClusterError):
    """The cluster did not place the run's worker group in time, or never can (the autoscaler's
    maximum is smaller than the gang)."""


def _shrink(elastic: bool = False) -> str:
    """The keys that make the gang smaller."""
    workers = "parallel.min_workers" if elastic else "parallel.num_workers"
    return f"lower {workers} / parallel.cpus_per_worker / parallel.gpus_per_worker"


def _resources(amounts: dict[str, float], keys) -> str:
    """{CPU: 8, GPU: 1}: the amounts of `keys` only, in the order the gang asks for them."""
    return "{" + ", ".join(f"{k}: {amounts.get(k, 0):g}" for k in keys) + "}"


def _gang(num_workers: int, per_worker: dict[str, float], min_workers: int = 0) -> str:
    bundles = (f"at least {min_workers} (of up to {num_workers}) bundles" if 0 < min_workers < num_workers
               else f"{num_workers} bundle{'s' if num_workers != 1 else ''}")
    return f"the Train gang needs {bundles} of {_resources(per_worker, per_worker)}"


def _autoscaler_max() -> Optional[dict[str, float]]:
    """The most of each resource the cluster's autoscaler config allows (None without one: a fixed
    cluster, a local Ray), as Ray Train reads it before it starts a worker group."""
    from ray._private.state import state

    try:
        return state.get_max_resources_from_cluster_config() or None
    except Exception:  # noqa: BLE001 - the line is said without it
        return None


def offer(per_worker: dict[str, float]) -> str:
    """What the cluster's live nodes offer against one bundle of `per_worker`: how many bundles fit
    their totals, the largest node, all of them, what is free now, and the autoscaler's maximum."""
    import ray

    keys = list(per_worker)
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    asked = {k: v for k, v in per_worker.items() if v > 0}
    fits = sum(min(math.floor(node.get(k, 0) / v + 1e-9) for k, v in asked.items()) for node in nodes) if asked else 0
    largest = {k: max((node.get(k, 0) for node in nodes), default=0) for k in keys}
    line = (f"the cluster's {len(nodes)} node(s) have room for {fits} such bundles (the largest offers "
            f"{_resources(largest, keys)}; {_resources(ray.cluster_resources(), keys)} in all, "
            f"{_resources(ray.available_resources(), keys)} free now")
    ceiling = _autoscaler_max()
    return line + (f"; the autoscaler's maximum {_resources(ceiling, keys)})" if ceiling else "; no autoscaler)")


def never_fits(num_workers: int, per_worker: dict[str, float], ray_says: BaseException) -> GangNotPlaced:
    """Ray Train's refusal before it waits (the autoscaler's maximum is smaller than the gang), in our line."""
    return GangNotPlaced(f"{_gang(num_workers, per_worker)}, more than the autoscaler can ever offer: "
                         f"{offer(per_worker)}; {_shrink()}, or raise the node groups' maximum "
                         f"(Ray: {' '.join(str(ray_says).split())[:200]})")


class PlacementClock:
    """Seconds the controller has waited for a worker group since it last had one running. Past
    `timeout_s` (parallel.placement_timeout_s; 0 = never) `check` raises GangNotPlaced."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._since: Optional[float] = None

    def waiting(self) -> None:
        """A worker group is wanted (the clock starts unless it runs)."""
        if self._since is None:
            self._since = time.monotonic()

    def placed(self) -> None:
        """A worker group started: the next wait starts from zero."""
        self._since = None

    def check(self, num_workers: int, per_worker: dict[str, float], min_workers: int = 0) -> None:
        """GangNotPlaced, naming the gang, what the cluster offers and the key to raise, once the
        wait has lasted timeout_s."""
        self.waiting()
        waited = time.monotonic() - self._since
        if not self.timeout_s or waited < self.timeout_s:
            return
        elastic = 0 < min_workers < num_workers
        raise GangNotPlaced(f"{_gang(num_workers, per_worker, min_workers)} and was not placed in {waited:.0f} s: "
                            f"{offer(per_worker)}; free or add nodes, {_shrink(elastic)}, or raise {TIMEOUT_KEY} "
                            f"(now {self.timeout_s:g}; 0 waits forever)")
