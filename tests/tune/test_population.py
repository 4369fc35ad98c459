"""Schedulers that pause and copy trials (PBT, HyperBand), without Ray: what PBT may perturb, what
the sweep edge refuses for them, how their trials are named, checkpointed and kept, Tune's
schedulers they build, and a trial's restart from a pointer (its own checkpoint or another run's)."""
import json

import pytest

from vitp import storage
from vitp.config import ConfigError
from vitp.recipes import resolve
from vitp.train import checkpoint as ckpt
from vitp.tune.population import (EVALUATION, LAST_EVALUATION, continue_from, evaluations, hyperband_plan,
                                  mutations, scheduler_for, search_slots)
from vitp.tune.spec import build_spec, trial_config, trial_run_name
from vitp.config import Run


def _spec(tmp_path, *sets, space=None):
    sets = ["train.eval_every=10", "tune.space={}", *sets]  # the space is `space` alone
    base = resolve("debug_finetune", [f"work_dir={tmp_path}", *sets], check_paths=False)
    return build_spec("s", base, "debug_finetune", sets, extra_space=space or {"optim.lr": [0.1, 1e-7]})


def test_pbt_perturbs_the_numeric_keys_a_run_reads_afresh_and_nothing_else():
    got = mutations({"optim.lr": "loguniform(1e-4, 1e-1)", "optim.weight_decay": [0.0, 0.1],
                     "optim.name": ["sgd", "adamw"], "train.steps": [10, 20], "model.drop_path": "uniform(0, 0.2)"})
    assert sorted(got) == ["model.drop_path", "optim.lr", "optim.weight_decay"]
    assert got["optim.weight_decay"] == [0.0, 0.1]
    assert got["optim.lr"].lower == 1e-4 and got["optim.lr"].upper == 1e-1  # Tune's log-uniform domain


def test_the_sweep_edge_refuses_what_pbt_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match=r"acts at evaluations: set train.eval_every"):
        _spec(tmp_path, "tune.scheduler=pbt", "train.eval_every=0")
    with pytest.raises(ConfigError, match=r"perturbation_interval=15: must be a multiple of train.eval_every=10"):
        _spec(tmp_path, "tune.scheduler=pbt", "tune.perturbation_interval=15")
    with pytest.raises(ConfigError, match=r"draws its own population: use tune.search=random or grid"):
        _spec(tmp_path, "tune.scheduler=pbt", "tune.search=optuna", space={"optim.lr": "loguniform(1e-3, 0.1)"})
    with pytest.raises(ConfigError, match=r"the space has none \(e.g. --space 'optim.lr=loguniform"):
        _spec(tmp_path, "tune.scheduler=pbt", space={"optim.name": ["sgd", "adamw"]})
    with pytest.raises(ConfigError, match=r"acts at evaluations: set train.eval_every"):
        _spec(tmp_path, "tune.scheduler=hyperband", "train.eval_every=0")
    assert _spec(tmp_path, "tune.scheduler=hyperband", space={"optim.name": ["sgd", "adamw"]}).tune.scheduler == "hyperband"
    with pytest.raises(ConfigError, match=r"tune.scheduler"):
        _spec(tmp_path, "tune.scheduler=bohb")  # not offered (docs/transfer.md)


def test_trials_under_pbt_checkpoint_at_evaluations_keep_them_all_and_are_named_without_values(tmp_path):
    spec = _spec(tmp_path, "tune.scheduler=pbt", "train.keep_checkpoints=2")
    cfg, _ = trial_config(spec, {"optim.lr": 0.1, "source": "scratch"}, "a1b2c_00001")
    assert (cfg.train.checkpoint_every, cfg.train.keep_checkpoints) == (10, 0)  # any may be copied
    assert cfg.tune.scheduler == "pbt"  # so its workers take its own values after a restore
    assert cfg.run_name == "s-debug_finetune-scratch-t00001"  # its lr changes as it goes: not in its name
    asha = _spec(tmp_path, "tune.scheduler=asha", "train.keep_checkpoints=2", "train.checkpoint_every=5")
    cfg, _ = trial_config(asha, {"optim.lr": 0.1, "source": "scratch"})
    assert (cfg.train.checkpoint_every, cfg.train.keep_checkpoints) == (5, 2)  # the recipe's: a lost node resumes
    assert trial_run_name(asha, {"optim.lr": 0.1, "source": "scratch"}) == "s-debug_finetune-scratch-lr0.1"


