"""Join a Ray cluster, or start a local Ray sized for a config: `connect_ray`; and how much of
Ray's own output a user sees (pipeline.console: errors and our lines, unless `vitp --verbose`).

The one place a command calls `ray.init`. Must not submit jobs or train.
"""
from __future__ import annotations

import os
from typing import Optional

import ray

from ..config import ExperimentConfig
from ..console import library_log_level, quiet_env, verbose
from . import output


def connect_ray(cfg: ExperimentConfig, address: Optional[str] = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS); else start a local Ray sized for `cfg`.

    Locally the CPU count is logical: Train's controller and Ray Data's read/augment tasks need
    slots beside the workers, so we ask for at least workers x cpus_per_worker + 2.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    env = quiet_env()
    os.environ.update(env)  # this process (Ray Data on the driver) and local Ray's workers
    # every Ray process of this job: Ray's and Ray Train's own INFO lines stay in the log files
    logging_config = None if verbose() else ray.LoggingConfig(log_level="WARNING")
    if address:
        # the job's processes get the same environment, but the package (and so the Ray Data
        # YAML) may live elsewhere on the nodes: Ray Data's level instead (its INFO lines then
        # leave ray-data.log as well as the console)
        remote_env = {k: v for k, v in env.items() if k != "RAY_DATA_LOGGING_CONFIG"}
        if env:
            remote_env["RAY_DATA_LOG_LEVEL"] = "WARNING"
        ray.init(address=address, log_to_driver=True, logging_level=library_log_level(),
                 logging_config=logging_config, runtime_env={"env_vars": remote_env})
    else:
        p = cfg.parallel
        need = int(p.num_workers * p.cpus_per_worker + 0.999) + 2
        # the driver's own ray logger at ERROR unless verbose: ray.init's notices (token auth on a
        # local cluster, ...) are not for the user to act on
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 logging_level="INFO" if verbose() else "ERROR", logging_config=logging_config)
    if not verbose():
        output.install()
