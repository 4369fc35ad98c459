"""Ray Tune sweeps over fine-tuning runs: search space, driver function, MLflow parent/children.
A trial is a flat dict of dotted config keys plus two axes that are not config fields: `recipe`
(the downstream dataset's preset) and `source` (a checkpoint/export path or "scratch").
build_spec is the edge (resolves and validates every trial config once); trials make typed
edits only, never `--set` strings. MLflow is written only through `vitp.tracking`.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from .. import storage
from ..console import get_logger
from ..config import ConfigError, ExperimentConfig, Run, absolute_paths, field_type, set_values, validate
from ..config.run import PATH_KEYS
from ..config.files import recipe_label
from ..names import check_name
from ..paths import RunPaths
from ..recipes import RECIPES, check_scoped, overrides_for, with_overrides
from ..tracking import RunLogger, find_runs, resolve_tracking_uri
from ..tracking.compare import best_per_dataset
from ..tracking.redact import is_secret_key
from ..tracking.store import quote, tag_filters
from ..tracking.values import source_tags
from ..train.transfer import finetune_config
from .progress import USER_ERROR, SweepProgress, trial_error

_log = get_logger(__name__)

AXES = ("recipe", "source")  # trial keys that are not config fields


@dataclass
class SweepSpec:
    """What to sweep: each recipe's resolved config, the grid/choices, and how to schedule it."""

    name: str
    base_recipe: str
    overrides: list[str]  # the user's --set text, kept for the record (MLflow param sweep.overrides)
    space: dict[str, list]
    # explicit trial points, each crossed with `space`: {key: value} dicts (config keys or AXES),
    # for designs a grid cannot express (e.g. 3 seeds at one data fraction, 1 at the others)
    points: list[dict[str, Any]] = field(default_factory=list)
    # recipe -> config dict (recipe + --set + changes + work_dir); a sweep saved without it is
    # rebuilt from `overrides` (config_of)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    search: str = "grid"
    num_samples: int = 1
    scheduler: str = "none"
    metric: str = "val/top1"
    mode: str = "max"
    trial_retries: int = 1
    max_concurrent_trials: int = 0
    work_dir: str = "work"
    tracking_uri: str = ""
    experiment: str = "vit-pipeline"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
    space: dict[str, list] = {k: list(v) for k, v in base.tune.space.items()}
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
        if not isinstance(values, list) or not values:
            raise ConfigError(f"tune.space[{key!r}] must be a non-empty list, got {values!r}")
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
    t = base.tune
    spec = SweepSpec(name=name, base_recipe=base_recipe, overrides=list(overrides), configs=configs,
                     space=space, points=points, search=t.search, num_samples=t.num_samples, scheduler=t.scheduler,
                     metric=t.metric, mode=t.mode, trial_retries=t.trial_retries,
                     max_concurrent_trials=t.max_concurrent_trials, work_dir=work_dir,
                     tracking_uri=resolve_tracking_uri(base), experiment=base.tracking.experiment)
    for trial in _grid(spec):
        try:
            validate(trial_config(spec, trial)[0])
        except ConfigError as e:
            raise ConfigError(f"sweep trial {trial_run_name(spec, trial)}: {e}") from None
    return spec


