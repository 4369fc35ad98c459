"""`vitp`: one console script, each subcommand a few lines calling the modules.

Must not contain logic: parse, call, print. Heavy imports (torch, ray) happen inside the
subcommand that needs them, so `vitp config` stays instant.
"""
from __future__ import annotations

import argparse
import os
import json
import sys
from typing import Callable

from .config import ConfigError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    COMMANDS[fn.__name__.removeprefix("cmd_").replace("_", "-")] = fn
    return fn


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe name (see `vitp config --list`)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=0.003 (repeatable)")


# ------------------------------------------------------------------------ subcommands


@command
def cmd_config(args: argparse.Namespace) -> int:
    from . import recipes

    if args.list:
        for name, fn in recipes.RECIPES.items():
            first = (fn.__doc__ or "").strip().splitlines()[0]
            print(f"{name:24s} {first}")
        return 0
    if not args.recipe:
        raise ConfigError("vitp config: name a recipe, or --list to see them")
    cfg = recipes.resolve(args.recipe, args.overrides, check_paths=not args.no_path_check)
    if args.keys:
        from .config import valid_keys

        print("\n".join(valid_keys(cfg)))
        return 0
    print(cfg.to_json())
    return 0


@command
def cmd_model(args: argparse.Namespace) -> int:
    from .model import build_vit, forward_flops, training_flops
    from .config import ModelConfig

    mcfg = ModelConfig(variant=args.variant, num_classes=args.num_classes, head=args.head)
    model = build_vit(mcfg, args.image_size, device="meta")  # counts without allocating
    params = sum(p.numel() for p in model.parameters())
    rep = model.representation_size if args.head == "pretrain" else None
    fwd = forward_flops(args.variant, args.image_size, args.num_classes, rep)
    info = {
        "variant": args.variant,
        "image_size": args.image_size,
        "tokens": model.grid**2 + 1,
        "depth": model.spec.depth,
        "width": model.spec.width,
        "mlp_dim": model.spec.mlp_dim,
        "heads": model.spec.heads,
        "head": args.head,
        "num_classes": args.num_classes,
        "params_m": round(params / 1e6, 3),
        "forward_gflops": round(fwd / 1e9, 2),
        "train_gflops": round(training_flops(args.variant, args.image_size, args.num_classes, rep) / 1e9, 2),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"ViT-{args.variant} at {args.image_size}px: {info['params_m']:.2f}M params, "
              f"{info['forward_gflops']:.1f} GFLOPs forward / {info['train_gflops']:.1f} training per image")
        print(f"  depth {info['depth']}, width {info['width']}, MLP {info['mlp_dim']}, heads "
              f"{info['heads']}, {info['tokens']} tokens, {args.head} head with {args.num_classes} classes")
    return 0


@command
def cmd_synth(args: argparse.Namespace) -> int:
    from . import recipes
    from .data.commands import run_synth
    from .train.trainer import connect_ray

    cfg = recipes.resolve(args.recipe, args.overrides)
    connect_ray(cfg, args.address)
    run_synth(cfg, out_dir=args.out, overwrite=args.overwrite)
    return 0


@command
def cmd_preprocess(args: argparse.Namespace) -> int:
    from . import recipes
    from .data.commands import run_preprocess
    from .train.trainer import connect_ray

    cfg = recipes.resolve(args.recipe, args.overrides)
    connect_ray(cfg, args.address)
    summary = run_preprocess(cfg, overwrite=args.overwrite, out_dir=args.out)
    return 0 if summary.get("written", 0) > 0 else 1


@command
def cmd_pretrain(args: argparse.Namespace) -> int:
    from . import recipes
    from .train.trainer import connect_ray, ensure_shards, run_training

    overrides = _overrides(args)
    cfg = recipes.resolve(args.recipe, overrides)
    connect_ray(cfg, args.address)
    ensure_shards(cfg)
    summary = run_training(cfg, tracking=not args.no_tracking)
    print(f"[{summary.run_name}] done in {summary.seconds:.0f}s: step {summary.metrics.get('step')}, "
          f"train/loss {summary.metrics.get('train/loss', float('nan')):.4f}")
    print(f"  checkpoint: {summary.checkpoint}")
    if summary.mlflow_run_id:
        print(f"  MLflow run: {summary.mlflow_run_id}")
    print(f"  export:     vitp export {summary.checkpoint}")
    return 0


