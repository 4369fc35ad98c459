"""The Run a command resolves once: validated, local paths absolute against the directory it was given in,
the same Run rebuilt from its dict in a worker, and a relative path refused where a run was not resolved."""
import dataclasses

import pytest

from vitp.config import ConfigError, Run, set_values
from vitp.paths import RunPaths
from vitp.recipes import with_overrides


def test_resolve_validates_once_and_makes_every_path_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    cfg = with_overrides("debug", ["work_dir=w", "data.path=corpus", "data.shards=sh"])
    run = Run.resolve(cfg)
    assert run.path_values() == {"work_dir": str(tmp_path / "w"), "data.path": str(tmp_path / "corpus"),
                                 "data.shards": str(tmp_path / "sh"), "train.init_from": ""}
    assert run.paths == RunPaths(str(tmp_path / "w"))
    assert run.dir == str(tmp_path / "w" / "runs" / run.cfg.run_name) and run.name == run.cfg.run_name
    with pytest.raises(ConfigError, match="optim.lr"):
        Run.resolve(set_values(cfg, {"optim.lr": -1.0}))


def test_a_worker_rebuilds_the_same_run_from_its_dict_in_another_directory(tmp_path, monkeypatch):
    run = Run.resolve(with_overrides("debug", [f"work_dir={tmp_path}/w", "data.shards=s3://b/shards"]),
                      check_paths=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert Run.from_dict(run.cfg.to_dict()) == run


@pytest.mark.parametrize("key,value", [("work_dir", "w"), ("data.shards", "shards"), ("train.init_from", "x/export")])
def test_a_relative_path_is_refused_where_the_run_was_not_resolved(tmp_path, key, value):
    cfg = with_overrides("debug", [f"work_dir={tmp_path}/w"])
    cfg = set_values(cfg, {key: value})
    with pytest.raises(ConfigError, match=f"{key}='{value}': a relative path .* Run.resolve"):
        Run.of(cfg)
    assert Run.of(set_values(cfg, {key: str(tmp_path / value)})).cfg == set_values(cfg, {key: str(tmp_path / value)})


def test_paths_and_config_cannot_disagree(tmp_path):
    cfg = with_overrides("debug", [f"work_dir={tmp_path}/w"])
    with pytest.raises(ConfigError, match="work_dir"):
        Run(cfg, RunPaths(str(tmp_path / "other")))
    assert dataclasses.replace(Run.of(cfg)).paths.work_dir == str(tmp_path / "w")


def test_training_takes_a_run_not_a_bare_config(tmp_path):
    from vitp.train.trainer import run_training

    with pytest.raises(TypeError, match=r"Run.resolve\(cfg\)"):
        run_training(with_overrides("debug", [f"work_dir={tmp_path}"]))
