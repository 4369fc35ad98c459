"""Ray Tune sweeps over fine-tuning runs: search space, driver function, MLflow parent/children.
A trial is a flat dict of dotted config keys plus two axes that are not config fields: `recipe`
(the downstream dataset's preset) and `source` (a checkpoint/export path or "scratch").
build_spec is the edge (resolves and validates every trial config once); trials make typed
edits only, never `--set` strings. MLflow is written only through `vitp.tracking`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray import tune

from .. import storage
from ..console import get_logger
from ..config import (ConfigError, ExperimentConfig, Run, TuneConfig, absolute_paths, field_type, set_values,
                      validate)
from ..config.run import PATH_KEYS
from ..config.files import recipe_label
from ..names import check_name
from ..recipes import RECIPES, check_scoped, overrides_for, with_overrides
from ..tracking.store import MLFLOW_OUTAGE_S
from ..tracking.redact import is_secret_key
from ..train.staging import clear_dead_everywhere
from ..train.transfer import finetune_config
from .outcome import open_parent, summarise
from .population import (CHECKPOINTED, check_scheduler, hyperband_plan, mutations, population_trial,
                         scheduler_for, search_slots)
from .turns import start_turns, turn
from .progress import USER_ERROR, CtrlC, EvaluationReports, SweepProgress
from .search import check_search, fold_cases, param_space, search_algorithm
from .space import Dist, grid_size, parse_space, probe_trials

_log = get_logger(__name__)

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
    for trial in _probes(spec):
        try:
            validate(trial_config(spec, trial)[0])
        except ConfigError as e:
            raise ConfigError(f"sweep trial {trial_run_name(spec, trial)}: {e}") from None
    check_scheduler(spec.tune.scheduler, spec.tune.search, space, spec.tune.perturbation_interval,
                    trial_config(spec, _probes(spec)[0])[0].train.eval_every)
    sweep = Run.of(absolute_paths(base))  # its work_dir and tracking are every trial's
    spec.tracking_uri, spec.dir = sweep.tracking_uri, sweep.sweep(name)
    return spec


def _probes(spec: SweepSpec) -> list[dict[str, Any]]:
    """The trials validation checks (space.probe_trials: every grid point, each end and the middle of
    every range), each merged with each of spec.points."""
    return [{**t, **p} for t in probe_trials(parse_space(spec.tune.space)) for p in (spec.points or [{}])]


def sampled(spec: SweepSpec) -> bool:
    """Whether two trials may hold the same values: Tune draws some, or repeats the grid."""
    return spec.tune.search != "grid" or spec.tune.num_samples > 1 or any(not (isinstance(d, Dist) and d.kind in ("list", "grid"))
                                        for d in parse_space(spec.tune.space).values())


def dataset_runs(spec: SweepSpec) -> list[Run]:
    """One trial run per distinct shard set the sweep's trials read (to prepare before trials)."""
    out: dict[str, Run] = {}
    for trial in _probes(spec):
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


# ---------------------------------------------------------------------------------------
# Tune
# ---------------------------------------------------------------------------------------


def trial_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Tune trial's config -> the flat trial dict (its explicit point merged in)."""
    params = {k: v for k, v in fold_cases(config).items() if k != "point" and not k.startswith("__")}
    return {**params, **(config.get("point") or {})}


def finetune_trial_driver_fn(trial: dict[str, Any], spec: dict[str, Any], parent_run_id: str) -> None:
    """Tune trainable: one fine-tuning run on Ray Train, its evaluations reported to Tune. The
    sweep spec and parent run come through tune.with_parameters, so trial configs (what Tune
    shows and stores) hold only the swept values."""
    from ..train.failures import FINAL  # lazy: ray.train internals (as below)
    from ..train.report import log_report  # lazy: torch, deepspeed (only trial processes train)
    from ..train.trainer import run_training

    spec = SweepSpec.from_dict(spec)
    ctx = tune.get_context()
    cfg, tags = trial_config(spec, trial_params(trial), ctx.get_trial_id())
    run = Run.of(cfg)
    tags = {**tags, "sweep": spec.name, "trial_id": ctx.get_trial_id()}
    try:
        if spec.tune.scheduler in CHECKPOINTED:  # Tune holds the trial's state: pointers to its checkpoints
            with (turn(spec.name, parent_run_id, ctx.get_trial_id(), _log.info) if spec.tune.scheduler == "hyperband"
                  else contextlib.nullcontext()):
                summary = population_trial(spec.tune.scheduler, spec.tune.space, run, tags, parent_run_id, ctx.get_trial_id())
        else:
            summary = run_training(run, extra_tags=tags, parent_run_id=parent_run_id,
                                   callbacks=[EvaluationReports(spec.tune.metric, cfg)])
        log_report(run, summary)  # attention rollouts of the trial's model
    except FINAL as e:  # its MLflow run is already ended FAILED with this line
        tune.report({spec.tune.metric: math.nan, USER_ERROR: f"{type(e).__name__}: {e}"})
        return
    if summary.already_finished:  # a resumed sweep: this trial's training had finished before
        tune.report(summary.metrics)
    if summary.metrics.get(spec.tune.metric) is None:
        raise RuntimeError(f"trial {cfg.run_name} finished without reporting {spec.tune.metric}")


