"""Which run a command continues when a run of its name is already in storage: only one trained
with the same settings (its MLflow params less the CONTINUABLE keys: steps, workers, ...). A derived
name (no tracking.run_name) with other settings becomes `<name>-<settings hash>`, so the same
command always lands on the same run; a name the user chose is refused. Says which checkpoint a
run goes on from, or that it has finished. Reads storage only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, Callable, Optional

from ..config import ExperimentConfig, Run
from ..console import get_logger
from ..errors import ConfigError
from ..names import name_error
from ..tracking.params import CONTINUABLE
from ..tracking.values import params_for_mlflow

log = get_logger(__name__)

# (newest complete checkpoint, its meta.json) of a config's run, or (None, None)
Where = Callable[[Run], "tuple[Optional[str], Optional[dict[str, Any]]]"]


def changed_settings(stored: dict[str, Any], cfg: ExperimentConfig,
                     ignore: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(key, stored value, value now) for each param of `cfg` that differs from the config a
    checkpoint recorded (`stored`, redacted as it was written), keys in `ignore` left out. A key
    the stored config lacks (written before the key existed) is no difference."""
    then, now = params_for_mlflow(stored), params_for_mlflow(cfg.to_dict())
    return [(k, then[k], v) for k, v in sorted(now.items()) if k in then and then[k] != v and k not in ignore]


def settings_hash(cfg: ExperimentConfig, continuable: tuple[str, ...] = ()) -> str:
    """8 hex digits of the settings that make a run what it is (its params less the continuable
    keys): equal for two commands that would train the same run."""
    params = {k: v for k, v in params_for_mlflow(cfg.to_dict()).items() if k not in CONTINUABLE + continuable}
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]


def _describe(changes: list[tuple[str, str, str]], shown: int = 3) -> str:
    listed = ", ".join(f"{k}={new} (was {old})" for k, old, new in changes[:shown])
    return listed + (f" and {len(changes) - shown} more" if len(changes) > shown else "")


def _differences(meta: Optional[dict[str, Any]], cfg: ExperimentConfig, continuable: tuple[str, ...]):
    """The settings `cfg` changes against a checkpoint's; none for no checkpoint, or for a final
    state copied from another run (a population's exploit: the copy is the search's own doing)."""
    if not meta or meta.get("copied_from") or not isinstance(meta.get("config"), dict):
        return []
    return changed_settings(meta["config"], cfg, ignore=CONTINUABLE + continuable)


def run_to_continue(run: Run, where: Where, continuable: tuple[str, ...] = ()
                    ) -> tuple[Run, Optional[str], Optional[dict[str, Any]]]:
    """(the run to train, its newest complete checkpoint, that checkpoint's meta) for `run`:
    `run` itself when it has no checkpoint or one trained with the same settings; under a name
    with its settings hash when its derived name holds a run with other settings; ConfigError
    (one line) when the user named the run. Says which it continues, or that it has finished;
    FileExistsError where train.resume=never and it has checkpoints."""
    found = _run_to_continue(run, where, continuable)
    _say(*found)
    return found


def finished(run: Run, meta: Optional[dict[str, Any]]) -> bool:
    """Whether the checkpoint with this `meta` is the run's last (train.pause_at or train.steps)."""
    return bool(meta) and meta["step"] >= (run.cfg.train.pause_at or run.cfg.train.steps)


def _say(run: Run, existing: Optional[str], meta: Optional[dict[str, Any]]) -> None:
    cfg = run.cfg
    if existing and cfg.train.resume == "never":
        raise FileExistsError(
            f"run {cfg.run_name!r} already has checkpoints ({existing}) and train.resume='never': "
            "choose a new --set tracking.run_name=..., or use train.resume=auto to continue it")
    if finished(run, meta):
        ignored = ignored_settings(meta, cfg)  # a changed setting that this does not use is worth a warning
        log.log(logging.WARNING if ignored else logging.INFO,
                "[%s] already %s: %s is step %d of %d; nothing to train%s (raise train.pause_at / "
                "train.steps to continue it, or choose a new --set tracking.run_name=... to train again)",
                cfg.run_name, "paused" if meta["step"] < cfg.train.steps else "finished", existing,
                meta["step"], cfg.train.steps, f", so {ignored} change nothing" if ignored else "")
    elif existing:
        log.info("[%s] continuing from %s (same run name)", cfg.run_name, existing)
        planned = ((meta.get("config") or {}).get("train") or {}).get("steps")
        if planned is not None and planned != cfg.train.steps:
            log.info("[%s] train.steps %s -> %s: the LR schedule is re-planned to end at step %s",
                     cfg.run_name, planned, cfg.train.steps, cfg.train.steps)


def _run_to_continue(run: Run, where: Where, continuable: tuple[str, ...]
                     ) -> tuple[Run, Optional[str], Optional[dict[str, Any]]]:
    cfg = run.cfg
    existing, meta = where(run)
    changes = _differences(meta, cfg, continuable)
    if not changes:
        return run, existing, meta
    if cfg.tracking.run_name:
        raise ConfigError(
            f"tracking.run_name={cfg.run_name!r} already holds a run with other settings ({existing}: "
            f"{_describe(changes)}): choose a new --set tracking.run_name=... to train with these, or "
            "leave tracking.run_name unset to have one derived from them; MLflow params cannot change")
    named = f"{cfg.run_name}-{settings_hash(cfg, continuable)}"
    if name_error("tracking.run_name", named):  # the derived name was near the length limit
        raise ConfigError(f"{cfg.run_name!r} holds a run with other settings ({_describe(changes)}) and "
                          f"{name_error('its derived name', named)}: choose a --set tracking.run_name=...")
    renamed = Run.of(dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, run_name=named)))
    existing, meta = where(renamed)
    again = _differences(meta, renamed.cfg, continuable)
    if again:  # only a hash collision, or a run the user named so by hand
        raise ConfigError(f"tracking.run_name={named!r} holds a run with other settings ({existing}: "
                          f"{_describe(again)}): choose a new --set tracking.run_name=...")
    log.warning("[%s] a run of that name is in storage with other settings (%s): this one is %s "
                "(%s); --set tracking.run_name=... names it", cfg.run_name, _describe(changes), named,
                f"continuing {existing}" if existing else "new")
    return renamed, existing, meta


def ignored_settings(meta: dict[str, Any], cfg: ExperimentConfig) -> str:
    """The continuable settings `cfg` changes that a finished run does not use ("" if none)."""
    if not isinstance(meta.get("config"), dict):
        return ""
    changes = changed_settings(meta["config"], cfg)
    return _describe([c for c in changes if c[0] in CONTINUABLE], shown=5)
