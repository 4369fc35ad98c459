"""`vitp` commands that build an experiment: synth, preprocess, pretrain, finetune, sweep, export.

Each parser sits beside its handler; a handler parses, calls the module that owns the work, prints.
Must not contain logic; torch, ray and mlflow are imported inside the handler that needs them.
"""
from __future__ import annotations

import argparse
import sys

from vitp import recipes
from vitp.cli.args import (Handler, add_address, add_recipe, add_tracking, run_from, on_ray, recipe_config,
                           typed_changes)
from vitp.config import Run, absolute_paths, parse_value, set_values
from vitp.config.files import recipe_label
from vitp.errors import ConfigError, InputError
from vitp.names import check_name
from vitp.storage import abspath
from vitp.train.transfer import finetune_config


# ----------------------------------------------------------------------- synth, preprocess


def cmd_synth(args: argparse.Namespace) -> int:
    run = run_from(args)  # a bad recipe or value is refused before ray and pyarrow load
    from vitp.data.commands import check_synth_output, run_synth  # lazy: keeps vitp --help fast (ray, pyarrow)

    check_synth_output(run, args.out, args.overwrite)  # refused before Ray starts
    on_ray(args, run, shards_for=[])
    run_synth(run, out_dir=args.out, overwrite=args.overwrite)
    return 0


def _add_synth(sub) -> Handler:
    p = sub.add_parser("synth", help="render the synthetic fractal corpus (ImageFolder) with Ray Data")
    add_recipe(p)
    p.add_argument("--out", type=abspath, help="output directory or URI (default <work_dir>/synth)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus")
    add_address(p)
    return cmd_synth


def cmd_preprocess(args: argparse.Namespace) -> int:
    if args.overwrite and args.resume:
        raise InputError("--overwrite starts over and --resume finishes an unfinished run: pass one")
    run = run_from(args)
    from vitp.data.commands import run_preprocess  # lazy: keeps vitp --help fast (ray, pyarrow)

    on_ray(args, run, shards_for=[])
    summary = run_preprocess(run, overwrite=args.overwrite, resume=args.resume, out_dir=args.out)
    return 0 if summary.get("written", 0) > 0 else 1


def _add_preprocess(sub) -> Handler:
    p = sub.add_parser("preprocess", help="decode, validate, resize and shard a corpus to Parquet")
    add_recipe(p)
    p.add_argument("--out", type=abspath,
                   help="shard directory or URI (default data.shards or <work_dir>/shards/<source>)")
    p.add_argument("--overwrite", action="store_true", help="replace existing shards, start over")
    p.add_argument("--resume", action="store_true",
                   help="finish an unfinished (killed) run there: write only the shards it lacks")
    add_address(p)
    return cmd_preprocess


# --------------------------------------------------------------------- pretrain, finetune


def cmd_pretrain(args: argparse.Namespace) -> int:
    run = run_from(args)  # a bad recipe or value is refused before torch and ray load (seconds)
    from vitp.train.report import log_report  # lazy: keeps vitp --help fast (torch, ray)
    from vitp.train.trainer import run_training

    on_ray(args, run)
    summary = run_training(run, tracking=not args.no_tracking)
    log_report(run, summary)
    _print_summary(summary, ("train/loss",))
    print(f"  export:     vitp export {summary.checkpoint}")
    return 0


def _print_summary(summary, keys: tuple[str, ...]) -> None:
    """A finished training run: its step, the given metrics, checkpoint and MLflow run."""
    values = ", ".join(f"{k} {summary.metrics.get(k, float('nan')):.4f}" for k in keys)
    what = "nothing trained, already" if summary.already_finished else f"done in {summary.seconds:.0f}s:"
    print(f"[{summary.run_name}] {what} step {summary.metrics.get('step')}, {values}")
    print(f"  checkpoint: {summary.checkpoint}")
    if summary.mlflow_run_id:
        print(f"  MLflow run: {summary.mlflow_run_id}")