@command
def cmd_finetune(args: argparse.Namespace) -> int:
    from . import recipes
    from .train.trainer import connect_ray, ensure_shards, run_training
    from .train.transfer import finetune_config

    overrides = _overrides(args)
    cfg, tags = finetune_config(recipes.get_recipe(args.recipe), args.source, overrides)
    connect_ray(cfg, args.address)
    ensure_shards(cfg)
    summary = run_training(cfg, tracking=not args.no_tracking, extra_tags=tags)
    m = summary.metrics
    print(f"[{summary.run_name}] done in {summary.seconds:.0f}s: step {m.get('step')}, "
          f"val/top1 {m.get('val/top1', float('nan')):.4f}, val/loss {m.get('val/loss', float('nan')):.4f}")
    print(f"  checkpoint: {summary.checkpoint}")
    if summary.mlflow_run_id:
        print(f"  MLflow run: {summary.mlflow_run_id}")
    return 0


@command
def cmd_sweep(args: argparse.Namespace) -> int:
    from . import recipes
    from .tracking.compare import compare_rows, format_table
    from .train.trainer import connect_ray, ensure_shards
    from .tune.sweep import build_spec, dataset_configs, run_sweep

    overrides = _overrides(args)
    overrides += [f"tune.scheduler={args.scheduler}"] if args.scheduler else []
    base = recipes.resolve(args.recipe, overrides, check_paths=False)
    space = {}
    for item in args.space:
        key, _, values = item.partition("=")
        space[key] = [_scalar(v) for v in values.split(",") if v]
    spec = build_spec(args.name or args.recipe, base, args.recipe, overrides,
                      recipes=args.datasets.split(",") if args.datasets else None,
                      sources=args.sources or None, extra_space=space)
    connect_ray(base, args.address)
    for cfg in dataset_configs(spec):  # shards once, before trials race for them
        ensure_shards(cfg)
    summary = run_sweep(spec, resume=args.resume)
    print(format_table(compare_rows(spec.tracking_uri, spec.experiment, sweep=spec.name)))
    for dataset, best in summary["best"].items():
        print(f"best on {dataset}: {best['run_name']} {spec.metric} {best['top1']:.4f}")
    if summary["failed"]:
        print(f"{len(summary['failed'])} trial(s) failed:", file=sys.stderr)
        for f in summary["failed"]:
            print(f"  {f['trial']}: {f['error']}", file=sys.stderr)
    return 0


