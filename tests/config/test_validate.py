"""Config validation names the field and the fix, collects every problem, makes paths absolute."""
import os

import pytest

from vitp.config import ConfigError, apply_overrides, validate
from vitp.model.variants import VARIANTS
from vitp.recipes import debug
from vitp.config import Run


def _invalid(**overrides):
    return apply_overrides(debug(), [f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("overrides, needles", [
    ({"data.image_size": 30}, ["data.image_size=30", "patch size 8", "multiple of 8"]),
    ({"parallel.global_batch": 64}, ["global_batch 64 != micro 16 x accum 1 x world 2 = 32",
                                    "parallel.grad_accum=2"]),
    ({"parallel.global_batch": 48}, ["global_batch 48", "set parallel.micro_batch=12 and parallel.grad_accum=2"]),
    ({"parallel.zero_stage": 4}, ["parallel.zero_stage=4", "0, 1, 2 or 3"]),
    ({"parallel.offload_params": "true"}, ["offload_params", "zero_stage=3"]),
    ({"model.variant": "Q/16"}, ["model.variant='Q/16'", "B/<patch>"]),
    ({"data.source": "imagefolder", "data.path": "/no/such/dir"}, ["data.path='/no/such/dir' does not exist"]),
    ({"train.init_from": "/no/such/ckpt"}, ["train.init_from", "scratch"]),
    ({"optim.warmup_steps": 1000}, ["optim.warmup_steps=1000", "train.steps=60"]),
    ({"tune.space": '{"optim.nope": [1]}'}, ["tune.space key 'optim.nope'"]),
    ({"train.augreg": "medium3"}, ["train.augreg='medium3'", "light0", "strong2"]),
    ({"train.augreg": "medium2", "train.mixup_alpha": 0.3}, ["train.augreg=medium2 sets", "train.mixup_alpha=0.3",
                                                              "train.augreg=''"]),
    ({"train.objective": "mpp", "train.cutmix_alpha": 1.0}, ["train.objective=mpp", "CutMix"]),
    ({"model.drop_path": 1.0}, ["model.drop_path=1.0", "[0, 1)"]),
    ({"optim.layer_decay": 0.0}, ["optim.layer_decay=0.0: must be in (0, 1]"]),
    ({"data.randaug_layers": -1}, ["data.randaug_layers=-1", "0..16"]),
    ({"train.label_smoothing": 1.0}, ["train.label_smoothing=1.0"]),
    ({"train.keep_every": -1}, ["train.keep_every=-1: must be >= 0"]),
    ({"train.keep_every": 5, "train.checkpoint_every": 0}, ["train.keep_every=5", "train.checkpoint_every=0"]),
])
def test_validation_names_field_and_fix(overrides, needles):
    with pytest.raises(ConfigError) as e:
        validate(_invalid(**overrides))
    for needle in needles:
        assert needle in str(e.value)


def test_the_corpus_path_is_asked_for_by_preprocess_only(tmp_path):
    """Training from shards needs no data.path (the documented `vitp pretrain h14_i21k --set
    data.shards=s3://...`); preprocessing without one says which key to set."""
    from vitp.data.commands import run_preprocess
    from vitp.errors import InputError
    from vitp.recipes import resolve

    cfg = resolve("h14_i21k", ["data.shards=s3://bucket/imagenet21k-shards"])
    assert cfg.data.path == "" and cfg.data.source == "parquet"
    with pytest.raises(InputError, match=r"data.source='imagefolder' reads files: set --set data.path="):
        run_preprocess(Run.of(resolve("debug", ["data.source=imagefolder", f"data.shards={tmp_path}"])), log=lambda s: None)


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


def test_a_worker_count_or_micro_batch_set_alone_keeps_the_global_batch():
    """`--set parallel.num_workers=N` (or micro_batch, global_batch) without grad_accum: the
    accumulation is derived so that micro x accum x workers is the global batch; a grad_accum the
    user set, or a count the batch does not divide, is reported as before."""
    from vitp.recipes import get_recipe, resolve

    recipe = get_recipe("h14_i21k").parallel
    for sets in (["parallel.num_workers=16"], ["parallel.micro_batch=32"],
                 ["parallel.num_workers=64", "parallel.micro_batch=16"], ["parallel.global_batch=2048"]):
        p = resolve("h14_i21k", sets, check_paths=False).parallel
        assert p.micro_batch * p.grad_accum * p.num_workers == p.global_batch, (sets, p)
        assert p.grad_accum != recipe.grad_accum, sets  # each of these needed a new accumulation
        untouched = {"parallel.num_workers": "num_workers", "parallel.micro_batch": "micro_batch",
                     "parallel.global_batch": "global_batch"}
        for key, name in untouched.items():  # what the user did not set stays the recipe's
            if not any(s.startswith(key + "=") for s in sets):
                assert getattr(p, name) == getattr(recipe, name), (sets, name)
    with pytest.raises(ConfigError, match=rf"set parallel.grad_accum={recipe.global_batch // (recipe.micro_batch * 16)}"):
        resolve("h14_i21k", ["parallel.num_workers=16", f"parallel.grad_accum={recipe.grad_accum}"],
                check_paths=False)
    with pytest.raises(ConfigError, match=rf"parallel.global_batch {recipe.global_batch} != micro {recipe.micro_batch} "):
        resolve("h14_i21k", ["parallel.num_workers=48"], check_paths=False)


def test_num_workers_alone_validates_on_every_gpu_recipe_with_the_micro_batch_lowered_only_if_needed():
    """Any worker count that divides the global batch is a valid `--set parallel.num_workers=N` on
    the GPU recipes: grad_accum is derived, and where micro x workers outgrows the global batch the
    micro batch goes down (what fits in memory never grows); a count that does not divide is
    refused with one that would."""
    from vitp.recipes import RECIPES, get_recipe, resolve

    for name in RECIPES:
        recipe = get_recipe(name).parallel
        if not recipe.use_gpu:
            continue
        for world in (1, 2, 4, 8, 16, 32, 64, 128):
            p = resolve(name, [f"parallel.num_workers={world}"], check_paths=False).parallel
            assert p.micro_batch * p.grad_accum * world == p.global_batch == recipe.global_batch, (name, world, p)
            assert p.micro_batch <= recipe.micro_batch, (name, world, p)
            if recipe.micro_batch * world <= recipe.global_batch:  # the recipe's micro batch still fits
                assert p.micro_batch == recipe.micro_batch, (name, world, p)
    # worked by hand: 512 / 16 workers = 32 a step (micro 64 would be 1024); 4096 / 64 = 64 (micro 128: 8192)
    cifar = resolve("finetune_cifar10", ["parallel.num_workers=16"], check_paths=False).parallel
    assert (cifar.micro_batch, cifar.grad_accum) == (32, 1)
    b16 = resolve("b16_i21k", ["parallel.num_workers=64"], check_paths=False).parallel
    assert (b16.micro_batch, b16.grad_accum) == (64, 1)
    with pytest.raises(ConfigError, match="run a worker count that divides 4096"):
        resolve("b16_i21k", ["parallel.num_workers=24"], check_paths=False)
    with pytest.raises(ConfigError, match=r"parallel.global_batch 4096 != micro 96 .*set parallel.micro_batch=64 and "
                                          r"parallel.grad_accum=1"):  # a micro batch the user set is theirs
        resolve("b16_i21k", ["parallel.num_workers=64", "parallel.micro_batch=96"], check_paths=False)


def test_an_elastic_world_keeps_the_global_batch_without_growing_the_micro_batch():
    from vitp.config.validate import for_world
    from vitp.recipes import with_overrides

    cfg = with_overrides("debug", ["parallel.global_batch=96", "parallel.micro_batch=16", "parallel.grad_accum=1",
                                   "parallel.num_workers=6"])
    p = for_world(cfg, 4).parallel  # 16 x 4 = 64 does not divide 96; 12 x 4 x 2 does (24 x 4 would grow it)
    assert (p.num_workers, p.micro_batch, p.grad_accum) == (4, 12, 2)
    p = for_world(cfg, 3).parallel  # 16 x 3 x 2: the micro batch kept
    assert (p.num_workers, p.micro_batch, p.grad_accum) == (3, 16, 2)
    with pytest.raises(ConfigError, match="cannot be split over 5 workers"):
        for_world(cfg, 5)


def test_a_named_augreg_setting_is_what_training_and_ingest_use():
    from vitp.config.augreg import AUGREG, augreg_of, randaug_of

    cfg = validate(_invalid(**{"train.augreg": "medium2"}))
    assert augreg_of(cfg) == AUGREG["medium2"] == (2, 15.0, 0.5) and randaug_of(cfg) == (2, 15.0)
    own = validate(_invalid(**{"data.randaug_layers": 1, "data.randaug_magnitude": 7, "train.mixup_alpha": 0.1}))
    assert augreg_of(own) == (1, 7.0, 0.1)
