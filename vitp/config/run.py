"""Run: one experiment resolved once, at the edge where the user's working directory is known: the
validated config with local paths absolute, and the RunPaths of its work_dir. Training, sweeps, few-shot,
the demo and the Train workers take a Run, so none of them validates or re-absolutises again.
Must not import torch or ray.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from .. import storage
from ..errors import ConfigError
from ..paths import RunPaths
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
