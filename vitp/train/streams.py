"""What Train's "train" and "val" datasets are: the per-rank training streams (RankStreams, the
DataConfig the trainer hands Train) and the eval dataset factory. Unpickled in Train's controller and
dataset manager, so it imports no torch: those processes would pay its import at every worker-group
start for nothing.
"""
from __future__ import annotations

import copy
from typing import Any

from ray.data import DataContext
from ray.train import DataConfig

from ..config import ExperimentConfig, Run
from ..console import get_logger
from ..data.ingest import build_eval_dataset, build_train_dataset
from ..storage import through_outages
from . import checkpoint as ckpt

_log = get_logger(__name__)


def train_placeholder():
    """Train's "train" dataset entry; RankStreams builds the streams the workers read."""
    import ray.data

    return ray.data.range(0)


class RankStreams(DataConfig):
    """How Train hands out data: rank r of W reads its own deterministic stream (every W-th
    unit of each epoch's order, build_train_dataset(rank, world)), starting right after what
    the run consumed before the newest complete checkpoint, with whatever worker counts it had
    (data/position.py: the rest of an epoch begun with other counts is shared out first). So a
    resumed attempt reads nothing twice and skips nothing; "val" is split as Train does."""

    def __init__(self, cfg_dict: dict[str, Any]):
        ordered = copy.deepcopy(DataContext.get_current().execution_options)
        ordered.preserve_order = True  # a rank's stream in slot order: its position is a prefix
        super().__init__(datasets_to_split=["val"], execution_options={"train": ordered})
        self.cfg_dict = cfg_dict

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        rest = {k: v for k, v in datasets.items() if k != "train"}
        out = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs) \
            if rest else [{} for _ in range(world_size)]
        if "train" in datasets:
            DataContext.get_current().enable_progress_bars = False
            run = Run.from_dict(self.cfg_dict)
            cfg = run.cfg
            share = reader_share(cfg, world_size)
            # in Train's controller, at every worker-group start: a store that cannot be reached
            # for a while (an S3 outage) would otherwise end the run, which Train does not retry
            resume, streams = through_outages(lambda: self._streams(run, world_size), f"run {cfg.run_name}'s "
                                              "data position and shards", _log.warning)
            for r, ds in enumerate(streams):
                options = self._resolve_execution_options("train")
                options.resource_limits = options.resource_limits.copy(cpu=share)
                ds.context.execution_options = options
                out[r]["train"] = ds.iterator()
        return out

    @staticmethod
    def _streams(run: Run, world_size: int):
        resume = ckpt.data_position(run)
        return resume, [build_train_dataset(run, rank=r, world=world_size, resume=resume) for r in range(world_size)]


def reader_share(cfg: ExperimentConfig, world: int) -> float:
    """CPUs one rank's stream may use: an equal part of those the Train workers leave (at least 1).

    Each stream is a Ray Data execution whose autoscaler asks for more CPUs while its reads are
    busy, and Ray Data hands them out first come: uncapped, the first stream of a fixed-size
    cluster took every spare CPU and another had none to run one read task on ("Cluster resources
    are not enough to run any task", benchmarks/data_feed.py)."""
    import ray

    spare = ray.cluster_resources().get("CPU", 0.0) - world * cfg.parallel.cpus_per_worker
    return max(1.0, float(spare // world))


class EvalDatasetFactory:
    def __init__(self, cfg_dict: dict[str, Any]):
        self.cfg_dict = cfg_dict

    def __call__(self):
        DataContext.get_current().enable_progress_bars = False
        run = Run.from_dict(self.cfg_dict)
        return through_outages(lambda: build_eval_dataset(run), f"run {run.name}'s eval shards", _log.warning)
