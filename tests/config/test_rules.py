"""Every schema key has a rule (vitp/config/rules.py RULES), and validate applies it: for each rule, values
just outside it (derived from the rule: a range's ends, NaN, a bad name, ...) are refused naming the key,
and values inside it pass. Every recipe passes every rule."""
import dataclasses
import math
import sys

import pytest

from vitp.config import ConfigError, validate
from vitp.config.overrides import valid_keys
from vitp.config.rules import RULES, Each, Number, rule_problems, unruled_keys
from vitp.recipes import RECIPES, debug

# Inside values that break a rule tying keys together in the debug recipe (validate.py says so, in a line
# of its own): the rule table passes them, the cross-key check does not.
CROSS = {
    "optim.warmup_steps", "train.pause_at", "train.steps",  # warm-up and pause within the run
    "parallel.num_workers", "parallel.micro_batch", "parallel.grad_accum", "parallel.global_batch",  # the product
    "parallel.min_workers",  # at most num_workers
    "parallel.offload_params", "parallel.offload_optimizer", "parallel.precision",  # ZeRO stage, GPU
    "parallel.use_gpu",  # a GPU per worker
    "train.fewshot_weights", "train.objective",  # an EMA to score; mpp with the recipe's loss
}


def plant(cfg, key, value):
    """`cfg` with `key` set to `value` as is (no type coercion: validate must catch what coerce would)."""
    *sections, last = key.split(".")
    if not sections:
        return dataclasses.replace(cfg, **{last: value})
    section = getattr(cfg, sections[0])
    return dataclasses.replace(cfg, **{sections[0]: dataclasses.replace(section, **{last: value})})


def _cases(which):
    return [pytest.param(key, value, id=f"{key}={value!r}"[:80]) for key, rule in RULES.items()
            for value in getattr(rule, which)()]


def test_every_schema_key_has_a_rule_and_every_rule_a_key():
    assert unruled_keys() == [], "give these keys a rule in vitp/config/rules.py RULES"
    assert sorted(set(RULES) - set(valid_keys())) == [], "rules for keys the schema does not have"


def test_every_rule_has_values_to_plant():
    """A rule the next test could not exercise would pass it vacuously."""
    for key, rule in RULES.items():
        assert rule.outside() and rule.inside(), key
        assert rule.what, key


@pytest.mark.parametrize("key, value", _cases("outside"))
def test_a_value_outside_its_rule_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        validate(plant(debug(), key, value), check_paths=False)
    lines = str(e.value).splitlines()[1:]
    assert any(line.startswith(f"  - {key}") or line.startswith("  - tune.space key") for line in lines), str(e.value)


@pytest.mark.parametrize("key, value", _cases("inside"))
def test_a_value_inside_its_rule_passes(key, value):
    cfg = plant(debug(), key, value)
    assert key not in rule_problems(cfg)
    if key in CROSS:
        return
    validate(cfg, check_paths=False)


def _numbers():
    for key, rule in RULES.items():
        if isinstance(rule, Each):
            rule = rule.rule
        if isinstance(rule, Number):
            yield key, rule


def test_every_number_is_bounded_or_says_why_not():
    """Every number has a lower bound, and an upper one unless a large value is harmless (noted here)."""
    unbounded_above = {"optim.weight_decay", "optim.grad_clip"}  # a large decay or clip is a choice, not a typo
    for key, rule in _numbers():
        assert math.isfinite(rule.lo), key
        assert math.isfinite(rule.hi) or key in unbounded_above, key


@pytest.mark.parametrize("key, rule", list(_numbers()), ids=[k for k, _ in _numbers()])
def test_numbers_just_outside_are_refused_and_the_ends_pass(key, rule):
    """The values derived from the range itself: one step beyond each end, NaN and infinity."""
    base = debug()
    wrap = (lambda v: (0.5, 0.5, v)) if isinstance(RULES[key], Each) else (lambda v: v)
    beyond = [rule.lo if rule.lo_open else (rule.lo - 1 if rule.integer else math.nextafter(rule.lo, -math.inf))]
    if math.isfinite(rule.hi):
        beyond.append(rule.hi if rule.hi_open else (rule.hi + 1 if rule.integer else math.nextafter(rule.hi, math.inf)))
    if not rule.integer:
        beyond += [math.nan, math.inf, -math.inf]
        # nearer 0 than the rule's least magnitude (the smallest normal float, or its own minimum), in range
        in_range = lambda v: (rule.lo < v or (v == rule.lo and not rule.lo_open)) and \
            (v < rule.hi or (v == rule.hi and not rule.hi_open))  # noqa: E731
        tiny = [math.nextafter(rule.least, 0), 5e-324, -5e-324, -math.nextafter(rule.least, 0)]
        assert rule.least >= sys.float_info.min and any(map(in_range, tiny)), key  # a float rule always has some
        beyond += [v for v in tiny if in_range(v)]
    for v in beyond:
        with pytest.raises(ConfigError) as e:
            validate(plant(base, key, wrap(v)), check_paths=False)
        assert f"\n  - {key}" in str(e.value), (key, v, str(e.value))
    for v in rule.inside():
        assert key not in rule_problems(plant(base, key, wrap(v))), (key, v)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_passes_every_rule(name):
    assert rule_problems(RECIPES[name]()) == {}


