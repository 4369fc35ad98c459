"""Join a Ray cluster, or start a local Ray sized for a config: `connect_ray`.

The one place a command calls `ray.init`. Must not submit jobs or train.
"""
from __future__ import annotations

import os
from typing import Optional

import ray

from ..config import ExperimentConfig


def connect_ray(cfg: ExperimentConfig, address: Optional[str] = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS); else start a local Ray sized for `cfg`.

    Locally the CPU count is logical: Train's controller and Ray Data's read/augment tasks need
    slots beside the workers, so we ask for at least workers x cpus_per_worker + 2.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    p = cfg.parallel
    need = int(p.num_workers * p.cpus_per_worker + 0.999) + 2
    ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
             logging_level="WARNING")