def test_each_scheduler_is_tunes_own_on_the_reported_step():
    from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler, PopulationBasedTraining

    space = {"optim.lr": [0.1, 1e-7]}
    pbt = scheduler_for("pbt", mutations(space), 10, 50, seed=0)
    assert isinstance(pbt, PopulationBasedTraining)
    assert (pbt._time_attr, pbt._perturbation_interval, pbt._hyperparam_mutations) == ("step", 10, space)
    assert pbt._synch  # exploits between trials at the same step
    hb = scheduler_for("hyperband", {}, 0, 50, seed=0, eval_every=10)
    assert isinstance(hb, HyperBandScheduler) and (hb._time_attr, hb._max_t_attr, hb._eta) == (EVALUATION, 5, 2)
    assert not hb._stop_last_trials  # a trial at its last step ends by itself, its MLflow run FINISHED
    # a bracket's trials must all exist, most of them paused: the search holds every trial (grid,
    # random) or enough to fill the largest bracket (optuna: 4); turns.py holds the ones that train
    assert (search_slots(hb, "grid", 2), search_slots(hb, "random", 2), search_slots(hb, "optuna", 2)) == (0, 0, 4)
    assert search_slots(pbt, "random", 2) == search_slots(None, "optuna", 2) == 2
    asha = scheduler_for("asha", {}, 10, 50, seed=0, eval_every=10)
    assert isinstance(asha, ASHAScheduler) and (asha._time_attr, asha._max_t) == (EVALUATION, 5)
    assert not asha._stop_last_trials  # a trial with more evaluations than the first is not cut at max_t
    assert scheduler_for("none", {}, 10, 50, seed=0) is None


def test_asha_stops_a_trial_at_an_earlier_rung_but_lets_one_at_its_last_evaluation_finish():
    """200 steps evaluated every 100: rungs at evaluations 1 and 2, the second a trial's last. A stop
    there would end the trial's driver while its Train run ends its MLflow run (the ASHA + TPE
    search-efficiency run left such runs RUNNING): Tune's ASHA stops it, the sweep's lets it finish."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    def run(scheduler):
        scheduler.set_search_properties("val/top1", "max")
        a, b, c = (Trial("__fake", stub=True) for _ in range(3))
        for t in (a, b, c):
            scheduler.on_trial_add(None, t)

        def report(trial, evaluation, top1):
            return scheduler.on_trial_result(None, trial, {EVALUATION: evaluation, "val/top1": top1,
                                                          LAST_EVALUATION: evaluation == 2})
        first = [report(a, 1, 0.5), report(b, 1, 0.4), report(c, 1, 0.7)]
        assert report(a, 2, 0.6) == TrialScheduler.CONTINUE
        scheduler.on_trial_complete(None, a, {EVALUATION: 2, "val/top1": 0.6})
        return first, report(c, 2, 0.55)  # below a's at the last rung

    ours = scheduler_for("asha", {}, 10, 200, seed=0, eval_every=100)
    C, S = TrialScheduler.CONTINUE, TrialScheduler.STOP
    assert run(ours) == ([C, S, C], C)  # b stopped at evaluation 1; c finishes
    tunes = ASHAScheduler(time_attr=EVALUATION, grace_period=1, reduction_factor=2, max_t=2, stop_last_trials=False)
    assert run(tunes) == ([C, S, C], S)


def test_hyperband_counts_evaluations_and_says_when_a_sweep_is_too_small_for_it_to_stop_any(tmp_path):
    """Tune fills HyperBand's brackets in order and the first trains its trials in full: a sweep
    must outnumber it, and the next bracket's survivors, before any trial is stopped early."""
    cfg, _ = trial_config(_spec(tmp_path, "tune.scheduler=hyperband"), {"optim.lr": 0.1, "source": "scratch"})
    assert [evaluations(s, cfg) for s in (0, 1, 10, 11, 20, 25)] == [0, 1, 1, 2, 2, 3]  # the last step evaluates

    def plan(steps, eval_every, trials):
        return hyperband_plan(scheduler_for("hyperband", {}, 0, steps, seed=0, eval_every=eval_every), trials)

    head = "hyperband over 2 evaluations, reduction factor 2: brackets of 2 trials in full; 2 trials stopping at evaluation 1"
    assert plan(20, 10, 4) == head  # trials 3 and 4: the better goes on
    assert plan(20, 10, 3) == f"{head}; with 3 trial(s) none is stopped early: it needs a sweep of at least 4 trials (tune.num_samples)"
    assert plan(50, 10, 7).endswith("brackets of 3 trials in full; 3 trials stopping at evaluation 2; "
                                    "4 trials stopping at evaluation 1")
    assert plan(20, 20, 9).endswith("with 9 trial(s) none is stopped early: it needs more evaluations per "
                                    "trial (lower train.eval_every)")


