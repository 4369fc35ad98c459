"""Which run a re-run continues (vitp/train/rerun.py): the same settings continue the stored run; a
derived name with other settings gets its settings hash; a run the user named is refused; an
experiment file names its runs after itself. Checkpoints are planted as the meta.json a run writes."""
import dataclasses

import pytest

from vitp.config import ConfigError, Run
from vitp.recipes import resolve
from vitp.train.rerun import changed_settings, ignored_settings, run_to_continue, settings_hash
from vitp.tracking.redact import redact
from vitp.tracking.values import params_for_mlflow


def _run(tmp_path, *sets) -> Run:
    return Run.resolve(resolve("debug", [f"work_dir={tmp_path}", *sets], check_paths=False), check_paths=False)


def _stored(run: Run, step: int = 60) -> dict:
    """The meta.json of a run's final checkpoint, as the checkpoint writer records it."""
    return {"step": step, "config": redact(run.cfg.to_dict())}


def _param(run: Run, key: str) -> str:
    return params_for_mlflow(run.cfg.to_dict())[key]


def _where(stored: dict[str, dict]):
    """The lookup run_to_continue makes, over planted checkpoints named by run name."""
    def where(run):
        meta = stored.get(run.name)
        return (f"{run.dir}/checkpoint_00000060" if meta else None), meta
    return where


def test_the_same_settings_continue_the_stored_run(tmp_path):
    first = _run(tmp_path)
    again = _run(tmp_path, "train.steps=90", "parallel.num_workers=1")  # continuable: same run
    run, existing, meta = run_to_continue(again, _where({first.name: _stored(first)}))
    assert run is again and existing.endswith("checkpoint_00000060") and meta["step"] == 60


def test_a_derived_name_with_other_settings_gets_its_settings_hash_and_keeps_it(tmp_path, caplog):
    first = _run(tmp_path)
    other = _run(tmp_path, "optim.lr=0.01")
    stored = {first.name: _stored(first)}
    run, existing, meta = run_to_continue(other, _where(stored))
    assert run.name == f"{first.name}-{settings_hash(other.cfg)}" and existing is None and meta is None
    assert run.dir.endswith(f"/runs/{run.name}") and run.cfg.optim.lr == 0.01
    assert f"optim.lr=0.01 (was {_param(first, 'optim.lr')})" in caplog.text and run.name in caplog.text
    # the same command again lands on that run, continued once it has a checkpoint
    stored[run.name] = _stored(run, step=20)
    again, existing, meta = run_to_continue(_run(tmp_path, "optim.lr=0.01"), _where(stored))
    assert again.name == run.name and meta["step"] == 20
    # another setting, another run; the continuable keys are not part of the hash
    assert settings_hash(_run(tmp_path, "optim.lr=0.02").cfg) != settings_hash(other.cfg)
    assert settings_hash(_run(tmp_path, "optim.lr=0.01", "train.steps=7").cfg) == settings_hash(other.cfg)


def test_a_named_run_with_other_settings_is_refused_in_one_line(tmp_path):
    first = _run(tmp_path, "tracking.run_name=mine")
    with pytest.raises(ConfigError) as e:
        run_to_continue(_run(tmp_path, "tracking.run_name=mine", "optim.lr=0.01", "model.dropout=0.1"),
                        _where({"mine": _stored(first)}))
    line = str(e.value)
    assert "\n" not in line and "tracking.run_name='mine' already holds a run with other settings" in line
    assert f"model.dropout=0.1 (was {_param(first, 'model.dropout')})" in line
    assert f"optim.lr=0.01 (was {_param(first, 'optim.lr')})" in line


def test_a_copied_final_state_and_old_configs_are_no_difference(tmp_path):
    first = _run(tmp_path)
    other = _run(tmp_path, "optim.lr=0.01")
    copied = {**_stored(first), "copied_from": "elsewhere"}  # a population's exploit
    assert run_to_continue(other, _where({first.name: copied}))[0] is other
    old = _stored(first)
    del old["config"]["optim"]["lr"]  # written before the key existed
    assert changed_settings(old["config"], other.cfg) == []


def test_a_secret_is_compared_as_it_was_stored(tmp_path, monkeypatch):
    first = _run(tmp_path, "tracking.tags={\"api_token\": \"abc123456\"}")
    assert run_to_continue(first, _where({first.name: _stored(first)}))[0] is first  # "***" both sides


def test_a_finished_run_names_the_settings_it_ignores(tmp_path):
    first = _run(tmp_path)
    assert ignored_settings(_stored(first), first.cfg) == ""
    fewer = _run(tmp_path, "parallel.num_workers=1")
    assert f"parallel.num_workers=1 (was {first.cfg.parallel.num_workers})" in ignored_settings(
        _stored(first), fewer.cfg)


def test_an_experiment_file_names_its_runs_after_itself(tmp_path):
    f = tmp_path / "lr-probe.yaml"
    f.write_text("recipe: debug\noptim: {lr: 0.01}\n")
    cfg = resolve(str(f), check_paths=False)
    assert cfg.recipe == "debug" and cfg.run_name == "lr-probe-pico8-synthetic"
    assert resolve("debug", check_paths=False).run_name == "debug-pico8-synthetic"
    named = tmp_path / "named.yaml"
    named.write_text("recipe: debug\ntracking: {run_prefix: b16}\n")
    assert resolve(str(named), check_paths=False).run_name == "b16-pico8-synthetic"
    assert dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, run_name="x")).run_name == "x"
