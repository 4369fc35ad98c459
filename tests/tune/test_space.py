"""Search spaces with distributions, without Ray: what each `tune.space` form parses to, the values
validation probes, hostile text refused without running it, when(...) checked against its parent,
what each search refuses, the sweep edge (build_spec) failing on a range that reaches a bad value,
and Optuna's define-by-run space and seeded TPE driven through Optuna itself."""
import math

import pytest

from vitp.config import ConfigError
from vitp.recipes import resolve
from vitp.tune.search import OptunaSpace, check_search, fold_cases, search_algorithm
from vitp.tune.space import Dist, When, grid_size, is_expression, parse, parse_space, probe_trials
from vitp.tune.spec import build_spec, probes, trial_run_name


def test_each_form_parses_to_its_distribution_and_probes_its_ends_and_middle():
    assert parse("optim.lr", [0.1, 0.3]) == Dist("list", ((0.1, 0.3),))
    lr = parse("optim.lr", "loguniform(1e-4, 1e-2)")
    assert lr == Dist("loguniform", (1e-4, 1e-2))
    low, mid, high = lr.probes()
    assert low == 1e-4 and math.isclose(mid, 1e-3) and high < 1e-2 and math.isclose(high, 1e-2)
    assert parse("x", "uniform(-1, 1)").probes()[:2] == [-1, 0]
    assert parse("x", "randint(2, 10)").probes() == [2, 9]  # Tune's randint excludes HIGH
    assert parse("x", "qrandint(0, 12, 4)").probes() == [0, 12]  # ...qrandint includes it
    assert parse("x", "qrandint(0, 12, 1)").probes() == [0, 11]  # ...except at Q=1
    assert parse("x", "lograndint(1, 100)").probes() == [1, 99]
    assert parse("x", "quniform(0, 1, 0.25)").probes() == [0, 0.5, 1.0]
    assert parse("x", "choice(['a', 'b'])").probes() == ["a", "b"]
    assert parse("x", " grid([1, 2, 3]) ").kind == "grid"
    w = parse("optim.momentum", "when(optim.name, {'sgd': uniform(0, 0.9), 'adamw': 0.0})")
    assert w == When("optim.name", (("sgd", Dist("uniform", (0, 0.9))), ("adamw", 0.0)))
    assert w.text() == "when(optim.name, {'sgd': uniform(0, 0.9), 'adamw': 0.0})"
    assert is_expression("loguniform(1e-4,1e-1)") and not is_expression("0.01,0.03")


@pytest.mark.parametrize("text, why", [
    ("loguniform(0, 1)", "LOW > 0"),
    ("uniform(1, 1)", "must be below HIGH"),
    ("uniform(1)", "takes 2 finite numbers"),
    ("uniform(0, float('inf'))", "not a literal"),
    ("randint(0.5, 3)", "takes integers"),
    ("quniform(0, 1, 0)", "Q must be > 0"),
    ("normal(0, 1)", "unknown distribution 'normal'"),
    ("choice([])", "non-empty list"),
    ("choice(x=[1])", "expected one of"),
    ("__import__('os').system('touch /tmp/vitp-pwned')", "expected one of"),
    ("choice([__import__('os').getcwd()])", "not a literal"),
    ("uniform(0, 1) + 1", "expected one of"),
    ("loguniform(1e-4", "is not an expression"),
    ("when(optim.lr, {'a': when(optim.lr, {'b': 1})})", "cannot be nested"),
    ("when(optim.lr)", "takes a key and a mapping"),
    ("(" * 300 + "1" + ")" * 300, "expected one of|is not an expression"),
    ("choice([" + "1, " * 1000 + "1])", "at most 2000"),
])
def test_hostile_or_wrong_text_is_refused_naming_the_key_and_never_run(text, why, tmp_path):
    with pytest.raises(ConfigError, match=why) as e:
        parse("optim.weight_decay", text)
    assert "tune.space['optim.weight_decay']" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "vitp-pwned").exists()


def test_a_when_needs_its_parent_in_the_space_with_a_case_for_each_of_its_values():
    ok = {"optim.name": ["sgd", "adamw"], "optim.momentum": "when(optim.name, {'sgd': uniform(0.5, 0.9), 'adamw': 0.0})"}
    parse_space(ok)
    with pytest.raises(ConfigError, match="not in the space"):
        parse_space({"optim.momentum": ok["optim.momentum"]})
    with pytest.raises(ConfigError, match="no case for optim.name='lamb'"):
        parse_space({**ok, "optim.name": ["sgd", "adamw", "lamb"]})
    with pytest.raises(ConfigError, match="needs 'optim.name' to take a list"):
        parse_space({**ok, "optim.name": "uniform(0, 1)"})
    # the probes follow the parent: sgd's momentum at its range's ends and middle, adamw's constant
    trials = list(probe_trials(parse_space(ok)))
    assert [t["optim.momentum"] for t in trials if t["optim.name"] == "adamw"] == [0.0]
    assert [round(t["optim.momentum"], 6) for t in trials if t["optim.name"] == "sgd"] == [0.5, 0.7, 0.9]


def test_many_keys_are_probed_one_at_a_time_past_the_joint_limit():
    space = parse_space({f"k{i}": "uniform(0, 1)" for i in range(8)})  # 3**8 joint trials
    trials = list(probe_trials(space))
    assert len(trials) == 8 * 3
    for t in trials:  # each trial moves one key off its first probe
        assert sum(v != 0 for v in t.values()) <= 1


