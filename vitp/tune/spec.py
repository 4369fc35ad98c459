"""A sweep's spec: what it runs, as data. A trial is a flat dict of dotted config keys plus two axes
that are not config fields: `recipe` (the downstream dataset's preset) and `source` (a checkpoint or
export path, or "scratch"). build_spec is the edge (resolves and validates every trial config once);
trials make typed edits of their recipe's config (trial_config), never `--set` strings.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from .. import storage
from ..config import (ConfigError, ExperimentConfig, Run, TuneConfig, absolute_paths, field_type, set_values,
                      validate)
from ..config.files import recipe_label
from ..config.run import PATH_KEYS
from ..names import check_name
from ..recipes import RECIPES, check_scoped, overrides_for, with_overrides
from ..train.transfer import finetune_config
from .population import CHECKPOINTED, check_scheduler
from .search import check_search
from .space import Dist, parse_space, probe_trials

AXES = ("recipe", "source")  # trial keys that are not config fields


@dataclass
class SweepSpec:
    """What to sweep: each recipe's resolved config, the space, and how to search and schedule it
    (`tune`: the base recipe's tune section, its space grown by the datasets and sources swept)."""

    name: str
    base_recipe: str
    overrides: list[str]  # the user's --set text, kept for the record (MLflow param sweep.overrides)
    tune: TuneConfig  # tune.space: key -> list of values or a distribution's text (space.py)
    # explicit trial points, each crossed with the space: {key: value} dicts (config keys or AXES),
    # for designs a grid cannot express (e.g. 3 seeds at one data fraction, 1 at the others)
    points: list[dict[str, Any]] = field(default_factory=list)
    # recipe -> config dict (recipe + --set + changes + work_dir); a sweep saved without it is
    # rebuilt from `overrides` (config_of)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    work_dir: str = "work"
    tracking_uri: str = ""
    experiment: str = "vit-pipeline"
    dir: str = ""  # its Tune state: <work_dir>/sweeps/<name>

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "tune": dataclasses.asdict(self.tune)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SweepSpec":
        """The spec `to_dict` gave, or one a Tune state saved before `tune` held the search settings
        (each at the top level then)."""
        d = dict(d)
        if "tune" not in d:
            d["tune"] = {k: d.pop(k) for k in [f.name for f in dataclasses.fields(TuneConfig)] if k in d}
        return cls(**{**d, "tune": TuneConfig(**d["tune"])})


def build_spec(name: str, base: ExperimentConfig, base_recipe: str, overrides: Sequence[str], *,
               changes: Optional[Mapping[str, Any]] = None, recipes: Optional[list[str]] = None,
               sources: Optional[list[str]] = None,
               extra_space: Optional[dict[str, list]] = None,
               points: Optional[list[dict[str, Any]]] = None) -> SweepSpec:
    """The sweep for `base` (= base_recipe + `overrides` + typed `changes`, need not be validated):
    its tune.space plus `extra_space` (typed values) x datasets (`recipes`) x `sources`, each
    point of which is crossed with every one of `points` (explicit {key: value} trials).

    Every recipe gets the unscoped --set `overrides` (and its own `RECIPE:KEY=VALUE` ones), typed
    `changes`, work_dir and tracking as `base`.
    This is a sweep's edge: local paths (work_dir, the configs' paths, swept path values) are made
    absolute here, and every trial config of the grid is validated (ConfigError naming the trial
    before Ray starts); trials take their Run as resolved (Run.of) and do not validate again.
    """
    check_name("--name", name)  # <work_dir>/sweeps/<name>, the MLflow parent run
    space: dict[str, Any] = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in base.tune.space.items()}
    space.update(extra_space or {})
    if recipes:
        unknown = [r for r in recipes if r not in RECIPES]
        if unknown:
            raise ConfigError(f"--datasets {unknown}: not recipes; choose from {', '.join(RECIPES)}")
        space["recipe"] = list(recipes)
    if sources:
        space["source"] = list(sources)
    for key, values in space.items():
        if key not in AXES:
            field_type(key)  # unknown keys fail here, before Ray starts
        if (key in AXES or key in PATH_KEYS) and not isinstance(values, list):
            raise ConfigError(f"tune.space[{key!r}] takes a list of values (paths are not sampled), got {values!r}")
    check_search(base.tune.search, parse_space(space), points or [])
    points = [dict(p) for p in points or []]
    for point in points:
        for key in point:
            if key in space:
                raise ConfigError(f"sweep point {point}: {key!r} is also in the search space")
            if key not in AXES:
                field_type(key)
    for key in PATH_KEYS:  # Tune runs trials in other working directories
        if key in space:
            space[key] = [storage.abspath(v) for v in space[key]]
        for point in points:
            if key in point:
                point[key] = storage.abspath(point[key])
    if "source" not in space and not any("source" in p for p in points):
        space["source"] = ["scratch"]
    work_dir = storage.abspath(base.work_dir)
    configs = {}
    recipes_used = list(dict.fromkeys(space.get("recipe", []) + [p["recipe"] for p in points if "recipe" in p]
                                      or [base_recipe]))
    check_scoped(overrides, recipes_used)
    for recipe in recipes_used:
        cfg = set_values(with_overrides(recipe, overrides_for(recipe, overrides)),
                         {**(changes or {}), "work_dir": work_dir})
        configs[recipe] = absolute_paths(cfg).to_dict()
    spec = SweepSpec(name=name, base_recipe=base_recipe, overrides=list(overrides), configs=configs,
                     tune=dataclasses.replace(base.tune, space=space), points=points, work_dir=work_dir,
                     experiment=base.tracking.experiment)
    for trial in probes(spec):
        try:
            validate(trial_config(spec, trial)[0])
        except ConfigError as e:
            raise ConfigError(f"sweep trial {trial_run_name(spec, trial)}: {e}") from None
    check_scheduler(spec.tune.scheduler, spec.tune.search, space, spec.tune.perturbation_interval,
                    trial_config(spec, probes(spec)[0])[0].train.eval_every)
    sweep = Run.of(absolute_paths(base))  # its work_dir and tracking are every trial's
    spec.tracking_uri, spec.dir = sweep.tracking_uri, sweep.sweep(name)
    return spec


