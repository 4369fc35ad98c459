"""Experiment files: a user's own experiment as YAML or JSON, given where a recipe name goes
(`vitp pretrain my-exp.yaml`). Owns the format: read into a base recipe and dotted changes; nothing
in a file is ever run (yaml.safe_load). Must not import torch or ray.
"""
from __future__ import annotations

import os
import re
from typing import Any

from .. import storage
from ..errors import InputError
from .schema import flatten

EXTENSIONS = (".yaml", ".yml", ".json")
FORMAT = ("an experiment file is a mapping: `recipe: NAME` (its base, `vitp config --list`), then "
          "sections as `vitp config` prints them (optim: {lr: 0.003}) and/or `set:` with dotted keys "
          "(set: {optim.lr: 0.003})")


def is_experiment_file(name: str) -> bool:
    return name.lower().endswith(EXTENSIONS)


def recipe_label(recipe: str) -> str:
    """How names (a sweep's, its trials') call a recipe: an experiment file by its stem
    (experiments/lr-sweep.yaml, s3://b/lr-sweep.yaml -> lr-sweep), a built-in recipe by its name."""
    return os.path.splitext(storage.basename(recipe))[0] if is_experiment_file(recipe) else recipe


def parse_experiment(text: str, where: str) -> tuple[str, dict[str, Any]]:
    """(base recipe, {dotted key: value}) from a file's text. A config `vitp config` printed, or a
    run's config.json, loads back as it is; `set:` entries win over sections."""
    import yaml  # lazy: only a file needs it

    try:
        data = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"{where}: not YAML or JSON{line} ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("recipe"), str) or not data["recipe"]:
        raise InputError(f"{where}: {FORMAT}")
    data = dict(data)
    recipe = data.pop("recipe")
    if is_experiment_file(recipe):
        raise InputError(f"{where}: recipe: {recipe!r} is a file; a file's base is a built-in recipe "
                         "(`vitp config --list`)")
    dotted = data.pop("set", None) or {}
    if not isinstance(dotted, dict) or not all(isinstance(k, str) for k in dotted):
        raise InputError(f"{where}: `set:` maps dotted keys to values; {FORMAT}")
    return recipe, {**flatten(data), **dotted}


RUN_PREFIX = "runs:/"  # MLflow's own way to name a run: `vitp pretrain runs:/RUN_ID` runs one like it
# A run's page as the MLflow UI addresses it (the server's URL, with any path prefix, before "#")
RUN_PAGE = re.compile(r"^(?P<server>https?://[^#]+?)/?#/experiments/[^/]+/runs/(?P<run>[0-9A-Za-z]+)/?(?:[/?].*)?$")


def run_reference(recipe: str) -> tuple[str, str | None] | None:
    """(run id, the server a run page names, else None) when `recipe` names an MLflow run:
    runs:/RUN_ID or the run's page in the MLflow UI; None for a recipe name or a file."""
    if recipe.startswith(RUN_PREFIX):
        return recipe[len(RUN_PREFIX):].strip("/"), None
    page = RUN_PAGE.match(recipe)
    return (page["run"], page["server"]) if page else None


def like_recipe(run: str) -> str:
    """`--like RUN`'s recipe text: a run id becomes runs:/RUN_ID; runs:/ and run pages stay as given."""
    return run if run_reference(run) else RUN_PREFIX + run