def _checkpoint(root, step, world=1, run_id="mlflow-x", attempt="a"):
    """A complete checkpoint directory as checkpoint.save leaves it (meta, a file per rank, markers)."""
    d = storage.join(str(root), ckpt.checkpoint_dir_name(step))
    storage.write_json(storage.join(d, "meta.json"), {"step": step, "world_size": world, "mlflow_run_id": run_id,
                                                      "attempt": attempt, "tag": "state"})
    for r in range(world):
        storage.write_bytes(storage.join(d, "state", f"rank{r}.pt"), b"x" * (r + 1))
        files = {f"state/rank{r}.pt": r + 1, **({"meta.json": storage.size(storage.join(d, "meta.json"))}
                                              if r == 0 else {})}
        ckpt.write_marker(d, {"rank": r, "world_size": world, "step": step, "attempt": attempt, "files": files})
    return d


def test_a_restart_from_a_pointer_rewinds_to_its_own_or_adopts_anothers(tmp_path):
    cfg = resolve("debug_finetune", [f"work_dir={tmp_path}", "tracking.run_name=b"], check_paths=False)
    other = resolve("debug_finetune", [f"work_dir={tmp_path}", "tracking.run_name=a"], check_paths=False)
    for step in (10, 20, 30):
        _checkpoint(Run.of(cfg).dir, step)
    donor = _checkpoint(Run.of(other).dir, 20, world=2, run_id="mlflow-a")
    # its own pointer (a pause): the checkpoints after it are gone, it is the newest
    assert continue_from({"run_dir": Run.of(cfg).dir, "checkpoint": "checkpoint_00000020"}, Run.of(cfg)) is None
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)).endswith("/runs/b/checkpoint_00000020")
    assert not storage.exists(storage.join(Run.of(cfg).dir, "checkpoint_00000030"))
    # another run's (an exploit): it replaces this run's checkpoint of the same step, complete
    assert continue_from({"run_dir": Run.of(other).dir, "checkpoint": "checkpoint_00000020"}, Run.of(cfg)) == donor
    copy = ckpt.latest_complete_checkpoint(Run.of(cfg))
    assert copy.endswith("/runs/b/checkpoint_00000020") and ckpt.verify(copy) == (True, "complete")
    meta = ckpt.read_meta(copy)
    assert (meta["mlflow_run_id"], meta["copied_from"], meta["world_size"]) == (None, donor, 2)
    assert storage.read_bytes(storage.join(copy, "state", "rank1.pt")) == b"xx"
    assert ckpt.read_meta(donor)["mlflow_run_id"] == "mlflow-a"  # the donor is left as it was
    assert json.loads(storage.read_bytes(storage.join(copy, "complete", "rank_00000.json")))["files"][
        "meta.json"] == storage.size(storage.join(copy, "meta.json"))
    assert storage.exists(storage.join(Run.of(cfg).dir, "checkpoint_00000010"))  # older ones stay


def test_a_paused_attempts_later_checkpoints_are_never_picked(tmp_path):
    """Tune paused the trial at its checkpoint 20, but its Train run (attempt "a") lived on long
    enough to write checkpoint 30: the restarted attempt goes on from 20, and its own 30 counts."""
    cfg = resolve("debug_finetune", [f"work_dir={tmp_path}", "tracking.run_name=b"], check_paths=False)
    for step in (10, 20):
        _checkpoint(Run.of(cfg).dir, step)
    continue_from({"run_dir": Run.of(cfg).dir, "checkpoint": "checkpoint_00000020"}, Run.of(cfg))
    _checkpoint(Run.of(cfg).dir, 30, attempt="a")  # the paused attempt, after the restart began
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)).endswith("checkpoint_00000020")
    _checkpoint(Run.of(cfg).dir, 30, attempt="c")  # the restarted attempt's own
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)).endswith("checkpoint_00000030")


def test_turns_go_to_the_lowest_trial_asking_and_come_back_when_a_lease_lapses(monkeypatch):
    """HyperBand's trials all start; each driver asks for a turn to train (vitp/tune/turns.py)."""
    from vitp.tune import turns

    now = [0.0]
    monkeypatch.setattr(turns.time, "monotonic", lambda: now[0])
    book = turns.TurnBook(1)
    assert not book.ask("t_00003")  # the first to ask waits while the others start and ask
    now[0] += 1
    assert not book.ask("t_00002")
    now[0] += turns.SETTLE_S
    assert not book.ask("t_00003") and book.ask("t_00002") and book.ask("t_00002")  # the lowest (and keeps it)
    assert not book.ask("t_00003")
    book.give_back("t_00002")
    assert book.ask("t_00003")
    now[0] += turns.LEASE_S - 1
    assert book.renew("t_00003") and not book.ask("t_00004")
    now[0] += turns.LEASE_S  # t_00003's driver is gone (paused: Tune ended its process)
    assert not book.renew("t_00003")
    now[0] += turns.SETTLE_S  # t_00004 asked too long ago: it is taken for gone, and asks afresh
    assert not book.ask("t_00004")
    now[0] += turns.SETTLE_S
    assert book.ask("t_00004")
    book.give_back("t_00004")
    assert book.ask("t_00003")  # resumed after its pause: it had a turn, so it does not settle again