def _add_pretrain(sub) -> Handler:
    p = sub.add_parser("pretrain", help="pre-train a ViT with Ray Train + DeepSpeed ZeRO")
    add_recipe(p)
    add_tracking(p)
    add_address(p)
    return cmd_pretrain


def cmd_finetune(args: argparse.Namespace) -> int:
    user_keys = [item.partition("=")[0].strip() for item in args.overrides]  # --set model.* wins
    cfg, tags = finetune_config(recipe_config(args), args.source, user_keys=user_keys)
    run = Run.resolve(cfg)
    from vitp.train.report import log_report  # lazy: keeps vitp --help fast (torch, ray)
    from vitp.train.trainer import run_training

    on_ray(args, run)
    summary = run_training(run, tracking=not args.no_tracking, extra_tags=tags)
    log_report(run, summary)
    _print_summary(summary, ("val/top1", "val/loss"))
    return 0


def _add_finetune(sub) -> Handler:
    p = sub.add_parser("finetune", help="fine-tune from pre-trained weights (or scratch) with the transfer recipe")
    add_recipe(p)
    p.add_argument("--from", dest="source", required=True, type=abspath,
                   help="checkpoint dir, export dir (vitp export / vitp import), .safetensors file, or 'scratch'")
    add_tracking(p)
    add_address(p)
    return cmd_finetune


# ------------------------------------------------------------------------------- sweep


def cmd_sweep(args: argparse.Namespace) -> int:
    # the base recipe's config (its own RECIPE:KEY=VALUE too); build_spec validates every trial's
    # config: once, not here too
    base = set_values(recipes.with_overrides(args.recipe, recipes.overrides_for(args.recipe, args.overrides)),
                      typed_changes(args))
    from vitp.tracking.compare import compare_rows, format_table  # lazy: keeps vitp --help fast (mlflow)
    from vitp.tune.space import is_expression
    from vitp.tune.spec import AXES, build_spec, dataset_runs  # lazy: keeps vitp --help fast (ray)
    from vitp.tune.sweep import run_sweep

    space: dict = {}
    for item in args.space:
        key, _, values = item.partition("=")
        if key not in AXES and is_expression(values):  # a distribution, e.g. loguniform(1e-4,1e-1)
            space[key] = values.strip()
            continue
        # sources are paths: resolved here, where the user's working directory is known
        space[key] = [(abspath(v) if key == "source" else v) if key in AXES else parse_value(key, v)
                      for v in values.split(",") if v]
    name = args.name or recipe_label(args.recipe)
    spec = build_spec(name, base, args.recipe, args.overrides, changes=typed_changes(args),
                      recipes=args.datasets.split(",") if args.datasets else None,
                      sources=args.sources or None, extra_space=space)
    runs = dataset_runs(spec)
    on_ray(args, runs[0], shards_for=runs)  # shards once, before trials race for them
    summary = run_sweep(spec, resume=args.resume)
    print(format_table(compare_rows(spec.tracking_uri, spec.experiment, sweep=spec.name)))
    for dataset, best in summary["best"].items():
        print(f"best on {dataset}: {best['run_name']} {spec.tune.metric} {best['top1']:.4f}")
    if summary["failed"]:
        print(f"{len(summary['failed'])} trial(s) failed:", file=sys.stderr)
        for f in summary["failed"]:
            print(f"  {f['trial']}: {f['error']}", file=sys.stderr)
        return 1
    return 0


