"""Experiment files (`vitp pretrain my-exp.yaml`): a base recipe plus the keys a user changes, as
sections or dotted `set:` keys; a printed config loads back as it is; bad files are one line."""
import json

import pytest

from vitp.config import ConfigError
from vitp.errors import InputError
from vitp.recipes import resolve


def test_sections_and_set_keys_apply_over_the_base_recipe_and_then_set_wins(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("recipe: debug\noptim:\n  lr: 0.01\n  warmup_steps: 3\nset:\n  optim.lr: 0.02\n"
                 "  train.steps: 30\n  tracking.tags: {team: vision}\n")
    cfg = resolve(str(f), ["train.steps=31"], check_paths=False)
    base = resolve("debug", check_paths=False)
    assert cfg.recipe == "debug" and cfg.optim.lr == 0.02 and cfg.optim.warmup_steps == 3
    assert cfg.train.steps == 31 and cfg.tracking.tags == {"team": "vision"}  # --set over the file
    assert cfg.model == base.model and cfg.data == base.data  # the rest is the recipe's


def test_a_printed_config_loads_back_as_it_is(tmp_path):
    cfg = resolve("debug", ["optim.lr=0.02", "parallel.num_workers=1", f"work_dir={tmp_path}"],
                  check_paths=False)
    for name, text in (("exp.json", cfg.to_json()), ("exp.yml", json.dumps(cfg.to_dict()))):
        (tmp_path / name).write_text(text)
        assert resolve(str(tmp_path / name), check_paths=False) == cfg, name


def test_a_worker_count_in_a_file_derives_the_accumulation(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("recipe: debug\nparallel: {num_workers: 1}\n")
    p = resolve(str(f), check_paths=False).parallel
    assert p.num_workers == 1 and p.micro_batch * p.grad_accum == p.global_batch


def test_a_list_of_names_reads_as_set_reads_it(tmp_path):
    """`fewshot_datasets: digits` (or "digits, pets") in a file is what `--set
    train.fewshot_datasets=digits` gives: the list's one name, not a refusal."""
    f = tmp_path / "exp.yaml"
    for text, want in (("digits", ("digits",)), ("digits, pets", ("digits", "pets")), ("[digits, pets]", ("digits", "pets"))):
        f.write_text(f"recipe: debug\ntrain:\n  fewshot_every: 2\n  fewshot_datasets: {text}\n")
        assert resolve(str(f), check_paths=False).train.fewshot_datasets == want, text
        if not text.startswith("["):  # (--set reads a list as JSON: ["digits","pets"])
            assert resolve("debug", [f"train.fewshot_datasets={text}"]).train.fewshot_datasets == want, text
    f.write_text("recipe: debug\ntrain: {fewshot_datasets: 3}\n")
    with pytest.raises(ConfigError, match=r"train.fewshot_datasets=3: expected a list$"):
        resolve(str(f), check_paths=False)


@pytest.mark.parametrize("text, error, needle", [
    ("- a\n- b\n", InputError, "an experiment file is a mapping: `recipe: NAME`"),
    ("optim: {lr: 0.1}\n", InputError, "`recipe: NAME`"),
    ("recipe: debug\noptim: {lr: [\n", InputError, "not YAML or JSON at line 3"),
    ("recipe: debug\nset: [optim.lr]\n", InputError, "`set:` maps dotted keys to values"),
    ("recipe: debug\noptim: {lrr: 1}\n", ConfigError, "did you mean 'optim.lr'"),
    ("recipe: no_such\n", ConfigError, "unknown recipe 'no_such'"),
    ("recipe: exp.yaml\n", InputError, "a file's base is a built-in recipe"),  # (itself: no loop)
    ("recipe: debug\noptim: {lr: fast}\n", ConfigError, "optim.lr"),
    ("recipe: debug\nx: !!python/object/apply:os.system [echo hi]\n", InputError, "not YAML or JSON"),
])
def test_a_bad_file_is_named_with_what_to_fix(tmp_path, text, error, needle):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    with pytest.raises(error) as e:
        resolve(str(f), check_paths=False)
    assert needle in str(e.value)


def test_a_file_on_object_storage(s3, tmp_path):
    bucket = s3.bucket()
    s3.client().put_object(Bucket=bucket.removeprefix("s3://"), Key="exps/exp.yaml",
                           Body=b"recipe: debug\nset: {optim.lr: 0.02}\n")
    assert resolve(f"{bucket}/exps/exp.yaml", check_paths=False).optim.lr == 0.02
