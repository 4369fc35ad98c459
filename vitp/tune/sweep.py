"""Ray Tune sweeps over fine-tuning runs: the driver function each trial runs, and the Tuner that
runs a spec (spec.py) with its search, scheduler, progress and MLflow parent run. MLflow is written
only through `vitp.tracking`.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable, Mapping

import ray
from ray import tune

from .. import storage
from ..config import ExperimentConfig, Run
from ..console import get_logger
from ..tracking.redact import is_secret_key, redact_message
from ..tracking.store import MLFLOW_OUTAGE_S
from ..train.staging import clear_dead_everywhere
from .outcome import open_parent, summarise
from .population import CHECKPOINTED, hyperband_plan, mutations, population_trial, scheduler_for, search_slots
from .progress import USER_ERROR, CtrlC, EvaluationReports, SweepProgress
from .search import fold_cases, param_space, search_algorithm
from .space import grid_size, parse_space
from .spec import SweepSpec, probes, trial_config, trial_run_name
from .turns import start_turns, turn

_log = get_logger(__name__)

def trial_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Tune trial's config -> the flat trial dict (its explicit point merged in)."""
    params = {k: v for k, v in fold_cases(config).items() if k != "point" and not k.startswith("__")}
    return {**params, **(config.get("point") or {})}


class TrialFailed(RuntimeError):
    """What a trial raised, redacted, and without the error it was (whose message, traceback and
    causes Tune would pickle and write into the sweep's folder as they are)."""


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
        tune.report({spec.tune.metric: math.nan, USER_ERROR: redact_message(f"{type(e).__name__}: {e}")})
        return
    except Exception as e:  # Tune writes what a trial raised to its files (error.txt, error.pkl)
        raise TrialFailed(redact_message(f"{type(e).__name__}: {e}")) from None
    if summary.already_finished:  # a resumed sweep: this trial's training had finished before
        tune.report(summary.metrics)
    if summary.metrics.get(spec.tune.metric) is None:
        raise RuntimeError(f"trial {cfg.run_name} finished without reporting {spec.tune.metric}")


# A trial's driver only waits on its Train run, so it asks for no CPU: Tune needs a non-empty
# bundle, and a token CPU share (0.01) left 0.99 CPU on each node a driver sat on, so no 1-CPU
# read task of any trial's data stream could run there (two trials on two 3-CPU nodes hung).
TRIAL_DRIVER_RESOURCES = {"CPU": 0, "memory": 256 * 2**20}


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
    # Tune's CSV, JSON and TensorBoard files of every result duplicate MLflow, unredacted, and
    # writing them is most of a large sweep's driver time; `=0` brings them back
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
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
    first_trial_cfg, _ = trial_config(spec, probes(spec)[0])
    parent = open_parent(spec, resume, log)
    concurrency = max_concurrent(spec, first_trial_cfg)
    log(f"[sweep {spec.name}] parent MLflow run {parent.run_id}; {concurrency} concurrent trial(s); "
        f"storage {path}")

    trainable = tune.with_resources(tune.with_parameters(
        finetune_trial_driver_fn, spec=spec.to_dict(), parent_run_id=parent.run_id), TRIAL_DRIVER_RESOURCES)
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