def _add_sweep(sub) -> Handler:
    p = sub.add_parser("sweep", help="Ray Tune sweep of fine-tuning runs (lr x datasets x sources)")
    add_recipe(p, set_help="override a config field of every trial, e.g. --set optim.lr=0.003, or of one "
                           "dataset's trials: --set finetune_pets:data.path=s3://b/pets (repeatable)")
    p.add_argument("--name", help="sweep name (default: the recipe); also the MLflow parent run")
    p.add_argument("--datasets", help="comma-separated fine-tuning recipes to sweep over, e.g. "
                                      "finetune_cifar10,finetune_pets")
    p.add_argument("--from", dest="sources", action="append", default=[], type=abspath,
                   help="a source to start from (repeatable): checkpoint/export path or 'scratch'")
    p.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2|KEY=DIST",
                   help="add a key to the search space (repeatable): values, e.g. --space optim.lr=0.01,0.03, "
                        "or a distribution, e.g. --space 'optim.lr=loguniform(1e-4,1e-1)'")
    p.add_argument("--search", choices=["grid", "random", "optuna"], help="override tune.search")
    p.add_argument("--scheduler", choices=["none", "asha", "hyperband", "pbt"], help="override tune.scheduler")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
    add_tracking(p, can_disable=False)
    add_address(p)
    return cmd_sweep


# ------------------------------------------------------------------------------ export


def cmd_export(args: argparse.Namespace) -> int:
    from vitp.train.export import export_as  # lazy: keeps vitp --help fast (torch)

    suffix = ("-ema" if args.weights == "ema" else "") + {"ours": "-export", "timm": "-timm.safetensors",
                                                         "hf": "-hf"}[args.format]
    out = args.out or args.checkpoint.rstrip("/") + suffix
    if args.register:
        if args.format != "ours":
            raise ConfigError("--register logs our export format: leave out --format, register, then "
                              "export the registered export with --format")
        check_name("--register", args.register)  # before the export is written
    export_as(args.checkpoint, out, args.format, args.weights, args.headless)
    print({"timm": f"wrote {out}", "hf": f"wrote {out} (model.safetensors, config.json, preprocessor_config.json)"}
          .get(args.format, f"wrote {out}/model.safetensors and {out}/config.json"))
    if args.register:
        from vitp.train.registry import register_export  # lazy: keeps vitp --help fast (mlflow)

        from vitp.model.weights import read_config

        # --tracking-uri, else the store of the run that trained it
        uri = args.tracking_uri or Run.of(absolute_paths(read_config(out))).tracking_uri
        reg = register_export(out, args.register, uri)
        print(f"registered {reg['model_uri']}; fine-tunes from {out} record it as their source_model")
    return 0


def _add_export(sub) -> Handler:
    p = sub.add_parser("export", help="consolidate a checkpoint into fp32 safetensors + config.json")
    p.add_argument("checkpoint", type=abspath, help="a checkpoint (or, with --format, export) directory or URI")
    p.add_argument("--format", choices=("ours", "timm", "hf"), default="ours",
                   help="ours: safetensors + config.json that vitp reads; timm: timm-named weights (a "
                        ".safetensors file); hf: a Hugging Face ViTForImageClassification dir that "
                        "transformers.pipeline reads")
    p.add_argument("--headless", action="store_true",
                   help="timm, hf: the backbone without its classifier (timm num_classes=0; hf a ViTModel "
                        "whose pooler gives the features the classifier read): how a pre-trained model leaves")
    p.add_argument("--weights", choices=("model", "ema"), default="model",
                   help="model: the trained weights; ema: their moving average (a run with train.ema_decay)")
    p.add_argument("--out", type=abspath, help="output directory, file (timm) or URI (default CHECKPOINT-export, "
                                               "-timm.safetensors or -hf)")
    p.add_argument("--register", metavar="NAME",
                   help="also log the export as an MLflow model of the run that trained it (its config "
                        "and metrics) and register it as a new version of NAME")
    add_tracking(p, can_disable=False, help="MLflow tracking URI for --register (default: the one the "
                                            "checkpoint's config names, else sqlite in its work_dir)")
    return cmd_export


def add_parsers(sub) -> dict[str, Handler]:
    """Add this group's subcommands to `sub`; returns {command name: handler}."""
    return {"synth": _add_synth(sub), "preprocess": _add_preprocess(sub), "pretrain": _add_pretrain(sub),
            "finetune": _add_finetune(sub), "sweep": _add_sweep(sub), "export": _add_export(sub)}