def _grid(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every trial of a grid search (what random search draws from): each point of the space,
    merged with each of spec.points."""
    keys = list(spec.space)
    grid = [dict(zip(keys, values)) for values in itertools.product(*(spec.space[k] for k in keys))]
    return [{**g, **p} for g in grid for p in (spec.points or [{}])]


def dataset_configs(spec: SweepSpec) -> list[ExperimentConfig]:
    """One config per distinct shard set the sweep's trials read (to prepare before trials)."""
    from ..data.ingest import shards_dir  # lazy: pyarrow

    out, seen = [], set()
    for trial in _grid(spec):
        cfg, _ = trial_config(spec, trial)
        if shards_dir(cfg) not in seen:
            seen.add(shards_dir(cfg))
            out.append(cfg)
    return out


def config_of(spec: SweepSpec, recipe: str) -> ExperimentConfig:
    """`recipe`'s config in this sweep (a sweep saved before configs were stored: from its --set)."""
    if recipe not in spec.configs:
        cfg = set_values(with_overrides(recipe, overrides_for(recipe, spec.overrides)), {"work_dir": spec.work_dir})
        spec.configs[recipe] = cfg.to_dict()
    return ExperimentConfig.from_dict(spec.configs[recipe])


def trial_config(spec: SweepSpec, trial: dict[str, Any]) -> tuple[ExperimentConfig, dict[str, str]]:
    """One trial's fine-tuning config, by typed edits of its recipe's config (validated by
    build_spec, not here), and its lineage tags."""
    cfg = config_of(spec, trial.get("recipe", spec.base_recipe))
    values = {k: v for k, v in trial.items() if k not in AXES}
    values.update({"tracking.experiment": spec.experiment, "tracking.uri": spec.tracking_uri,
                   "tracking.run_name": trial_run_name(spec, trial)})
    cfg = set_values(cfg, values)
    # one Train report per evaluation, so ASHA can stop a trial between evaluations
    if cfg.train.eval_every:
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, checkpoint_every=0))
    return finetune_config(cfg, trial.get("source", "scratch"))


def trial_run_name(spec: SweepSpec, trial: dict[str, Any]) -> str:
    """Stable, readable child-run name: the same trial always maps to the same name."""
    parts = [spec.name]
    recipe = recipe_label(trial.get("recipe", spec.base_recipe))
    parts.append(recipe.replace("finetune_", ""))
    src = trial.get("source", "scratch")
    parts.append("scratch" if src == "scratch" else "from-" + _short(src))
    for k in sorted(trial):
        if k not in AXES:
            v = trial[k]  # a swept path names its last two folders, as a source does
            parts.append(f"{k.split('.')[-1]}{_short(v) if isinstance(v, str) and '/' in v else v}")
    return "-".join(parts)


