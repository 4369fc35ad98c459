"""RunPaths (vitp/paths.py), the one owner of the work_dir layout: what each place is, on a local
work_dir and on object storage, and the default MLflow database only where it can live."""
import os

import pytest

from vitp.errors import ConfigError
from vitp.paths import RunPaths


def test_a_local_work_dir_is_laid_out(tmp_path):
    base = os.path.join(str(tmp_path), "work")
    p = RunPaths(base)
    assert (p.synth, p.shards("digits-train0.2"), p.runs, p.run("r1"), p.sweeps, p.sweep("s1"), p.export) == (
        f"{base}/synth", f"{base}/shards/digits-train0.2", f"{base}/runs", f"{base}/runs/r1",
        f"{base}/sweeps", f"{base}/sweeps/s1", f"{base}/export")
    assert p.mlflow_db() == tmp_path.resolve() / "work" / "mlflow.db"


def test_object_storage_keeps_its_uri_and_has_no_default_database():
    p = RunPaths("s3://bucket/vit")
    assert (p.runs, p.run("r1"), p.shards("fractals")) == (
        "s3://bucket/vit/runs", "s3://bucket/vit/runs/r1", "s3://bucket/vit/shards/fractals")
    with pytest.raises(ConfigError, match=r"work_dir='s3://bucket/vit' is not a local directory.*tracking.uri"):
        p.mlflow_db()