@pytest.mark.parametrize("key, value, says", [
    ("data.std", (0.5, 0.5, math.nan), "data.std[2]=nan: must be a finite number"),
    ("data.mean", (math.inf, 0.5, 0.5), "data.mean[0]=inf: must be a finite number"),
    ("data.std", (0.0, 0.5, 0.5), "data.std[0]=0.0: must be in (0, 1]"),
    ("data.std", (0.5, -0.5, 0.5), "data.std[1]=-0.5: must be in (0, 1]"),
    ("data.storage_size", 0, "data.storage_size=0: must be in 8..8192"),
    ("data.num_classes", -1, "data.num_classes=-1: must be >= 0 (0 = as many as the corpus has)"),
    ("model.representation_size", -1, "model.representation_size=-1: must be in 0..65536"),
    ("tune.num_samples", 0, "tune.num_samples=0: must be >= 1"),
    ("tune.trial_retries", -1, "tune.trial_retries=-1: must be >= 0"),
    ("tune.max_concurrent_trials", -1, "tune.max_concurrent_trials=-1: must be >= 0"),
    ("tune.perturbation_interval", -1, "tune.perturbation_interval=-1: must be >= 0"),
    ("tune.startup_trials", -1, "tune.startup_trials=-1: must be >= 0"),
    ("data.image_size", 1_000_000, "data.image_size=1000000: must be in 8..4096"),
    ("model.num_classes", 2_000_000, "model.num_classes=2000000: must be at most 1000000"),
    ("parallel.zero_stage", 5, "parallel.zero_stage=5: ZeRO stage must be 0, 1, 2 or 3"),
    ("train.max_failures", -1, "train.max_failures=-1: must be >= 0"),
    ("train.seed", -1, "train.seed=-1: must be in 0..4294967295"),
    ("parallel.use_gpu", "yes", "parallel.use_gpu='yes': expected true or false"),
    ("data.source", "gif", "data.source='gif' is not allowed: use one of 'synthetic'"),
    ("tracking.tags", {"a/../b": "x"}, "tracking.tags: tag name 'a/../b' is not an MLflow tag name"),
    ("tune.metric", "", "tune.metric='': must not be empty"),
    ("work_dir", "", "work_dir='': give a path or URI"),
    ("data.path", "/data/a\nb", "data.path='/data/a\\nb' contains the control character '\\n'"),
    # floats nearer 0 than a sane minimum, or than the smallest normal float (subnormals)
    ("optim.lr", 1e-320, "optim.lr=1e-320: must be at least 1e-10"),
    ("tracking.log_timeout_s", 1e-300, "tracking.log_timeout_s=1e-300: must be at least 0.001 (a millisecond)"),
    ("parallel.gpus_per_worker", 1e-5, "parallel.gpus_per_worker=1e-05: must be 0 or at least 0.0001"),
    ("model.dropout", 1e-310,
     "model.dropout=1e-310: must be 0 or at least 2.2250738585072014e-308 (the smallest normal"),
    ("model.head_bias", -5e-324, "model.head_bias=-5e-324: must be 0 or at least 2.2250738585072014e-308 in magnitude"),
    ("data.std", (0.5, 1e-310, 0.5), "data.std[1]=1e-310: must be at least 2.2250738585072014e-308"),
    # MLflow's and vitp's own tags, and characters that hide what a tag says
    ("tracking.tags", {"mlflow.user": "admin"}, "tracking.tags: tag name 'mlflow.user' is MLflow's own"),
    ("tracking.tags", {"mlflow.source.name": "x"}, "tracking.tags: tag name 'mlflow.source.name' is MLflow's own"),
    ("tracking.tags", {"vitp.heartbeat": "0"}, "tracking.tags: tag name 'vitp.heartbeat' is vitp's own"),
    ("tracking.tags", {"team\u202e": "x"}, "tracking.tags: tag name 'team\\u202e' contains '\\u202e' (U+202E"),
    ("tracking.tags", {"team": "a\u2066b"}, "tracking.tags['team']: the value contains '\\u2066' (U+2066"),
    # the filesystem root as the folder every run writes into (a bucket is fine: test_a_value_inside...)
    ("work_dir", "/", "work_dir='/' is the filesystem root"),
    ("work_dir", "/tmp/../", "work_dir='/tmp/../' is the filesystem root"),
    ("work_dir", "file:///", "work_dir='file:///' is the filesystem root"),
])
def test_the_issue_values_are_refused_in_one_line(key, value, says):
    with pytest.raises(ConfigError) as e:
        validate(plant(debug(), key, value), check_paths=False)
    assert says in str(e.value)
    assert len(str(e.value).splitlines()) == 2, str(e.value)  # that one problem, nothing it implies


def test_a_cross_key_rule_waits_for_the_keys_own_rules():
    """A batch size that is out of range is said once, not again as a product that does not add up."""
    with pytest.raises(ConfigError) as e:
        validate(plant(debug(), "parallel.micro_batch", 0), check_paths=False)
    assert "parallel.micro_batch=0: must be positive" in str(e.value) and "!=" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(plant(debug(), "train.steps", 0), check_paths=False)
    assert "train.steps=0: must be positive" in str(e.value) and "warmup_steps" not in str(e.value)


def test_a_derived_run_name_is_a_name():
    cfg = plant(debug(), "tracking.run_prefix", "p" * 120)
    with pytest.raises(ConfigError, match=r"the derived run name='p+-pico8-synthetic' is 13\d bytes long .*tracking.run_prefix"):
        validate(cfg, check_paths=False)