def _short(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    parent = os.path.basename(os.path.dirname(os.path.normpath(path)))
    return re.sub(r"[^A-Za-z0-9_.]+", "_", f"{parent}_{base}")[-40:]


# ---------------------------------------------------------------------------------------
# Tune
# ---------------------------------------------------------------------------------------


def trial_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Tune trial's config -> the flat trial dict (its explicit point merged in)."""
    params = {k: v for k, v in config.items() if k != "point" and not k.startswith("__")}
    return {**params, **(config.get("point") or {})}


def finetune_trial_driver_fn(trial: dict[str, Any], spec: dict[str, Any], parent_run_id: str) -> None:
    """Tune trainable: one fine-tuning run on Ray Train, its evaluations reported to Tune. The
    sweep spec and parent run come through tune.with_parameters, so trial configs (what Tune
    shows and stores) hold only the swept values."""
    from ..train.failures import FINAL  # lazy: ray.train internals (as below)
    from ..train.trainer import run_training  # lazy: torch, deepspeed (only trial processes train)

    spec = SweepSpec(**spec)
    cfg, tags = trial_config(spec, trial_params(trial))
    ctx = tune.get_context()
    tags = {**tags, "sweep": spec.name, "trial_id": ctx.get_trial_id()}
    try:
        summary = run_training(Run.of(cfg), extra_tags=tags, parent_run_id=parent_run_id,
                               callbacks=[TuneReportCallback()])
    except FINAL as e:  # its MLflow run is already ended FAILED with this line
        tune.report({spec.metric: math.nan, USER_ERROR: f"{type(e).__name__}: {e}"})
        return
    if summary.already_finished:  # a resumed sweep: this trial's training had finished before
        tune.report(summary.metrics)
    if summary.metrics.get(spec.metric) is None:
        raise RuntimeError(f"trial {cfg.run_name} finished without reporting {spec.metric}")


def max_concurrent(spec: SweepSpec, cfg: ExperimentConfig) -> int:
    """Trials that fit at once: each needs its workers' CPUs plus ~1 for the controller/data."""
    if spec.max_concurrent_trials:
        return spec.max_concurrent_trials
    cpus = ray.cluster_resources().get("CPU", 1)
    gpus = ray.cluster_resources().get("GPU", 0)
    p = cfg.parallel
    by_cpu = cpus // (p.num_workers * p.cpus_per_worker + 1)
    by_gpu = gpus // (p.num_workers * p.gpus_per_worker) if p.use_gpu else math.inf
    return max(1, int(min(by_cpu, by_gpu)))


def _param_space(spec: SweepSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    axes = dict(spec.space, **({"point": spec.points} if spec.points else {}))
    for key, values in axes.items():
        out[key] = tune.grid_search(values) if spec.search == "grid" else tune.choice(values)
    return out


def _parent_run_id(spec: SweepSpec) -> Optional[str]:
    """The newest parent run of sweep `spec.name` in its experiment, or None."""
    filters = [f"attributes.run_name = {quote('sweep-' + spec.name)}", *tag_filters(spec.name, None)]
    runs = find_runs(spec.tracking_uri, spec.experiment, " and ".join(filters))
    runs = [r for r in runs if not r["parent_run_id"]]
    return runs[0]["run_id"] if runs else None


def _keep_credentials_out_of_trial_actors() -> None:
    """Tune copies AWS_* credentials from this process's environment into each trial actor's
    runtime_env, and Ray's runtime-env agent writes every runtime_env it creates into its log on the
    node (runtime_env_agent.log). The actors inherit the job's environment anyway (a local Ray:
    this process's; a submitted job: its runtime_env and the node's), so credentials are dropped
    from the names Tune propagates. A Ray without that list is left as it is."""
    from ray.tune.execution import class_cache

    names = getattr(class_cache, "ENV_VARS_TO_PROPAGATE", None)
    if isinstance(names, (set, frozenset)):
        class_cache.ENV_VARS_TO_PROPAGATE = {n for n in names if not is_secret_key(n)}


def run_sweep(spec: SweepSpec, resume: bool = False, log: Callable[[str], None] = _log.info) -> dict[str, Any]:
    """Run (or with resume=True continue) the sweep; returns a summary with the best per dataset."""
    # Save the sweep state within seconds of a trial ending, so a killed driver's --resume
    # knows which trials finished (Tune's default period adapts and can lag by minutes).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    _keep_credentials_out_of_trial_actors()
    path = RunPaths.of(spec.work_dir).sweep(spec.name)
    # Tune keeps its state through the same filesystem (S3 endpoint) as the rest of the pipeline
    fs, inner = storage.filesystem(path)
    if storage.exists(path) and not resume and tune.Tuner.can_restore(inner, storage_filesystem=fs):
        raise FileExistsError(f"sweep {spec.name!r} exists at {path}: continue it with --resume, "
                              "or pass another --name")
    first_trial_cfg, _ = trial_config(spec, _grid(spec)[0])
    # --resume continues the sweep's parent run whatever its status (its trials name it as parent)
    parent = RunLogger.start(spec.tracking_uri, spec.experiment, f"sweep-{spec.name}",
                             run_id=_parent_run_id(spec) if resume else None,
                             background=True,  # its heartbeat: a live sweep is never taken for stale
                             tags={"sweep": spec.name, "kind": "sweep", "recipe": spec.base_recipe,
                                   **source_tags(f"vitp sweep {spec.name}")})
    if not parent.resumed:  # a resumed parent keeps the params of the run that started it
        parent.log_params({"sweep.space": json.dumps(spec.space), "sweep.search": spec.search,
                           "sweep.scheduler": spec.scheduler, "sweep.metric": spec.metric,
                           "sweep.num_samples": spec.num_samples, "sweep.base_recipe": spec.base_recipe,
                           "sweep.overrides": json.dumps(spec.overrides)})
    parent.log_dict(spec.to_dict(), "sweep.json")
    concurrency = max_concurrent(spec, first_trial_cfg)
    log(f"[sweep {spec.name}] parent MLflow run {parent.run_id}; {concurrency} concurrent trial(s); "
        f"storage {path}")

    # the driver only waits on its Train run; a token CPU share keeps Tune from packing it at 0
    trainable = tune.with_resources(tune.with_parameters(
        finetune_trial_driver_fn, spec=spec.to_dict(), parent_run_id=parent.run_id), {"CPU": 0.01})
    total = len(_grid(spec)) * spec.num_samples if spec.search == "grid" else spec.num_samples
    progress = SweepProgress(spec.name, total, concurrency, spec.metric, spec.tracking_uri,
                             spec.experiment, run_name=lambda config: trial_run_name(spec, trial_params(config)),
                             scheduler=spec.scheduler, log=log,
                             planned_steps=lambda config: trial_config(spec, trial_params(config))[0].train.steps)
    t0 = time.time()
    try:
        if resume:
            if not tune.Tuner.can_restore(inner, storage_filesystem=fs):
                raise FileNotFoundError(f"--resume: no sweep state at {path}; start it without --resume")
            tuner = tune.Tuner.restore(inner, trainable=trainable, resume_unfinished=True,
                                       resume_errored=True, storage_filesystem=fs)
        else:
            scheduler = None
            if spec.scheduler == "asha":
                scheduler = tune.schedulers.ASHAScheduler(grace_period=1, reduction_factor=2)
            param_space = _param_space(spec)
            tuner = tune.Tuner(
                trainable,
                param_space=param_space,
                tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode, scheduler=scheduler,
                                            num_samples=spec.num_samples,
                                            max_concurrent_trials=concurrency,
                                            # a trial's driver is light; its process and imports
                                            # are not: the next trial reuses them
                                            reuse_actors=True),
                run_config=tune.RunConfig(name=spec.name, storage_path=storage.dirname(inner),
                                          storage_filesystem=fs,
                                          failure_config=tune.FailureConfig(max_failures=spec.trial_retries),
                                          callbacks=[progress], verbose=0),
            )
        results = tuner.fit()
        progress.settle()
    except BaseException as e:
        parent.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    summary = summarise(spec, parent, results, time.time() - t0)
    parent.end("FINISHED")
    return summary


def best_trials(tracking_uri: str, experiment: str, parent_run_id: str, metric: str = "val/top1",
                mode: str = "max") -> dict[str, dict[str, Any]]:
    """{dataset: {run_id, run_name, top1, source}}: the best FINISHED child of a sweep parent per dataset.

    A trial's score is the best value of `metric` over its history (max or min by `mode`), the same
    rule as the "best top-1" column of `vitp compare`; ties go to the run name that sorts first.
    """
    rows = []
    for run in find_runs(tracking_uri, experiment, "attributes.status = 'FINISHED'",
                         parent_run_id=parent_run_id, history=[metric]):
        values = [v for _, v in run["history"][metric]]
        if values:
            rows.append({"dataset": run["tags"].get("dataset", "?"), "run_id": run["run_id"],
                         "run_name": run["run_name"], "source": run["tags"].get("source", ""),
                         "top1": max(values) if mode == "max" else min(values)})
    return {dataset: {k: row[k] for k in ("run_id", "run_name", "top1", "source")}
            for dataset, row in best_per_dataset(rows, key="top1", mode=mode).items()}


def summarise(spec: SweepSpec, parent, results, seconds: float) -> dict[str, Any]:
    """Best trial per dataset (from the MLflow children) and the failures, into the parent run."""
    failed = [{"trial": os.path.basename(str(r.path)), "config": {k: v for k, v in (r.config or {}).items()
                                                                 if not k.startswith("__")},
               "error": trial_error(r.error, r.metrics)}
              for r in results if r.error or (r.metrics or {}).get(USER_ERROR)]
    best = best_trials(spec.tracking_uri, spec.experiment, parent.run_id, spec.metric, spec.mode)
    name = spec.metric.replace("/", "_")
    # a resumed sweep's parent may hold an earlier summary: log after it, so the newest is latest
    step = parent.last_step + 1
    for dataset, b in best.items():
        parent.log_metrics({f"best/{dataset}/{name}": b["top1"]}, step=step)
        parent.set_tags({f"best_trial/{dataset}": b["run_id"]})
    parent.log_metrics({"sweep/trials": len(results), "sweep/failed": len(failed),
                        "sweep/seconds": seconds}, step=step)
    parent.set_tags({"failed_trials": str(len(failed))})
    parent.log_dict({"best": best, "failed": failed}, "sweep_summary.json")
    return {"parent_run_id": parent.run_id, "trials": len(results), "failed": failed,
            "best": best, "seconds": seconds}
