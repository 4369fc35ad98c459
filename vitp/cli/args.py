"""The options several `vitp` commands share, declared once: recipe + --set, --address, --tracking-uri.

Also `run_from(args)`: the one place a command turns its recipe, --set and typed flags into a
resolved `Run` (`recipe_config(args)`: the config, unvalidated); `on_ray`: the Ray prelude (connect, shards).
Must not import torch, ray, mlflow or pyarrow (keeps `vitp --help` fast).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Iterable

from vitp import recipes
from vitp.config import ExperimentConfig, Run, set_values
from vitp.config.files import like_recipe, run_reference

Handler = Callable[[argparse.Namespace], int]

_RAY_ADDRESS_HELP = "Ray cluster address (default: $RAY_ADDRESS or a local Ray)"
_JOBS_ADDRESS_HELP = ("Ray jobs API (dashboard) address, e.g. http://127.0.0.1:8265 (default "
                      "$RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, then http://127.0.0.1:8265); a token "
                      "from $RAY_AUTH_TOKEN or $RAY_AUTH_TOKEN_PATH is sent when set")


def add_set(p: argparse.ArgumentParser, help: str = "override a config field, e.g. --set optim.lr=0.003 "
                                                   "(repeatable)") -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_recipe(p: argparse.ArgumentParser, optional: bool = False, set_help: str | None = None) -> None:
    """The positional RECIPE (see `vitp config --list`), its spellings --config FILE and --like RUN
    (pick_recipe makes them the recipe), and its --set overrides."""
    p.add_argument("recipe", nargs="?",
                   help="recipe name (`vitp config --list`), your experiment file (.yaml/.json: "
                        "`recipe: NAME` plus the keys it changes; `vitp config NAME` prints one), or "
                        "runs:/RUN_ID or the run's page in the MLflow UI (http://HOST:PORT/#/experiments/"
                        "E/runs/RUN_ID) for a new run like that MLflow run")
    p.add_argument("--config", dest="config_file", metavar="FILE", help="your experiment file, in place of RECIPE")
    p.add_argument("--like", metavar="RUN", help="a new run like this MLflow run (its id, runs:/ID or its page "
                                                 "in the MLflow UI), in place of RECIPE")
    p.set_defaults(recipe_required=not optional)
    add_set(p, **({"help": set_help} if set_help else {}))


def pick_recipe(args: argparse.Namespace) -> None:
    """RECIPE, --config FILE or --like RUN (a bare run id becomes runs:/ID): one of them, into
    args.recipe; ConfigError for two, or for none where the command needs one."""
    from vitp.errors import ConfigError

    like = getattr(args, "like", None)
    like = like_recipe(like) if like else None
    given = [v for v in (getattr(args, "recipe", None), getattr(args, "config_file", None), like) if v]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(map(repr, given))}: give one of RECIPE, --config FILE and --like RUN")
    if given:
        args.recipe = given[0]
    elif getattr(args, "recipe_required", False):
        raise ConfigError("no recipe: give a RECIPE name (`vitp config --list`), --config FILE or --like RUN")


def add_address(p: argparse.ArgumentParser, jobs_api: bool = False) -> None:
    """--address: a Ray cluster to join, or (jobs_api) the dashboard's Jobs API to talk to."""
    p.add_argument("--address", help=_JOBS_ADDRESS_HELP if jobs_api else _RAY_ADDRESS_HELP)


def add_tracking(p: argparse.ArgumentParser, can_disable: bool = True,
                 help: str = "MLflow tracking URI (default sqlite in work_dir)") -> None:
    """--tracking-uri (a typed change of tracking.uri), and --no-tracking where a run can skip MLflow."""
    p.add_argument("--tracking-uri", help=help)
    if can_disable:
        p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")


def positive(kind: type = int, zero: bool = False):
    """argparse type for a count or size: a number of `kind` above 0 (or at least 0 with `zero`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {'an integer' if kind is int else 'a number'}")
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text}: must be {'>= 0' if zero else '> 0'}")
        return value
    return parse


def key_value(text: str) -> tuple[str, str]:
    """argparse type for KEY=VALUE options other than --set (e.g. --tag)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def typed_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The typed config changes a command's flags ask for (applied after --set, so they win)."""
    changes: dict[str, Any] = {}
    if getattr(args, "tracking_uri", None):
        changes["tracking.uri"] = args.tracking_uri
    if getattr(args, "scheduler", None):
        changes["tune.scheduler"] = args.scheduler
    if getattr(args, "search", None):
        changes["tune.search"] = args.search
    return changes


def recipe_from_run(args: argparse.Namespace) -> None:
    """A recipe that names an MLflow run (run_reference) becomes an experiment file made from that
    run's logged config (tracking.lineage.run_as_experiment), in a folder removed when vitp exits.
    The run is read from the server its page names, else --tracking-uri, else MLFLOW_TRACKING_URI."""
    ref = run_reference(str(getattr(args, "recipe", None) or ""))
    if ref is None:
        return
    import atexit
    import os
    import tempfile

    from vitp import storage
    from vitp.errors import ConfigError
    from vitp.tracking.lineage import run_as_experiment  # lazy: mlflow

    run_id, server = ref
    uri = server or getattr(args, "tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        give = "give --tracking-uri URI or set" if hasattr(args, "tracking_uri") else "set"
        raise ConfigError(f"{args.recipe}: the run is read from MLflow: {give} MLFLOW_TRACKING_URI (the server "
                          "or store the run is in)")
    folder = tempfile.mkdtemp(prefix="vitp-like-")
    atexit.register(storage.rmtree, folder, folder)
    args.recipe = run_as_experiment(uri, run_id, folder)


def recipe_config(args: argparse.Namespace) -> ExperimentConfig:
    """The recipe + --set + typed flag changes, NOT validated (for commands that change it further)."""
    return set_values(recipes.with_overrides(args.recipe, args.overrides), typed_changes(args))


def run_from(args: argparse.Namespace, check_paths: bool = True) -> Run:
    """recipe_config resolved: the one validation of a command (local paths made absolute)."""
    return Run.resolve(recipe_config(args), check_paths=check_paths)


def on_ray(args: argparse.Namespace, run: Run, shards_for: Iterable[Run] | None = None) -> None:
    """The prelude of every command that runs on Ray: connect to `--address` (or start a local Ray)
    for `run`, then make sure the shards of `shards_for` (default: `run`'s own; [] for none) exist,
    preprocessed once here before any worker or trial reads them."""
    from vitp.cluster.connect import connect_ray  # lazy: keeps vitp --help fast (ray)
    from vitp.data.commands import ensure_shards  # lazy: keeps vitp --help fast (ray, pyarrow)

    connect_ray(run.cfg, args.address)
    for each in [run] if shards_for is None else shards_for:
        ensure_shards(each)
