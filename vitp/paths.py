"""RunPaths: the one owner of the work_dir layout (rendered corpus, shards, runs and their checkpoints,
sweeps, the demo's export, the default MLflow database) and of the node-local folders beside it
(checkpoint staging, the metrics spool). Every module asks here instead of joining names onto work_dir.
A sink: imports only storage and errors (no config, torch or ray).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import storage
from .errors import ConfigError


@dataclass(frozen=True)
class RunPaths:
    """Where things live under one work_dir (a local path, made absolute, or a URI):

    <work_dir>/synth              the rendered synthetic corpus (vitp synth)
    <work_dir>/shards/<name>      a dataset's Parquet shards (name: source[-seedN][-trainF])
    <work_dir>/runs/<run>         a run's checkpoints (Ray Train's storage path is <work_dir>/runs)
    <work_dir>/sweeps/<sweep>     a sweep's Tune state
    <work_dir>/export             the demo's pre-trained export
    <work_dir>/mlflow.db          the default MLflow store (local work_dir only)
    """

    work_dir: str

    @classmethod
    def of(cls, work_dir: str) -> "RunPaths":
        return cls(storage.abspath(work_dir))

    @property
    def synth(self) -> str:
        return storage.join(self.work_dir, "synth")

    def shards(self, name: str) -> str:
        return storage.join(self.work_dir, "shards", name)

    @property
    def runs(self) -> str:
        return storage.join(self.work_dir, "runs")

    def run(self, name: str) -> str:
        return storage.join(self.runs, name)

    @property
    def sweeps(self) -> str:
        return storage.join(self.work_dir, "sweeps")

    def sweep(self, name: str) -> str:
        return storage.join(self.sweeps, name)

    @property
    def export(self) -> str:
        return storage.join(self.work_dir, "export")

    def mlflow_db(self) -> Path:
        """The default SQLite store's file; a ConfigError where work_dir is object storage."""
        if storage.is_uri(self.work_dir) and not self.work_dir.startswith("file://"):
            raise ConfigError(
                f"work_dir={self.work_dir!r} is not a local directory, so the default SQLite MLflow "
                "store cannot live there: set --set tracking.uri=http://<mlflow-server>:5000 "
                "(or a database URI)")
        return Path(self.work_dir.removeprefix("file://")).expanduser().resolve() / "mlflow.db"


# Node-local folders (never shared between nodes, never in work_dir): under the temp dir.
def staging_root() -> str:
    """Where Train workers stage a checkpoint before Ray copies it to the run's storage."""
    return os.path.join(tempfile.gettempdir(), "vitp-ckpt-staging")


def spool_root() -> str:
    """Where rank 0 spools MLflow metrics it could not send yet (the default of tracking.spool_dir)."""
    return os.path.join(tempfile.gettempdir(), "vitp-mlflow-spool")
