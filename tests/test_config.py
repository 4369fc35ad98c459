"""Config: overrides are typed, unknown keys are rejected, validation names field and fix."""
import pytest

from pipeline.config import (ConfigError, ExperimentConfig, apply_overrides, decode_variant,
                             flatten, valid_keys, validate)
from pipeline.recipes import debug


def test_overrides_are_typed():
    cfg = apply_overrides(debug(), ["optim.lr=0.003", "parallel.zero_stage=3", "data.hflip=false",
                                    "model.representation_size=128", "data.mean=0.1,0.2,0.3",
                                    'tune.space={"optim.lr": [0.1, 0.2]}'])
    assert cfg.optim.lr == 0.003 and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.zero_stage == 3 and isinstance(cfg.parallel.zero_stage, int)
    assert cfg.data.hflip is False
    assert cfg.model.representation_size == 128
    assert cfg.data.mean == (0.1, 0.2, 0.3)
    assert cfg.tune.space == {"optim.lr": [0.1, 0.2]}
    cfg = apply_overrides(cfg, ["model.representation_size=none"])
    assert cfg.model.representation_size is None


@pytest.mark.parametrize("item, needle", [
    ("parallel.zero_stage=two", "expected an integer"),
    ("optim.lr=fast", "expected a number"),
    ("data.hflip=maybe", "expected true or false"),
    ("parallel.precision=fp8", "one of 'bf16', 'fp16', 'fp32'"),
    ("optim.lr", "expected KEY=VALUE"),
    ("data.mean=1,2", "exactly 3 values"),
])
def test_bad_override_values(item, needle):
    with pytest.raises(ConfigError, match=needle):
        apply_overrides(debug(), [item])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        apply_overrides(debug(), ["optim.learning_rate=0.1"])
    msg = str(e.value)
    assert "optim.learning_rate" in msg and "optim.lr" in msg and "parallel.zero_stage" in msg
    with pytest.raises(ConfigError, match="is a section"):
        apply_overrides(debug(), ["optim=1"])
    with pytest.raises(ConfigError, match="unknown config key"):
        ExperimentConfig.from_dict({"optim": {"lr": 0.1, "bogus": 1}})


def test_round_trip_exact():
    cfg = apply_overrides(debug(), ["data.mean=0.1,0.2,0.3", "model.representation_size=7"])
    d = cfg.to_dict()
    back = ExperimentConfig.from_dict(d)
    assert back == cfg
    assert back.to_dict() == d


def test_flatten_for_mlflow():
    flat = flatten(debug().to_dict())
    assert flat["optim.lr"] == 1e-3 and flat["parallel.zero_stage"] == 2
    assert set(valid_keys()) <= set(flat)


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
    ({"data.source": "imagefolder"}, ["data.path is empty", "--set data.path="]),
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


def test_heads_must_divide_width():
    from pipeline import config

    config.VARIANTS["odd"] = (1, 30, 60, 4)
    try:
        with pytest.raises(ConfigError, match="heads 4 do not divide width 30"):
            validate(_invalid(**{"model.variant": "odd/8"}))
    finally:
        del config.VARIANTS["odd"]


def test_validation_collects_every_problem():
    with pytest.raises(ConfigError) as e:
        validate(_invalid(**{"data.image_size": 30, "parallel.zero_stage": 5}))
    assert "data.image_size" in str(e.value) and "parallel.zero_stage" in str(e.value)


def test_decode_variant():
    s = decode_variant("H/14")
    assert (s.depth, s.width, s.mlp_dim, s.heads, s.patch) == (32, 1280, 5120, 16, 14)
    assert decode_variant("B/8").patch == 8
