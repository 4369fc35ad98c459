"""A sweep's space and search algorithm as Ray Tune takes them: Tune domains for grid and random
search, an Optuna define-by-run function for TPE (`tune.search=optuna`), each searcher seeded
(`tune.seed`) and held to the sweep's concurrency. docs/transfer.md, "Search spaces"."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from ..config import ConfigError
from .space import Dist, When, ordered, parse_space

SEARCHES = ("grid", "random", "optuna")
# An Optuna parameter of a when(...) key is named KEY|PARENT_VALUE (one distribution per name);
# trial_params folds it back into KEY.
CASE_SEP = "|"


def check_search(search: str, space: Mapping[str, Dist | When], points: list) -> None:
    """What a search cannot do with this space: ConfigError naming the key and the way out."""
    if search not in SEARCHES:
        raise ConfigError(f"tune.search={search!r}: use one of {', '.join(SEARCHES)}")
    if search != "optuna":
        return
    for key, d in space.items():
        dists = [c for _, c in d.cases if isinstance(c, Dist)] if isinstance(d, When) else [d]
        for dist in dists:
            if dist.kind == "grid":
                raise ConfigError(f"tune.space[{key!r}]={dist.text()}: optuna search has no grid axes; "
                                  f"use choice(...) or tune.search=grid")
            bad = [v for v in dist.values if v is not None and not isinstance(v, (bool, int, float, str))]
            if bad:
                raise ConfigError(f"tune.space[{key!r}]: optuna chooses among numbers and strings, not {bad[0]!r}")


def tune_domain(d: Dist, search: str):
    """Tune's domain for `d` (a list is a grid axis under grid search, a choice otherwise)."""
    from ray import tune

    if d.kind == "list":
        return tune.grid_search(d.values) if search == "grid" else tune.choice(d.values)
    if d.kind == "grid":
        return tune.grid_search(d.values)
    if d.kind == "choice":
        return tune.choice(d.values)
    return getattr(tune, d.kind)(*d.args)


class _WhenSampler:
    """Tune's sample_from for a when(...) key: the case its parent's value picks, a distribution
    drawn with a generator seeded by the sweep's seed and the trial's other values (repeatable)."""

    def __init__(self, key: str, when: When, seed: int):
        self.key, self.when, self.seed = key, when, seed

    def __call__(self, config: Mapping[str, Any]) -> Any:
        import numpy as np

        case = self.when.case(config[self.when.key])
        if not isinstance(case, Dist):
            return case
        domain = tune_domain(case, "random")
        others = json.dumps({k: v for k, v in config.items() if k != self.key}, sort_keys=True, default=str)
        digest = hashlib.sha256(f"{self.seed}:{self.key}:{others}".encode()).digest()
        return domain.sample(random_state=np.random.default_rng(int.from_bytes(digest[:8], "little")))


def param_space(space_values: Mapping[str, Any], points: list, search: str, seed: int) -> dict[str, Any]:
    """Tune's param_space for grid and random search (optuna's space is its define-by-run function)."""
    from ray import tune

    if search == "optuna":
        return {}
    out: dict[str, Any] = {}
    for key, d in parse_space(space_values).items():
        out[key] = tune.sample_from(_WhenSampler(key, d, seed)) if isinstance(d, When) else tune_domain(d, search)
    if points:
        out["point"] = tune.grid_search(points) if search == "grid" else tune.choice(points)
    return out


class OptunaSpace:
    """The define-by-run function of an optuna search: each key suggested in order (a when(...)
    key after its parent, as KEY|PARENT_VALUE), explicit points as an index into them."""

    def __init__(self, space_values: Mapping[str, Any], points: list):
        self.space_values, self.points = dict(space_values), list(points)

    def __call__(self, trial) -> dict[str, Any]:
        space = parse_space(self.space_values)
        values: dict[str, Any] = {}
        for key in ordered(space):
            d = space[key]
            name = key
            if isinstance(d, When):
                name = f"{key}{CASE_SEP}{values[d.key]}"
                d = d.case(values[d.key])
                if not isinstance(d, Dist):
                    values[key] = d
                    continue
            values[key] = _suggest(trial, name, d)
        out = {k: v for k, v in values.items() if isinstance(space[k], When)}  # constants of a when
        if self.points:
            out["point"] = self.points[trial.suggest_categorical("point", list(range(len(self.points))))]
        return out


def _suggest(trial, name: str, d: Dist) -> Any:
    if d.kind in ("list", "choice"):
        return trial.suggest_categorical(name, d.values)
    low, high = d.args[0], d.args[1]
    q = d.args[2] if len(d.args) == 3 else None
    if d.kind == "uniform":
        return trial.suggest_float(name, low, high)
    if d.kind == "loguniform":
        return trial.suggest_float(name, low, high, log=True)
    if d.kind == "quniform":
        return trial.suggest_float(name, low, high, step=q)
    if d.kind == "qloguniform":  # Optuna has no quantised log range: the log draw, rounded as Tune does
        return round(trial.suggest_float(name, low, high, log=True) / q) * q
    if d.kind == "randint":
        return trial.suggest_int(name, low, high - 1)
    if d.kind == "lograndint":
        return trial.suggest_int(name, low, high - 1, log=True)
    if d.kind == "qrandint":
        return trial.suggest_int(name, low, high - 1 if q == 1 else high, step=q)
    raise ConfigError(f"{name}: {d.text()} has no Optuna form")  # parse admits no other kind


def search_algorithm(space_values: Mapping[str, Any], points: list, search: str, seed: int,
                     startup_trials: int, metric: str, mode: str, concurrency: int):
    """The Tune search algorithm: Tune's variant generator (grid, random) seeded and limited to
    `concurrency` trials at once (0: no limit), or Optuna's TPE behind a ConcurrencyLimiter."""
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    if search != "optuna":
        return BasicVariantGenerator(max_concurrent=concurrency, random_state=seed)
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials)
    searcher = OptunaSearch(space=OptunaSpace(space_values, points), metric=metric, mode=mode, sampler=sampler)
    return ConcurrencyLimiter(searcher, max_concurrent=concurrency)


def fold_cases(params: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's config with optuna's KEY|PARENT_VALUE parameters dropped: their values are also
    under KEY (the define-by-run function returns them there)."""
    return {k: v for k, v in params.items() if CASE_SEP not in k}
