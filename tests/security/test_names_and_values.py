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
# Characters that make a name read as something other than what it is: C1 controls, bidi marks,
# embeddings, overrides and isolates, zero-width characters and the BOM, line/paragraph separators,
# the soft hyphen (invisible unless a line breaks there).
HIDDEN = ["\x80", "\x85", "\x9b", "\x9f", *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A)),
          "\u200e", "\u200f", "\u061c", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u2028", "\u2029",
          "\u00ad"]


@pytest.mark.parametrize("name", HOSTILE)
def test_path_like_names_are_refused(name):
    assert name_problem(name)
    with pytest.raises(ConfigError, match=r"^--name="):
        check_name("--name", name)


@pytest.mark.parametrize("name", ["b16_i21k", "transfer-h14_i21k", "run.2", "my run", "n" * MAX_LEN,
                                  "\u00e9t\u00e9-run", "\u65e5\u672c\u8a9e", "\u00e9" * (MAX_LEN // 2),
                                  "\U0001d538" * (MAX_LEN // 4)])
def test_ordinary_names_pass(name):
    assert name_problem(name) is None and check_name("--name", name) == name


@pytest.mark.parametrize("char", HIDDEN, ids=[f"U+{ord(c):04X}" for c in HIDDEN])
def test_invisible_and_control_characters_are_refused(char):
    for name in (f"run{char}1", f"{char}run", f"run{char}"):
        problem = name_problem(name)
        assert problem and f"U+{ord(char):04X}" in problem, (name, problem)
        with pytest.raises(ConfigError) as e:
            check_name("--name", name)
        assert char not in str(e.value)  # shown escaped: the line says what the name really holds


@pytest.mark.parametrize("name, size", [("\u00e9" * (MAX_LEN // 2 + 1), MAX_LEN + 2),
                                        ("\U0001d538" * (MAX_LEN // 4 + 1), MAX_LEN + 4),
                                        ("\u65e5" * 43, 129)])
def test_the_length_limit_counts_utf8_bytes(name, size):
    """A 255-byte path component is the usual filesystem limit: 128 characters of 4 bytes each is 512."""
    assert len(name) <= MAX_LEN
    assert name_problem(name) == (f"is {size} bytes long in UTF-8 (at most {MAX_LEN}: a path component's limit "
                                  "is counted in bytes)")


@pytest.mark.parametrize("key", ["tracking.run_name", "tracking.experiment", "tracking.run_prefix"])
@pytest.mark.parametrize("char", ["\u202e", "\x85", "\u200b", "\u2066", "\ufeff"])
def test_hidden_characters_in_config_names_are_refused_by_every_command(key, char, capsys):
    name = f"run{char}x"
    with pytest.raises(ConfigError, match=f"{key}={name!r}".replace("\\", "\\\\")):
        resolve("debug", [f"{key}={name}"])
    assert main(["config", "debug", "--set", f"{key}={name}"]) == 2
    err = capsys.readouterr().err
    assert f"{key}={name!r}" in err and char not in err and "Traceback" not in err


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


@pytest.mark.parametrize("key,value,says", [
    ("data.std", "0.5,0.5,nan", "data.std[2]=nan: must be a finite number"),
    ("data.std", "inf,0.5,0.5", "data.std[0]=inf: must be a finite number"),
    ("data.mean", "0.5,-inf,0.5", "data.mean[1]=-inf: must be a finite number"),
    ("data.std", "0,0.5,0.5", "data.std[0]=0.0: must be in (0, 1]"),
    ("data.std", "0.5,-0.2,0.5", "data.std[1]=-0.2: must be in (0, 1]"),
    ("data.storage_size", "0", "data.storage_size=0: must be in 8..8192"),
    ("data.storage_size", "-5", "data.storage_size=-5: must be in 8..8192"),
    ("data.num_classes", "-1", "data.num_classes=-1: must be >= 0"),
    ("model.representation_size", "-1", "model.representation_size=-1: must be in 0..65536"),
    ("tune.num_samples", "-1", "tune.num_samples=-1: must be >= 1"),
    ("tune.trial_retries", "-1", "tune.trial_retries=-1: must be >= 0"),
    ("tune.max_concurrent_trials", "-1", "tune.max_concurrent_trials=-1: must be >= 0"),
    ("tune.perturbation_interval", "-1", "tune.perturbation_interval=-1: must be >= 0"),
    ("tune.startup_trials", "-1", "tune.startup_trials=-1: must be >= 0"),
    ("data.image_size", "1000000", "data.image_size=1000000: must be in 8..4096"),
    ("model.num_classes", "2000000", "model.num_classes=2000000: must be at most 1000000"),
    ("train.steps", "1e9", "train.steps=1000000000: must be at most 10000000"),
    ("train.max_failures", "-1", "train.max_failures=-1: must be >= 0")])
def test_values_the_schema_allowed_but_nothing_can_use_are_refused(key, value, says, capsys):
    with pytest.raises(ConfigError) as e:
        resolve("debug", [f"{key}={value}"])
    assert says in str(e.value)
    assert main(["config", "debug", "--set", f"{key}={value}"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize("override, space, says", [
    ("tune.num_samples=-1", None, "tune.num_samples=-1: must be >= 1"),
    ("tune.trial_retries=-1", None, "tune.trial_retries=-1: must be >= 0"),
    ("tune.max_concurrent_trials=-1", None, "tune.max_concurrent_trials=-1: must be >= 0"),
    ("tune.startup_trials=-1", None, "tune.startup_trials=-1: must be >= 0"),
    ("tune.perturbation_interval=-1", None, "tune.perturbation_interval=-1: must be >= 0"),
    ("train.steps=30", {"data.std": [[0.5, 0.5, math.nan]]}, "data.std[2]=nan: must be a finite number"),
    ("train.steps=30", {"data.image_size": [32, 1_000_000]}, "data.image_size=1000000: must be in 8..4096")])
def test_a_sweep_checks_its_tune_section_and_space_values(tmp_path, override, space, says):
    """The sweep's edge (build_spec) validates every probe trial, tune.* included, before Ray starts."""
    from vitp.recipes import with_overrides
    from vitp.tune.spec import build_spec

    overrides = [f"work_dir={tmp_path}/w", override]
    with pytest.raises(ConfigError) as e:
        build_spec("s", with_overrides("debug_finetune", overrides), "debug_finetune", overrides, extra_space=space)
    assert says in str(e.value) and "sweep trial" in str(e.value)