def test_grid_axes_are_lists_under_grid_and_grid_under_any_search():
    space = parse_space({"a": [1, 2, 3], "b": "grid([1, 2])", "c": "uniform(0, 1)", "d": "choice([1, 2])"})
    assert grid_size(space, "grid") == 6 and grid_size(space, "random") == 2


def test_optuna_refuses_grid_axes_and_values_it_cannot_choose_among():
    check_search("optuna", parse_space({"a": [1, 2], "b": "loguniform(1e-3, 1)"}), [])
    with pytest.raises(ConfigError, match="optuna search has no grid axes"):
        check_search("optuna", parse_space({"b": "grid([1, 2])"}), [])
    with pytest.raises(ConfigError, match=r"not \[1, 2\]"):
        check_search("optuna", parse_space({"data.mean": [[1, 2], [3, 4]]}), [])
    with pytest.raises(ConfigError, match="tune.search='tpe'"):
        check_search("tpe", {}, [])


def test_a_range_that_reaches_a_bad_value_fails_at_the_sweep_edge(tmp_path):
    base = resolve("debug_finetune", [f"work_dir={tmp_path}"], check_paths=False)
    spec = build_spec("s", base, "debug_finetune", [], extra_space={"optim.lr": "loguniform(1e-4, 1e-1)",
                                                                    "train.steps": "randint(10, 20)"})
    assert {t["train.steps"] for t in probes(spec)} == {10, 19}
    with pytest.raises(ConfigError, match=r"(?s)sweep trial .*lr-0\.5.*optim\.lr=-0\.5"):
        build_spec("s", base, "debug_finetune", [], extra_space={"optim.lr": "uniform(-0.5, 0.5)"})
    with pytest.raises(ConfigError, match="(?s)train.steps.*expected an integer"):
        build_spec("s", base, "debug_finetune", [], extra_space={"train.steps": "uniform(10, 20)"})
    with pytest.raises(ConfigError, match="takes a list of values"):
        build_spec("s", base, "debug_finetune", [], extra_space={"data.shards": "choice(['a', 'b'])"})
    with pytest.raises(ConfigError, match="optuna search has no grid axes"):
        opt = resolve("debug_finetune", [f"work_dir={tmp_path}", "tune.search=optuna"], check_paths=False)
        build_spec("s", opt, "debug_finetune", [], extra_space={"optim.lr": "grid([0.1, 0.3])"})


def test_a_sampled_trial_is_named_by_its_values_and_its_tune_trial_number(tmp_path):
    base = resolve("debug_finetune", [f"work_dir={tmp_path}", "tune.search=random"], check_paths=False)
    spec = build_spec("s", base, "debug_finetune", [], extra_space={"optim.lr": "loguniform(1e-4, 1e-1)"})
    name = trial_run_name(spec, {"optim.lr": 0.00123456789}, "a1b2c3d4_00007")
    assert name.endswith("-lr0.001235-t00007"), name
    grid = build_spec("g", resolve("debug_finetune", [f"work_dir={tmp_path}"], check_paths=False),
                      "debug_finetune", [], extra_space={"optim.lr": [0.1, 0.3]})
    assert trial_run_name(grid, {"optim.lr": 0.1}, "a1b2c3d4_00007").endswith("-lr0.1")  # a grid name is stable


def _study(seed):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=3))


def test_optuna_space_suggests_each_form_follows_a_when_and_picks_a_point():
    space = {"optim.lr": "loguniform(1e-4, 1e-1)", "train.steps": "qrandint(10, 40, 10)",
             "optim.name": ["sgd", "adamw"],
             "optim.momentum": "when(optim.name, {'sgd': uniform(0.5, 0.9), 'adamw': 0.0})"}
    points = [{"train.seed": 0}, {"train.seed": 1}]
    fn, study = OptunaSpace(space, points), _study(0)
    seen = set()
    for _ in range(12):
        trial = study.ask()
        extra = fn(trial)
        config = fold_cases({**trial.params, **extra})
        assert 1e-4 <= config["optim.lr"] <= 1e-1 and config["train.steps"] in (10, 20, 30, 40)
        if config["optim.name"] == "adamw":
            assert config["optim.momentum"] == 0.0 and "optim.momentum|adamw" not in trial.params
        else:
            assert 0.5 <= config["optim.momentum"] <= 0.9 and "optim.momentum|sgd" in trial.params
        assert config["point"] in points
        seen.add(config["optim.name"])
        study.tell(trial, -abs(math.log10(config["optim.lr"]) + 2))  # best near lr 1e-2
    assert seen == {"sgd", "adamw"}


def test_the_seeded_tpe_searcher_repeats_its_trials_and_learns_from_results():
    """Ray's OptunaSearch behind the ConcurrencyLimiter, as a sweep builds it: the same seed
    suggests the same trials given the same results; after its startup trials TPE proposes
    learning rates nearer the best than its random start did."""
    def run(seed):
        alg = search_algorithm({"optim.lr": "loguniform(1e-5, 1)"}, [], "optuna", seed, 4,
                               "val/top1", "max", 1)
        alg.set_search_properties("val/top1", "max", {})
        lrs = []
        for i in range(24):
            config = alg.suggest(f"t{i}")
            lrs.append(config["optim.lr"])
            alg.on_trial_complete(f"t{i}", {"val/top1": -abs(math.log10(config["optim.lr"]) + 2)})
        return lrs

    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c
    dist = [abs(math.log10(lr) + 2) for lr in a]
    assert sum(dist[-8:]) / 8 < sum(dist[:4]) / 4