def max_concurrent(spec: SweepSpec, cfg: ExperimentConfig) -> int:
    """Trials that fit at once: each needs its workers' CPUs plus ~1 for the controller/data."""
    if spec.tune.max_concurrent_trials:
        return spec.tune.max_concurrent_trials
    cpus = ray.cluster_resources().get("CPU", 1)
    gpus = ray.cluster_resources().get("GPU", 0)
    p = cfg.parallel
    by_cpu = cpus // (p.num_workers * p.cpus_per_worker + 1)
    by_gpu = gpus // (p.num_workers * p.gpus_per_worker) if p.use_gpu else math.inf
    return max(1, int(min(by_cpu, by_gpu)))


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
    path = spec.dir
    # Tune keeps its state through the same filesystem (S3 endpoint) as the rest of the pipeline
    fs, inner = storage.filesystem(path)
    if storage.exists(path) and not resume and tune.Tuner.can_restore(inner, storage_filesystem=fs):
        raise FileExistsError(f"sweep {spec.name!r} exists at {path}: continue it with --resume, "
                              "or pass another --name")
    if resume and not tune.Tuner.can_restore(inner, storage_filesystem=fs):
        raise FileNotFoundError(f"--resume: no sweep state at {path}; start it without --resume")
    # a driver killed before Tune recorded any trial leaves only tuner.pkl: restored from it alone,
    # Tune starts a search without the searcher's space; so that search starts afresh instead
    restore = resume and any(n.startswith("experiment_state-") for n in storage.listdir(path))
    if resume and not restore:
        log(f"[sweep {spec.name}] --resume: no trial was recorded at {path}; the search starts afresh")
    first_trial_cfg, _ = trial_config(spec, _probes(spec)[0])
    parent = open_parent(spec, resume, log)
    concurrency = max_concurrent(spec, first_trial_cfg)
    log(f"[sweep {spec.name}] parent MLflow run {parent.run_id}; {concurrency} concurrent trial(s); "
        f"storage {path}")

    # the driver only waits on its Train run; a token CPU share keeps Tune from packing it at 0
    trainable = tune.with_resources(tune.with_parameters(
        finetune_trial_driver_fn, spec=spec.to_dict(), parent_run_id=parent.run_id), {"CPU": 0.01})
    turns = start_turns(spec.name, parent.run_id, concurrency) if spec.tune.scheduler == "hyperband" else None
    total = spec.tune.num_samples * grid_size(parse_space(spec.tune.space), spec.tune.search) * (
        len(spec.points) if spec.points and spec.tune.search == "grid" else 1)
    progress = SweepProgress(spec.name, total, concurrency, spec.tune.metric, spec.tracking_uri, spec.experiment,
                             run_name=lambda config, trial_id="": trial_run_name(spec, trial_params(config), trial_id),
                             scheduler=spec.tune.scheduler, log=log,
                             planned_steps=lambda config: trial_config(spec, trial_params(config))[0].train.steps)
    t0 = time.time()
    try:
        if restore:
            tuner = tune.Tuner.restore(inner, trainable=trainable, resume_unfinished=True,
                                       resume_errored=True, storage_filesystem=fs)
        else:
            scheduler = scheduler_for(spec.tune.scheduler, mutations(spec.tune.space),
                                      spec.tune.perturbation_interval or first_trial_cfg.train.eval_every,
                                      first_trial_cfg.train.steps, spec.tune.seed, first_trial_cfg.train.eval_every)
            if spec.tune.scheduler == "hyperband":
                log(f"[sweep {spec.name}] {hyperband_plan(scheduler, total)}")
            tuner = tune.Tuner(
                trainable,
                param_space=param_space(spec.tune.space, spec.points, spec.tune.search, spec.tune.seed),
                tune_config=tune.TuneConfig(metric=spec.tune.metric, mode=spec.tune.mode, scheduler=scheduler,
                                            num_samples=spec.tune.num_samples,
                                            search_alg=search_algorithm(
                                                spec.tune.space, spec.points, spec.tune.search, spec.tune.seed,
                                                spec.tune.startup_trials, spec.tune.metric, spec.tune.mode,
                                                search_slots(scheduler, spec.tune.search, concurrency)),
                                            # a trial's driver is light; its process and imports
                                            # are not: the next trial reuses them, but only where
                                            # no scheduler stops trials (a stopped trial's process
                                            # must end, its Train run with it)
                                            reuse_actors=spec.tune.scheduler == "none"),
                run_config=tune.RunConfig(name=spec.name, storage_path=storage.dirname(inner),
                                          storage_filesystem=fs,
                                          failure_config=tune.FailureConfig(max_failures=spec.tune.trial_retries),
                                          callbacks=[progress], verbose=0),
            )
        with CtrlC() as ctrl_c:
            results = tuner.fit()
        progress = SweepProgress.active(spec.name)  # after a resume: the one Tune restored and ran
        progress.settle(done=not ctrl_c.pressed)
        if ctrl_c.pressed:  # Tune saved the search and returned: the sweep is not done
            log(f"[sweep {spec.name}] interrupted: continue it with --resume")
            raise KeyboardInterrupt
    except BaseException as e:
        parent.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        clear_dead_everywhere()  # what trials killed mid-upload (or stopped) staged, on every node
    del turns  # the trials' turns end with the sweep
    summary = summarise(spec, parent, results, time.time() - t0, log)
    parent.end("FINISHED", timeout_s=MLFLOW_OUTAGE_S)
    return summary
