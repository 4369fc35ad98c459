"""Named recipes: Python functions returning an ExperimentConfig, each docstring giving the command
that runs it, the hardware, and what to expect (numbers from the paper / official code, see
docs/paper.md; where we chose, the docstring says so). production.py writes them out in full; small.py
(debug, demo) shrinks one. Here: the registry, and a recipe with `--set` overrides. No torch or ray.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

from ..config import ConfigError, ExperimentConfig, apply_overrides, derive_grad_accum, set_values, validate
from ..config.files import is_experiment_file, parse_experiment, recipe_label
from .production import (DOWNSTREAM, IMAGENET21K, b16_i1k_augreg, b16_i21k, finetune_cifar10, finetune_cifar100,
                         finetune_flowers, finetune_imagefolder, finetune_imagenet, finetune_pets, h14_i21k, l16_i21k)
from .small import debug, debug_finetune, demo, demo_finetune, demo_fractals

__all__ = ["DOWNSTREAM", "IMAGENET21K", "RECIPES", "get_recipe", "with_overrides", "resolve", "overrides_for",
           "check_scoped", "scoped", "debug", "demo"]

RECIPES: dict[str, Callable[[], ExperimentConfig]] = {
    f.__name__: f
    for f in (
        debug, debug_finetune, demo, demo_finetune, demo_fractals, b16_i21k, l16_i21k, h14_i21k, b16_i1k_augreg, finetune_cifar10, finetune_cifar100,
        finetune_pets, finetune_flowers, finetune_imagenet, finetune_imagefolder,
    )
}


def get_recipe(name: str) -> ExperimentConfig:
    """The named recipe's config; ConfigError listing the names if it does not exist."""
    if is_experiment_file(name):
        return with_overrides(name)
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    return RECIPES[name]()


# `--set RECIPE:KEY=VALUE`: an override for one recipe of a command that runs several (a sweep's
# --datasets, a job spec's chain). KEY=VALUE alone goes to all of them. A value may hold ':'
# (s3://...): the prefix is a bare name before the first ':', with no '=' or '.' in it.
_SCOPED = re.compile(r"^([A-Za-z0-9_]+):([^=]+=.*)$")


def scoped(item: str) -> tuple[str | None, str]:
    """(recipe, "KEY=VALUE") of a `--set` item; recipe None when it names none."""
    m = _SCOPED.match(item)
    return (m.group(1), m.group(2)) if m else (None, item)


def overrides_for(recipe: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The `--set` items that apply to `recipe`: the unscoped ones and its own `recipe:KEY=VALUE`."""
    return [kv for r, kv in map(scoped, overrides) if r in (None, recipe)]


# Keys every trial of a sweep shares: one value for the whole sweep, never per recipe.
SWEEP_WIDE = ("tune.", "tracking.", "work_dir")


def check_scoped(overrides: Sequence[str], recipes: Sequence[str]) -> None:
    """ConfigError for a `--set RECIPE:KEY=VALUE` whose recipe the sweep does not run, or whose
    key is one the whole sweep shares."""
    from ..tracking.redact import redact_text  # lazy: mlflow

    for item in overrides:
        recipe, kv = scoped(item)
        if recipe is None:
            continue
        if recipe not in recipes:
            raise ConfigError(f"--set {redact_text(item)}: the sweep runs no recipe {recipe!r}; its recipes: "
                              f"{', '.join(recipes)}")
        if kv.partition("=")[0].strip().startswith(SWEEP_WIDE):
            raise ConfigError(f"--set {redact_text(item)}: {kv.partition('=')[0].strip()} is the same for every "
                              f"trial of a sweep: give it without '{recipe}:'")


def with_overrides(name: str, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Recipe (or an experiment file: config/files.py) + `--set` overrides, NOT validated (for
    callers that change it further first); a worker count or micro-batch set without grad_accum
    gets the accumulation that keeps the batch."""
    if is_experiment_file(name):
        from .. import storage  # lazy: pyarrow, for a file on object storage

        base, changes = parse_experiment(storage.read_bytes(name).decode("utf-8", "replace"), name)
        # its runs are named after the file, not its base recipe (whose own runs would share names)
        changes = {"tracking.run_prefix": recipe_label(name), **changes}
        cfg, changed = set_values(get_recipe(base), changes), set(changes)
    else:
        cfg, changed = get_recipe(name), set()
    cfg = apply_overrides(cfg, list(overrides))
    return derive_grad_accum(cfg, changed | {o.split("=", 1)[0].strip() for o in overrides})


def resolve(name: str, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = True) -> ExperimentConfig:
    """Recipe + `--set` overrides, validated, local paths absolute: what every command starts from."""
    return validate(with_overrides(name, overrides), check_paths=check_paths)
