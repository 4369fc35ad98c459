"""Run: one experiment resolved once, where the user's working directory is known: the validated
config with local paths absolute, and where its things live (checkpoints, shards, MLflow store). The
driver, workers, trials, few-shot and the demo take a Run: none validates or derives a place again.
Must not import torch or ray.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from .. import storage
from ..errors import ConfigError
from ..paths import RunPaths, store_uri
from .schema import ExperimentConfig
from .validate import validate

# the keys that name places on disk (local ones absolute in a Run)
PATH_KEYS = ("work_dir", "data.path", "data.shards", "train.init_from")


@dataclass(frozen=True)
class Run:
    """A validated config whose local paths are absolute, and where its things live (`paths`)."""

    cfg: ExperimentConfig
    paths: RunPaths

    @classmethod
    def resolve(cls, cfg: ExperimentConfig, check_paths: bool = True) -> "Run":
        """`validate(cfg)` (ConfigError listing every problem), paths made absolute: call it once,
        where the config enters (a command, the demo, a sweep's spec)."""
        return cls.of(validate(cfg, check_paths=check_paths))

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> "Run":
        """A config already resolved (a sweep trial's edit of a resolved config): not validated again."""
        return cls(cfg, RunPaths(cfg.work_dir))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Run":
        """The Run a driver resolved, rebuilt from `run.cfg.to_dict()` in a Ray worker."""
        return cls.of(ExperimentConfig.from_dict(dict(d)))

    def __post_init__(self) -> None:
        relative = [f"{key}={value!r}" for key, value in self.path_values().items()
                    if value not in ("", "scratch") and not storage.is_uri(value) and not os.path.isabs(value)]
        if relative:  # in a Ray worker it would name a folder under that worker's own directory
            raise ConfigError(f"{', '.join(relative)}: a relative path in a run that was not resolved where "
                              "it was given: build it with Run.resolve(cfg) in the process that read it")
        if self.paths.work_dir != self.cfg.work_dir:
            raise ConfigError(f"Run paths for {self.paths.work_dir!r} with work_dir={self.cfg.work_dir!r}")

    def path_values(self) -> dict[str, str]:
        c = self.cfg
        return dict(zip(PATH_KEYS, (c.work_dir, c.data.path, c.data.shards, c.train.init_from)))

    @property
    def name(self) -> str:
        return self.cfg.run_name

    @property
    def dir(self) -> str:
        """This run's checkpoints: <work_dir>/runs/<run name>."""
        return self.paths.run(self.cfg.run_name)

    @property
    def dataset(self) -> str:
        """The `dataset` it is tagged with: the source, plus the corpus seed of a synthetic one
        (another seed is another set of classes)."""
        d = self.cfg.data
        return d.source + (f"-seed{d.synth_seed}" if d.source == "synthetic" and d.synth_seed else "")

    @property
    def shards_name(self) -> str:
        """The dataset and the part of its train split it reads: `<dataset>[-trainF]`."""
        fraction = self.cfg.data.train_fraction
        return self.dataset + (f"-train{fraction:g}" if fraction < 1 else "")

    @cached_property
    def shards(self) -> str:
        """Where its shards live: data.shards, or <work_dir>/shards/<shards_name>."""
        return self.cfg.data.shards or self.paths.shards(self.shards_name)

    @cached_property
    def tracking_uri(self) -> str:
        """Its MLflow store as MLflow wants it: tracking.uri (server URL, database URI or path), else
        sqlite:///<work_dir>/mlflow.db (a ConfigError where work_dir is object storage). Nothing is
        made here: a store's folder is made where it is opened (tracking.store.get_client)."""
        uri = self.cfg.tracking.uri
        return store_uri(uri) if uri else f"sqlite:///{self.paths.mlflow_db()}"

    def sweep(self, name: str) -> str:
        """Sweep `name`'s Tune state: <work_dir>/sweeps/<name>."""
        return self.paths.sweep(name)
