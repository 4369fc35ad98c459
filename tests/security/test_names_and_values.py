"""Names are names, deletes stay inside their root, numbers are finite: hostile values are
refused at the edge (config validation, the CLI) with one line naming the key and the fix."""
import math
import os

import pytest

from vitp import storage
from vitp.cli import main
from vitp.errors import ConfigError
from vitp.names import MAX_LEN, check_name, name_problem
from vitp.recipes import resolve

HOSTILE = ["/root", "..", ".", "a/../../..", "..\\x", "-rf", ".hidden", "a\x00b", "x\ny", "",
           "n" * (MAX_LEN + 1)]


@pytest.mark.parametrize("name", HOSTILE)
def test_path_like_names_are_refused(name):
    assert name_problem(name)
    with pytest.raises(ConfigError, match=r"^--name="):
        check_name("--name", name)


@pytest.mark.parametrize("name", ["b16_i21k", "transfer-h14_i21k", "run.2", "my run", "n" * MAX_LEN])
def test_ordinary_names_pass(name):
    assert name_problem(name) is None and check_name("--name", name) == name


@pytest.mark.parametrize("key", ["tracking.run_name", "tracking.experiment"])
@pytest.mark.parametrize("name", ["/root", "..", "a/../../.."])
def test_config_names_are_refused_by_every_command(key, name, capsys):
    with pytest.raises(ConfigError, match=rf"{key}={name!r}"):
        resolve("debug", [f"{key}={name}"])
    assert main(["config", "debug", "--set", f"{key}={name}"]) == 2
    err = capsys.readouterr().err
    assert f"{key}={name!r}" in err and "Traceback" not in err


def test_fewshot_dataset_names_are_names_and_paths_are_paths():
    with pytest.raises(ConfigError, match=r"train.fewshot_datasets='\.\.'"):
        resolve("debug", ["train.fewshot_every=5", "train.fewshot_datasets=digits,.."])
    resolve("debug", ["train.fewshot_every=5", "train.fewshot_datasets=digits,/data/shards/pets"])


def test_sweep_and_registered_model_names_are_refused_before_any_work(tmp_path, capsys):
    assert main(["sweep", "debug_finetune", "--name", "../../x",
                 "--set", f"work_dir={tmp_path}"]) == 2
    assert "--name='../../x'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing made: refused before Ray or any directory
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "no-such-checkpoint"), "--out", str(out),
                 "--register", "a/b"]) == 2
    assert "--register='a/b'" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("key,value", [("optim.lr", "nan"), ("optim.grad_clip", "inf"),
                                       ("tracking.log_timeout_s", "nan"), ("optim.weight_decay", "-inf"),
                                       ("model.dropout", "nan")])
def test_non_finite_numbers_are_refused(key, value, capsys):
    with pytest.raises(ConfigError, match=rf"{key}={value}: must be a finite number"):
        resolve("debug", [f"{key}={value}"])
    assert main(["config", "debug", "--set", f"{key}={value}"]) == 2
    assert "finite" in capsys.readouterr().err
    assert not math.isfinite(float(value))


def test_recursive_delete_stays_inside_its_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep").write_text("x")
    os.symlink(outside, root / "link")  # inside by name, outside in fact
    for path in [str(outside), str(root / ".." / "outside"), str(root / "link"), str(tmp_path)]:
        with pytest.raises(ValueError, match=r"refusing to delete .*: it is not inside"):
            storage.rmtree(path, str(root))
    assert (outside / "keep").exists() and (root / "run").exists()
    for uri, owned in [("s3://b/root/../x", "s3://b/root"), ("s3://other/root/x", "s3://b/root"),
                       ("s3://b/rootx", "s3://b/root"), (str(root / "run"), "s3://b/root")]:
        assert not storage.within(uri, owned), uri
    assert storage.within("s3://b/root/run/", "s3://b/root") and storage.within("s3://b/root", "s3://b/root/")
    storage.rmtree(str(root / "run"), str(root))
    assert not (root / "run").exists() and (outside / "keep").exists()


@pytest.mark.parametrize("key,value,why", [
    ("model.dropout", "1.0", r"must be in \[0, 1\)"), ("model.attn_dropout", "-0.1", r"must be in \[0, 1\)"),
    ("optim.beta2", "1.5", r"must be in \[0, 1\)"), ("optim.momentum", "1", r"must be in \[0, 1\)"),
    ("optim.min_lr_ratio", "2", r"must be in \[0, 1\]"), ("optim.weight_decay", "-0.1", r"must be in \[0, inf\)"),
    ("data.shard_mb", "0", "must be > 0"), ("parallel.cpus_per_worker", "-1", "must be > 0"),
    ("train.device_peak_tflops", "0", "must be > 0"), ("tracking.log_timeout_s", "0", "must be > 0")])
def test_values_outside_their_meaning_are_refused(key, value, why):
    with pytest.raises(ConfigError, match=rf"{key}={value}\S*:? {why}"):
        resolve("debug", [f"{key}={value}"])


def test_range_bounds_that_mean_something_pass():
    cfg = resolve("debug", ["model.dropout=0", "optim.min_lr_ratio=1", "optim.weight_decay=0", "optim.beta2=0.9999"])
    assert (cfg.model.dropout, cfg.optim.min_lr_ratio) == (0.0, 1.0)
