"""Metric spools left on other nodes, brought to the driver before it ends a run.

Owns the per-node Ray tasks that read and then delete a run's ended spools (tracking/spoolfile.py
owns the files). Must not send anything to MLflow itself: the driver's sender adopts the copies.
"""
from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..tracking.spoolfile import add_leftover, ended_spools, remove_spools

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0  # per round; a node that does not answer keeps its spool for the next start


# The per-node reads and deletes: defined once, placed on one node per call.
_ended_spools = ray.remote(num_cpus=0, max_retries=0)(ended_spools)
_remove_spools = ray.remote(num_cpus=0, max_retries=0)(remove_spools)


def on_node(node_id: str, task, *args):
    """`task` run on node `node_id` only (a per-node read or delete)."""
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)


def gather_spools(run_id: str) -> int:
    """Copy every ended spool of `run_id` on every live node into this process's spool directory
    (as leftovers its sender adopts), then delete the originals that did not change meanwhile.
    A rank 0 that died, or closed while MLflow was down, on a node other than the driver's left
    its unsent metrics there. Returns how many files were brought over; never raises (a node that
    fails keeps its files, and the run's next start or gather takes them)."""
    if not ray.is_initialized():
        return 0
    try:
        return _gather(run_id)
    except Exception as e:  # noqa: BLE001 - e.g. this disk full: the spools stay on their nodes
        log.warning("metric spools of run %s not gathered: %s", run_id, e)
        return 0


def _gather(run_id: str) -> int:
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = {node: on_node(node, _ended_spools, run_id) for node in nodes}
    found: dict[str, list[tuple[str, bytes]]] = {}
    for node, ref in refs.items():  # every node read before any copy is written: the driver's
        try:                        # node would otherwise find (and copy again) copies of others
            found[node] = ray.get(ref, timeout=TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a node lost or slow: its files stay where they are
            log.warning("metric spools of run %s on node %s not gathered: %s", run_id, node[:8], e)
    copied: dict[str, dict[str, int]] = {}
    for node, files in found.items():
        for name, data in files:
            add_leftover(run_id, f"{node[:8]}-{name}", data)
            copied.setdefault(node, {})[name] = len(data)
    for node, files in copied.items():  # copies are on disk here: the originals can go
        try:
            ray.get(on_node(node, _remove_spools, run_id, files), timeout=TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - left there, sent again: the sender drops repeats
            log.warning("metric spools of run %s on node %s copied but not removed: %s", run_id, node[:8], e)
    count = sum(len(f) for f in copied.values())
    if count:
        log.debug("gathered %d metric spool file(s) of run %s from %d node(s)", count, run_id, len(copied))
    return count