def probes(spec: SweepSpec) -> list[dict[str, Any]]:
    """The trials validation checks (space.probe_trials: every grid point, each end and the middle of
    every range), each merged with each of spec.points."""
    return [{**t, **p} for t in probe_trials(parse_space(spec.tune.space)) for p in (spec.points or [{}])]


def sampled(spec: SweepSpec) -> bool:
    """Whether two trials may hold the same values: Tune draws some, or repeats the grid."""
    listed = all(isinstance(d, Dist) and d.kind in ("list", "grid") for d in parse_space(spec.tune.space).values())
    return spec.tune.search != "grid" or spec.tune.num_samples > 1 or not listed


def dataset_runs(spec: SweepSpec) -> list[Run]:
    """One trial run per distinct shard set the sweep's trials read (to prepare before trials)."""
    out: dict[str, Run] = {}
    for trial in probes(spec):
        run = Run.of(trial_config(spec, trial)[0])
        out.setdefault(run.shards, run)
    return list(out.values())


def config_of(spec: SweepSpec, recipe: str) -> ExperimentConfig:
    """`recipe`'s config in this sweep (a sweep saved before configs were stored: from its --set)."""
    if recipe not in spec.configs:
        cfg = set_values(with_overrides(recipe, overrides_for(recipe, spec.overrides)), {"work_dir": spec.work_dir})
        spec.configs[recipe] = cfg.to_dict()
    return ExperimentConfig.from_dict(spec.configs[recipe])


def trial_config(spec: SweepSpec, trial: dict[str, Any],
                 trial_id: str = "") -> tuple[ExperimentConfig, dict[str, str]]:
    """One trial's fine-tuning config, by typed edits of its recipe's config (validated by
    build_spec, not here), and its lineage tags; `trial_id` as in trial_run_name."""
    cfg = config_of(spec, trial.get("recipe", spec.base_recipe))
    values = {k: v for k, v in trial.items() if k not in AXES}
    values.update({"tracking.experiment": spec.experiment, "tracking.uri": spec.tracking_uri,
                   "tracking.run_name": trial_run_name(spec, trial, trial_id),
                   "tune.scheduler": spec.tune.scheduler})  # a PBT trial's workers follow its values on restore
    cfg = set_values(cfg, values)
    # where the scheduler pauses or copies trials, a checkpoint at every evaluation, all kept (another
    # trial may copy any); otherwise the recipe's own, so a trial whose node is lost goes on from its
    # newest (only reports with the sweep's metric reach Tune: progress.EvaluationReports)
    if cfg.train.eval_every and spec.tune.scheduler in CHECKPOINTED:
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, checkpoint_every=cfg.train.eval_every,
                                                    keep_checkpoints=0))
    return finetune_config(cfg, trial.get("source", "scratch"))


def trial_run_name(spec: SweepSpec, trial: dict[str, Any], trial_id: str = "") -> str:
    """Stable, readable child-run name: the same trial always maps to the same name. Numbers drawn
    from a range show 4 significant digits; where two trials may hold the same values (sampled), the
    name ends with its Tune trial id's counter (`trial_id`), which a resumed sweep keeps. Under PBT,
    whose trials change values as they go, a name is the trial id without the values."""
    parts = [spec.name]
    recipe = recipe_label(trial.get("recipe", spec.base_recipe))
    parts.append(recipe.replace("finetune_", ""))
    src = trial.get("source", "scratch")
    parts.append("scratch" if src == "scratch" else "from-" + _short(src))
    drawn = {k for k, d in parse_space(spec.tune.space).items() if not (isinstance(d, Dist) and d.values)}
    for k in sorted(trial):
        if k not in AXES and spec.tune.scheduler != "pbt":
            v = trial[k]  # a swept path names its last two folders, as a source does
            if isinstance(v, str) and "/" in v:
                v = _short(v)
            elif k in drawn and isinstance(v, float):
                v = f"{v:.4g}"
            parts.append(f"{k.split('.')[-1]}{v}")
    if trial_id and (sampled(spec) or spec.tune.scheduler == "pbt"):
        parts.append("t" + trial_id.rsplit("_", 1)[-1])
    return "-".join(parts)


def _short(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    parent = os.path.basename(os.path.dirname(os.path.normpath(path)))
    return re.sub(r"[^A-Za-z0-9_.]+", "_", f"{parent}_{base}")[-40:]
