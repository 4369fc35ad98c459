"""Config validation names the field and the fix, collects every problem, makes paths absolute."""
import os

import pytest

from pipeline.config import ConfigError, apply_overrides, validate
from pipeline.model.variants import VARIANTS
from pipeline.recipes import debug


def _invalid(**overrides):
    return apply_overrides(debug(), [f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("overrides, needles", [
    ({"data.image_size": 30}, ["data.image_size=30", "patch size 8", "multiple of 8"]),
    ({"parallel.global_batch": 64}, ["global_batch 64 != micro 16 x accum 1 x world 2 = 32",
                                    "parallel.grad_accum=2"]),
    ({"parallel.global_batch": 48}, ["global_batch 48", "set parallel.global_batch=32"]),
    ({"parallel.zero_stage": 4}, ["parallel.zero_stage=4", "0, 1, 2 or 3"]),
    ({"parallel.offload_params": "true"}, ["offload_params", "zero_stage=3"]),
    ({"model.variant": "Q/16"}, ["model.variant='Q/16'", "B/<patch>"]),
    ({"data.source": "imagefolder", "data.path": "/no/such/dir"}, ["data.path='/no/such/dir' does not exist"]),
    ({"train.init_from": "/no/such/ckpt"}, ["train.init_from", "scratch"]),
    ({"optim.warmup_steps": 1000}, ["optim.warmup_steps=1000", "train.steps=60"]),
    ({"tune.space": '{"optim.nope": [1]}'}, ["tune.space key 'optim.nope'"]),
])
def test_validation_names_field_and_fix(overrides, needles):
    with pytest.raises(ConfigError) as e:
        validate(_invalid(**overrides))
    for needle in needles:
        assert needle in str(e.value)


def test_the_corpus_path_is_asked_for_by_preprocess_only(tmp_path):
    """Training from shards needs no data.path (the documented `vitp pretrain h14_i21k --set
    data.shards=s3://...`); preprocessing without one says which key to set."""
    from pipeline.data.commands import run_preprocess
    from pipeline.errors import InputError
    from pipeline.recipes import resolve

    cfg = resolve("h14_i21k", ["data.shards=s3://bucket/imagenet21k-shards"])
    assert cfg.data.path == "" and cfg.data.source == "parquet"
    with pytest.raises(InputError, match=r"data.source='imagefolder' reads files: set --set data.path="):
        run_preprocess(resolve("debug", ["data.source=imagefolder", f"data.shards={tmp_path}"]), log=lambda s: None)


def test_heads_must_divide_width():
    VARIANTS["odd"] = (1, 30, 60, 4)
    try:
        with pytest.raises(ConfigError, match="heads 4 do not divide width 30"):
            validate(_invalid(**{"model.variant": "odd/8"}))
    finally:
        del VARIANTS["odd"]


def test_validation_collects_every_problem():
    with pytest.raises(ConfigError) as e:
        validate(_invalid(**{"data.image_size": 30, "parallel.zero_stage": 5}))
    assert "data.image_size" in str(e.value) and "parallel.zero_stage" in str(e.value)


def test_validate_returns_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    cfg = _invalid(**{"work_dir": "runs", "data.shards": "s3://bucket/shards", "train.init_from": "ckpt"})
    out = validate(cfg)
    assert out.work_dir == os.path.join(str(tmp_path), "runs")
    assert out.train.init_from == os.path.join(str(tmp_path), "ckpt")
    assert out.data.shards == "s3://bucket/shards" and out.data.path == ""
    assert cfg.work_dir == "runs"  # the input is not modified
    assert validate(_invalid(**{"train.init_from": "scratch"})).train.init_from == "scratch"
