"""Trials whose state Tune holds (PBT and HyperBand pause trials; PBT's exploit copies one trial's
state into another): a Train callback hands each report's checkpoint to the trial's driver, which
reports it to Tune as a pointer to the run's checkpoint; a trial restarted from a pointer goes on
from that checkpoint, another trial's copied into its own run first. Rules: docs/transfer.md."""
from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from typing import Any, Callable, Mapping, Optional

from ray import tune
from ray.train import Checkpoint, UserCallback
from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler, TrialScheduler

from .. import storage
from ..config import ConfigError, ExperimentConfig, Run, flatten
from ..train import checkpoint as ckpt
from .search import tune_domain
from .space import Dist, parse_space

POINTER = "pointer.json"
_END = {"end": True}
# What PBT may perturb: keys a run reads afresh when it restarts from a checkpoint (the optimizer's
# hyperparameters: engine.follow_config; the model's dropout rates; augmentation, mixing and the loss)
MUTABLE = ("optim.lr", "optim.weight_decay", "optim.momentum", "optim.beta1", "optim.beta2", "optim.grad_clip",
           "model.dropout", "model.attn_dropout", "model.drop_path", "data.randaug_layers",
           "data.randaug_magnitude", "train.mixup_alpha", "train.cutmix_alpha", "train.label_smoothing")
CHECKPOINTED = ("pbt", "hyperband")  # schedulers that pause trials and restore them from checkpoints
EVALUATION = "evaluation"  # HyperBand's and ASHA's time: the evaluations a trial has reported (1, 2, ...)
LAST_EVALUATION = "last_evaluation"  # True on a run's last evaluation (its last step): ASHA lets it finish
ETA = 2  # HyperBand's reduction factor (ASHA's too): a rung keeps the best 1/ETA of its trials


def mutations(space_values: Mapping[str, Any]) -> dict[str, Any]:
    """PBT's hyperparam_mutations: the space's keys in MUTABLE with numbers, by their range (Tune's
    domain) or their list of values."""
    out = {}
    for key, d in parse_space(space_values).items():
        if key not in MUTABLE or not isinstance(d, Dist):
            continue
        if d.kind not in ("list", "choice", "grid"):  # a range
            out[key] = tune_domain(d, "random")
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.values):
            out[key] = list(d.values)
    return out