def _scalar(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


@command
def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(quick=args.quick, fresh=args.fresh, work_dir=args.work_dir, address=args.address)
    return 0


@command
def cmd_fewshot(args: argparse.Namespace) -> int:
    from . import recipes
    from .train.trainer import connect_ray, ensure_shards
    from .tune.fewshot import run_fewshot

    overrides = _overrides(args)
    cfg = recipes.resolve(args.recipe, overrides)
    connect_ray(cfg, args.address)
    ensure_shards(cfg)
    result = run_fewshot(cfg, args.source, tracking=not args.no_tracking)
    for key, value in result.items():
        if key.startswith("fewshot/"):
            print(f"{key}: {value:.4f}")
    if result.get("run_id"):
        print(f"MLflow run: {result['run_id']}")
    return 0


@command
def cmd_import(args: argparse.Namespace) -> int:
    from .model.convert import import_weights

    out = import_weights(args.source, args.out, fmt=args.format, image_size=args.image_size,
                         num_classes=args.num_classes)
    print(f"wrote {out} (fine-tune with: vitp finetune RECIPE --from {out})")
    return 0


@command
def cmd_attention(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from PIL import Image

    from .data.ingest import normalize
    from .model.attention import (attention_rollout, mean_attention_distance, plot_attention_distance,
                                  save_rollout_png)
    from .train.export import load_model

    model = load_model(args.checkpoint)
    size = model.image_size
    img = Image.open(args.image).convert("RGB")
    side = min(img.size)  # resize shorter side + centre crop, as evaluation does
    left, top = (img.width - side) // 2, (img.height - side) // 2
    img = img.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)
    arr = np.asarray(img, dtype=np.uint8)
    x = normalize(torch.from_numpy(arr)[None]).contiguous()
    os.makedirs(args.out, exist_ok=True)
    roll = attention_rollout(model, x)[0]
    p1 = save_rollout_png(arr, roll, os.path.join(args.out, "rollout.png"))
    p2 = plot_attention_distance(mean_attention_distance(model, x), os.path.join(args.out, "attention_distance.png"))
    print(f"wrote {p1} and {p2}")
    return 0


@command
def cmd_compare(args: argparse.Namespace) -> int:
    from .tracking.compare import compare_rows, format_table, sweep_parents
    from .tracking.plots import log_plot_to_parent, plot_compare

    uri = _tracking_uri(args)
    tags = dict(t.split("=", 1) for t in args.tag)
    rows = compare_rows(uri, args.experiment, sweep=args.sweep, tags=tags, filter_string=args.filter)
    print(format_table(rows, args.format))
    if args.plot:
        out = plot_compare(uri, rows, args.plot)
        for parent in sweep_parents(rows):
            log_plot_to_parent(uri, parent, out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _tracking_uri(args: argparse.Namespace) -> str:
    """--tracking-uri, else the recipe's default store (sqlite in its work_dir)."""
    from . import recipes
    from .tracking import resolve_tracking_uri

    if args.tracking_uri:
        return args.tracking_uri
    cfg = recipes.resolve(args.recipe, args.overrides, check_paths=False)
    return resolve_tracking_uri(cfg)


@command
def cmd_export(args: argparse.Namespace) -> int:
    from .train.export import export

    out = args.out or args.checkpoint.rstrip("/") + "-export"
    export(args.checkpoint, out)
    print(f"wrote {out}/model.safetensors and {out}/config.json")
    return 0


def _overrides(args: argparse.Namespace) -> list[str]:
    """--set items, plus --tracking-uri as the tracking.uri override."""
    return list(args.overrides) + ([f"tracking.uri={args.tracking_uri}"] if args.tracking_uri else [])


# ------------------------------------------------------------------------ entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitp",
        description="Pre-train and transfer Vision Transformers on Ray (Data, Train + DeepSpeed, "
                    "Tune) with MLflow tracking.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("config", help="print a recipe's resolved config as JSON")
    p.add_argument("recipe", nargs="?", help="recipe name")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set optim.lr=0.003 (repeatable)")
    p.add_argument("--list", action="store_true", help="list the recipes")
    p.add_argument("--keys", action="store_true", help="list every settable dotted key")
    p.add_argument("--no-path-check", action="store_true",
                   help="skip checking that data paths exist (to inspect a cluster recipe locally)")

    p = sub.add_parser("model", help="params and GFLOPs of a ViT variant")
    p.add_argument("variant", help='e.g. "B/16", "H/14", "Ti/16"')
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--head", choices=["finetune", "pretrain"], default="finetune",
                   help="finetune = linear head (timm's counts); pretrain adds the tanh pre-logits")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("synth", help="render the synthetic fractal corpus (ImageFolder) with Ray Data")
    _add_recipe_args(p)
    p.add_argument("--out", help="output directory (default <work_dir>/synth)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("preprocess", help="decode, validate, resize and shard a corpus to Parquet")
    _add_recipe_args(p)
    p.add_argument("--out", help="shard directory (default data.shards or <work_dir>/shards/<source>)")
    p.add_argument("--overwrite", action="store_true", help="replace existing shards")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("pretrain", help="pre-train a ViT with Ray Train + DeepSpeed ZeRO")
    _add_recipe_args(p)
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite in work_dir)")
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("finetune", help="fine-tune from pre-trained weights (or scratch) with the transfer recipe")
    _add_recipe_args(p)
    p.add_argument("--from", dest="source", required=True,
                   help="checkpoint dir, export dir (vitp export / vitp import), .safetensors file, or 'scratch'")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite in work_dir)")
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("fewshot", help="few-shot linear evaluation (1/5/10/25 shots, 3 seeds) of weights")
    _add_recipe_args(p)
    p.add_argument("--from", dest="source", required=True, help="export dir, checkpoint dir or weights file")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite in work_dir)")
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("import", help="convert official .npz / timm / Hugging Face ViT weights to ours")
    p.add_argument("source", help="a .npz, .safetensors, .pt or .bin file")
    p.add_argument("--out", required=True, help="export directory to write (model.safetensors + config.json)")
    p.add_argument("--format", default="auto", choices=["auto", "official", "timm", "hf", "ours"])
    p.add_argument("--image-size", type=int, help="resolution the weights were trained at (default: from the pos-embed grid)")
    p.add_argument("--num-classes", type=int, help="override the inferred head size")

    p = sub.add_parser("attention", help="attention rollout PNG and mean attention distance plot")
    p.add_argument("checkpoint", help="export dir (vitp export / import) or checkpoint dir")
    p.add_argument("image", help="an image file")
    p.add_argument("--out", default="attention", help="output directory (default ./attention)")

    p = sub.add_parser("demo", help="the whole pipeline on this machine: corpus -> pre-train -> sweep -> table")
    p.add_argument("--quick", action="store_true", help="a smaller run (under ~3 minutes on 2 cores)")
    p.add_argument("--fresh", action="store_true", help="start over instead of reusing what is built")
    p.add_argument("--work-dir", help="where everything goes (default work/demo or work/demo-quick)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("sweep", help="Ray Tune sweep of fine-tuning runs (lr x datasets x sources)")
    _add_recipe_args(p)
    p.add_argument("--name", help="sweep name (default: the recipe); also the MLflow parent run")
    p.add_argument("--datasets", help="comma-separated fine-tuning recipes to sweep over, e.g. "
                                      "finetune_cifar10,finetune_pets")
    p.add_argument("--from", dest="sources", action="append", default=[],
                   help="a source to start from (repeatable): checkpoint/export path or 'scratch'")
    p.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2",
                   help="add a grid axis, e.g. --space optim.lr=0.01,0.03 (repeatable)")
    p.add_argument("--scheduler", choices=["none", "asha"], help="override tune.scheduler")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite in work_dir)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or a local Ray)")

    p = sub.add_parser("compare", help="table (text/CSV/JSON) and plot of runs from MLflow")
    p.add_argument("--recipe", default="debug", help="recipe whose MLflow store to read (default debug)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the recipe (e.g. --set work_dir=...)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (overrides the recipe's store)")
    p.add_argument("--experiment", action="append", help="experiment name(s); default all")
    p.add_argument("--sweep", help="only the runs of this sweep")
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="filter by tag")
    p.add_argument("--filter", default="", help="an MLflow filter string, ANDed with the rest")
    p.add_argument("--format", choices=["text", "csv", "json"], default="text")
    p.add_argument("--plot", metavar="PNG", help="also write learning curves + best top-1 per dataset")

    p = sub.add_parser("export", help="consolidate a checkpoint into fp32 safetensors + config.json")
    p.add_argument("checkpoint", help="a checkpoint directory written by pretrain/finetune")
    p.add_argument("--out", help="output directory (default CHECKPOINT-export)")

    # Cluster commands (submit, jobs, mlflow-server) register their own parsers and handlers.
    from . import submit

    COMMANDS.update(submit.add_parsers(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"vitp {args.command}: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"vitp {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
