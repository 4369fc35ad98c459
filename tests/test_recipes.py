"""Every recipe builds, validates, round-trips and follows docs/paper.md's recipes."""
import pytest

from vitp.config import ExperimentConfig, validate
from vitp.recipes import RECIPES, get_recipe, resolve, with_overrides


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_builds_validates_round_trips(name):
    cfg = get_recipe(name)
    assert cfg.recipe == name
    # data paths of cluster recipes are the user's; everything else must hold
    validate(cfg, check_paths=name.startswith("debug"))
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg
    doc = RECIPES[name].__doc__
    for part in ("Run:", "Hardware:", "Expect:"):
        assert part in doc, f"{name} docstring lacks {part!r}"


@pytest.mark.parametrize("name", [n for n in RECIPES if n.endswith("_i21k")])
def test_pretrain_recipes_follow_paper(name):
    cfg = get_recipe(name)
    p, o = cfg.parallel, cfg.optim
    assert p.global_batch == 4096 == p.micro_batch * p.grad_accum * p.num_workers
    assert (o.name, o.beta1, o.beta2, o.weight_decay) == ("adamw", 0.9, 0.999, 0.03)
    assert o.warmup_steps == 10_000 and o.schedule == "linear" and o.grad_clip == 1.0
    assert cfg.data.image_size == 224 and cfg.model.head == "pretrain"
    assert cfg.model.num_classes == 21_843


@pytest.mark.parametrize("name, steps, warmup", [
    ("finetune_cifar10", 10_000, 500), ("finetune_cifar100", 10_000, 500),
    ("finetune_imagenet", 20_000, 500), ("finetune_pets", 500, 100),
    ("finetune_flowers", 500, 100),
])
def test_finetune_presets_follow_official_code(name, steps, warmup):
    cfg = get_recipe(name)
    o = cfg.optim
    assert (o.name, o.momentum, o.weight_decay, o.grad_clip, o.schedule) == ("sgd", 0.9, 0.0, 1.0, "cosine")
    assert (cfg.train.steps, o.warmup_steps) == (steps, warmup)
    assert cfg.parallel.global_batch == 512 and cfg.data.image_size == 384
    assert cfg.model.head == "finetune"
    assert cfg.tune.space == {"optim.lr": [0.001, 0.003, 0.01, 0.03]}


def test_unknown_recipe_lists_names():
    with pytest.raises(ValueError, match="debug"):
        get_recipe("nope")


def test_resolve_applies_overrides():
    cfg = resolve("debug", ["parallel.zero_stage=3"])
    assert cfg.parallel.zero_stage == 3


def test_with_overrides_does_not_validate():
    cfg = with_overrides("debug", ["parallel.zero_stage=5", "work_dir=relative"])
    assert cfg.parallel.zero_stage == 5 and cfg.work_dir == "relative"