class CheckpointReports(UserCallback):
    """In Train's controller: each report's rank-0 metrics and checkpoint name, onto `queue`."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        from ray.exceptions import RayActorError

        try:
            self.queue.put({"metrics": dict(metrics[0]),
                            "checkpoint": storage.basename(checkpoint.path.rstrip("/")) if checkpoint else None})
        except RayActorError:  # the trial that reads them is gone (Tune paused it): so is this run
            os._exit(1)  # the controller; its workers end with it, its placement group is released


def train_reporting_checkpoints(train: Callable[[list], Any], run: Run, trial_id: str) -> Any:
    """`train(callbacks)` (a run_training call) in a thread; each of its reports goes to Tune from
    here, with a pointer to the run's checkpoint where the report has one. Returns what `train`
    returns and raises what it raises."""
    from ray.util.queue import Queue  # lazy: an actor per trial, only for these schedulers

    queue, out = Queue(actor_options={"num_cpus": 0}), {}

    def target() -> None:
        try:
            out["result"] = train([CheckpointReports(queue)])
        except BaseException as e:  # noqa: BLE001 - raised again in the trial's thread below
            out["error"] = e
        finally:
            queue.put(_END)

    thread = threading.Thread(target=target, name="vitp-trial-training", daemon=True)
    thread.start()
    while True:
        item = queue.get()
        if item == _END:
            break
        metrics = {**item["metrics"], EVALUATION: evaluations(int(item["metrics"].get("step", 0)), run.cfg)}
        if item["checkpoint"] is None:
            tune.report(metrics)
            continue
        pointer = {"run_dir": run.dir, "checkpoint": item["checkpoint"],
                   "step": int(item["metrics"].get("step", 0)), "run_name": run.name, "trial_id": trial_id}
        with tempfile.TemporaryDirectory(prefix="vitp-pointer-") as d:
            with open(os.path.join(d, POINTER), "w") as f:
                json.dump(pointer, f)
            tune.report(metrics, checkpoint=Checkpoint.from_directory(d))
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def evaluations(step: int, cfg: ExperimentConfig) -> int:
    """How many evaluations a run has made by `step` (the last step evaluates too)."""
    return -(-step // cfg.train.eval_every) if cfg.train.eval_every else 0


def population_trial(scheduler: str, space_values: Mapping[str, Any], run: Run,
                     tags: dict[str, str], parent_run_id: str, trial_id: str):
    """A sweep trial under PBT or HyperBand (run_training's summary): restarted from a pointer, it
    goes on from that checkpoint, or another trial's (the exploit), recorded as tag
    pbt.exploit.STEP, the perturbed values as params KEY.continued_at_STEP and every start's values
    as pbt/KEY metrics."""
    from ..train.trainer import run_training  # lazy: torch, deepspeed (only trial processes train)

    restored = tune.get_checkpoint()
    if restored is not None:
        pointer = read_pointer(restored)
        copied = continue_from(pointer, run)
        if copied:
            tags = {**tags, f"pbt.exploit.{pointer['step']}": f"{pointer['run_name']} ({copied})"}
    keys = tuple(mutations(space_values)) if scheduler == "pbt" else ()
    values = flatten(run.cfg.to_dict())
    return train_reporting_checkpoints(
        lambda callbacks: run_training(run, extra_tags=tags, parent_run_id=parent_run_id,
                                       callbacks=callbacks, continuable=keys,
                                       start_metrics={f"pbt/{k}": float(values[k]) for k in keys}),
        run, trial_id)


def read_pointer(checkpoint: Checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as d, open(os.path.join(d, POINTER)) as f:
        return json.load(f)


def continue_from(pointer: Mapping[str, Any], run: Run) -> Optional[str]:
    """At a trial's restart from `pointer` (its own last report after a pause, another trial's
    after an exploit): the pointed-to checkpoint becomes the run's newest. The run's own newer
    checkpoints are deleted; another run's is copied in (checkpoint.adopt). Returns the copied
    checkpoint's source, or None when it was the run's own."""
    source = storage.join(pointer["run_dir"], pointer["checkpoint"])
    ckpt.fence(run, pointer["checkpoint"])  # the paused attempt's later checkpoints, if it writes any
    if pointer["run_dir"] == run.dir:
        ckpt.rewind(run, pointer["checkpoint"])
        return None
    ckpt.adopt(source, run)
    return source


def check_scheduler(scheduler: str, search: str, space_values: Mapping[str, Any], interval: int,
                    eval_every: int) -> None:
    """ConfigError unless the scheduler can run this sweep (at its edge, before Ray starts)."""
    if scheduler not in CHECKPOINTED:
        return
    if eval_every <= 0:
        raise ConfigError(f"tune.scheduler={scheduler} acts at evaluations: set train.eval_every "
                          "(e.g. --set train.eval_every=10)")
    if interval < 0 or interval % eval_every:
        raise ConfigError(f"tune.perturbation_interval={interval}: must be a multiple of "
                          f"train.eval_every={eval_every} (0: every evaluation)")
    if scheduler == "pbt" and search == "optuna":
        raise ConfigError("tune.scheduler=pbt draws its own population: use tune.search=random or grid")
    if scheduler == "pbt" and not mutations(space_values):
        raise ConfigError(f"tune.scheduler=pbt perturbs numeric keys of tune.space among {', '.join(MUTABLE)}; "
                          f"the space has none (e.g. --space 'optim.lr=loguniform(1e-3,0.3)')")


def search_slots(scheduler, search: str, concurrency: int) -> int:
    """The trials the search may have unfinished at once: `concurrency`, but under HyperBand, whose
    brackets are cut once all their trials reach a rung (most waiting paused; turns.py holds the
    trials that train to `concurrency`), every trial (0: no limit), or for Optuna, whose proposals
    learn from finished trials, enough to fill the largest bracket."""
    if not isinstance(scheduler, HyperBandScheduler):
        return concurrency
    if search != "optuna":
        return 0
    return max(concurrency, *(scheduler._get_n0(s) for s in range(scheduler._s_max_1)))


def scheduler_for(name: str, space: Mapping[str, Any], interval: int, max_steps: int, seed: int,
                  eval_every: int = 0):
    """Tune's scheduler `name` (asha, hyperband, pbt) for trials reporting `step` at evaluations:
    ASHA stops trials at rungs of evaluations; HyperBand too, in brackets, on its own time
    (EVALUATION, up to max_steps' evaluations: on steps its brackets would need hundreds of trials),
    pausing a trial at a rung until the rung's last trial reaches it; PBT every
    `interval` steps copies an upper-quartile trial into a lower-quartile one and perturbs the
    numeric keys of `space` (x0.8 or x1.2, or a new draw with probability 0.25), once every trial
    has reached that step."""
    from ray.tune.schedulers import PopulationBasedTraining

    last = max(1, -(-max_steps // eval_every)) if eval_every else 100  # a trial's evaluations (Tune's default)
    if name == "hyperband":
        # a trial at max_t ends by itself (Tune's stop there would end its driver before its MLflow run)
        return HyperBandScheduler(time_attr=EVALUATION, reduction_factor=ETA, stop_last_trials=False, max_t=last)
    if name == "asha":  # rungs at evaluations 1, 2, 4, ...; a trial past max_t goes on
        return SparesTheLastEvaluation(time_attr=EVALUATION, grace_period=1, reduction_factor=ETA, max_t=last,
                                       stop_last_trials=False)
    if name == "pbt":
        import random

        random.seed(seed)  # PBT draws its quantile choices and factors from Python's random
        # synch: a trial waits at each interval for the others, so an exploit copies a checkpoint of
        # the same step (trials that share a few CPUs drift apart, and a donor far ahead would skip steps)
        return PopulationBasedTraining(time_attr="step", perturbation_interval=interval,
                                       hyperparam_mutations=dict(space), quantile_fraction=0.25,
                                       resample_probability=0.25, synch=True)
    return None


class SparesTheLastEvaluation(ASHAScheduler):
    """ASHA that lets a trial at its last evaluation (LAST_EVALUATION) finish: its training is done,
    and a stop there (the rung at max_t, or a rung a shorter trial ends on) would end the trial's
    driver before its Train run ended its MLflow run, left RUNNING with its final artifacts unsaved.
    Its result still counts at the rung, when Tune sees the trial complete."""

    def on_trial_result(self, tune_controller, trial, result):
        if result.get(LAST_EVALUATION):
            return TrialScheduler.CONTINUE
        return super().on_trial_result(tune_controller, trial, result)


def hyperband_plan(scheduler, trials: int) -> str:
    """What `scheduler` (Tune's HyperBand) does with a sweep of `trials`, as one line: its brackets
    in the order trials fill them (the first trains its trials in full), and whether any trial can
    be stopped early (a bracket's first rung keeps the best ceil(n / eta) of its n places)."""
    eta = scheduler._eta
    brackets = [(s, scheduler._get_n0(s), scheduler._get_r0(s)) for s in range(scheduler._s_max_1)]
    brackets = [b for b in brackets if b[2]]  # Tune skips a bracket whose first rung is at no time
    sizes = [f"{n} trials stopping at evaluation {r}" if s else f"{n} trials in full" for s, n, r in brackets]
    line = (f"hyperband over {scheduler._max_t_attr} evaluations, reduction factor {eta}: "
            f"brackets of {'; '.join(sizes)}")
    before, needed = 0, None  # the fewest trials of which one is stopped early
    for s, n, _ in brackets:
        if s and needed is None:
            needed = before + math.ceil(n / eta) + 1
        before += n
    if needed is None or trials < needed:
        fix = (f"a sweep of at least {needed} trials (tune.num_samples)" if needed
               else "more evaluations per trial (lower train.eval_every)")
        return f"{line}; with {trials} trial(s) none is stopped early: it needs {fix}"
    return line
