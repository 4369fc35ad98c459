"""`vitp` commands that look before anything runs: config (a recipe's resolved config, its keys),
model (a variant's params, FLOPs and training memory), plan (the cheapest setting that fits).

Each parser sits beside its handler; a handler parses, calls the module that owns the work, prints.
Must not contain logic; torch is imported inside the handler that needs it.
"""
from __future__ import annotations

import argparse
import json

from vitp import recipes
from vitp.cli.args import Handler, add_recipe, add_tracking, positive, run_from
from vitp.config import ExperimentConfig, set_values, validate
from vitp.config.keydoc import key_table
from vitp.errors import ConfigError, InputError


# ------------------------------------------------------------------------------ config


def cmd_config(args: argparse.Namespace) -> int:
    if args.list:
        for name, fn in recipes.RECIPES.items():
            first = (fn.__doc__ or "").strip().splitlines()[0]
            print(f"{name:24s} {first}")
        return 0
    if not args.recipe:
        raise ConfigError("name a recipe, or --list to see them")
    cfg = run_from(args, check_paths=False).cfg  # reading a recipe needs none of its paths to exist here
    print(key_table(cfg) if args.keys else cfg.to_json())
    return 0


def _add_config(sub) -> Handler:
    p = sub.add_parser("config", help="print a recipe's resolved config as JSON")
    add_recipe(p, optional=True)
    p.add_argument("--list", action="store_true", help="list the recipes")
    p.add_argument("--keys", action="store_true",
                   help="list every key --set takes: its type, the recipe's value (and the default), its meaning")
    p.add_argument("--no-path-check", action="store_true", help=argparse.SUPPRESS)  # the default now; old scripts pass it
    add_tracking(p, can_disable=False, help="MLflow tracking URI: where --like reads the run, and the config's "
                                            "tracking.uri")
    return cmd_config


# ------------------------------------------------------------------------------- model


def cmd_model(args: argparse.Namespace) -> int:
    from vitp.model.flops import forward_flops, resnet_cost, training_flops  # lazy: keeps vitp --help fast (torch)
    from vitp.model.memory import estimate
    from vitp.model.vit import build_vit  # lazy: keeps vitp --help fast (torch)

    cfg = validate(set_values(ExperimentConfig(), {"model.variant": args.variant, "model.head": args.head,
                                                   "model.num_classes": args.num_classes,
                                                   "data.image_size": args.image_size}), check_paths=False)
    model = build_vit(cfg.model, args.image_size, device="meta")  # counts without allocating
    params = sum(p.numel() for p in model.parameters())
    rep = model.representation_size if args.head == "pretrain" else None
    fwd = forward_flops(args.variant, args.image_size, args.num_classes, rep)
    mem = estimate(args.variant, args.image_size, zero_stage=args.zero, world=args.workers,
                   micro_batch=args.micro_batch, precision=args.precision, checkpointing=args.checkpointing,
                   offload_optimizer=args.offload, offload_params=args.offload and args.zero == 3,
                   num_classes=args.num_classes, representation_size=rep)
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
        "memory": {"zero_stage": args.zero, "workers": args.workers, "micro_batch": args.micro_batch,
                   "precision": args.precision, "checkpointing": args.checkpointing, "offload": args.offload,
                   **{k: round(v, 3) for k, v in mem.gb().items() if k != "params_m"}},
    }
    spec = model.spec
    if spec.hybrid:  # the ResNet's share; the memory model counts its parameters, not its activations
        macs, n = resnet_cost(spec, args.image_size)
        info["resnet"] = {"blocks": list(spec.resnet), "root_width": spec.resnet_width, "stride": spec.stride,
                          "patch": spec.patch, "params_m": round(n / 1e6, 3), "forward_gflops": round(2 * macs / 1e9, 2)}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"ViT-{args.variant} at {args.image_size}px: {info['params_m']:.2f}M params, "
          f"{info['forward_gflops']:.1f} GFLOPs forward / {info['train_gflops']:.1f} training per image")
    print(f"  depth {info['depth']}, width {info['width']}, MLP {info['mlp_dim']}, heads "
          f"{info['heads']}, {info['tokens']} tokens, {args.head} head with {args.num_classes} classes")
    if "resnet" in info:
        r = info["resnet"]
        print(f"  ResNet: blocks {tuple(r['blocks'])}, root width {r['root_width']}, {r['params_m']:.2f}M params, "
              f"{r['forward_gflops']:.1f} GFLOPs; {r['patch']}x{r['patch']} patches of its /{r['stride'] // r['patch']} "
              f"map (activation memory below is the Transformer's)")
    print(f"  memory per worker, ZeRO-{args.zero} on {args.workers} workers, micro-batch {args.micro_batch}, "
          f"{args.precision}{', activation checkpointing' if args.checkpointing else ''}"
          f"{', offload' if args.offload else ''}: {mem.device / 1e9:.2f} GB")
    print(f"    model states {mem.states / 1e9:.2f} GB (ZeRO paper: {mem.paper_states / 1e9:.2f}), "
          f"DeepSpeed buffers {mem.buffers / 1e9:.2f}, activations {mem.activations / 1e9:.2f}"
          + (f"; in host memory {mem.host / 1e9:.2f} GB" if mem.host else ""))
    return 0


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-size", type=positive(), default=224, help="image side in pixels")
    p.add_argument("--num-classes", type=positive(), default=1000, help="classifier outputs")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16", help="training dtype")


def _add_model(sub) -> Handler:
    p = sub.add_parser("model", help="params, GFLOPs and training memory of a ViT variant")
    p.add_argument("variant", help='e.g. "B/16", "H/14", "Ti/16"')
    _add_memory_args(p)
    p.add_argument("--head", choices=["finetune", "pretrain"], default="finetune",
                   help="finetune = linear head (timm's counts); pretrain adds the tanh pre-logits")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (memory estimate)")
    p.add_argument("--workers", type=positive(), default=1, help="data-parallel workers (GPUs)")
    p.add_argument("--micro-batch", type=positive(), default=1, help="images per worker per forward")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--offload", action="store_true", help="optimizer (and ZeRO-3 parameter) offload to CPU")
    p.add_argument("--json", action="store_true", help="print JSON")
    return cmd_model


def cmd_plan(args: argparse.Namespace) -> int:
    from vitp.model.memory import plan, plan_overrides
    from vitp.model.variants import decode_variant

    decode_variant(args.variant)  # a bad name is one ConfigError line
    settings = plan(args.variant, args.image_size, gpus=args.gpus, gpu_mem_gb=args.gpu_mem,
                    precision=args.precision, max_micro_batch=args.max_micro_batch, num_classes=args.num_classes)
    if not settings:
        raise InputError(f"ViT-{args.variant} at {args.image_size}px does not fit {args.gpus} GPU(s) of "
                         f"{args.gpu_mem:g} GB even with ZeRO-3, offload, checkpointing and micro-batch 1: "
                         "use more GPUs or a smaller variant / image size")
    if args.json:
        print(json.dumps([{"zero_stage": s.zero_stage, "micro_batch": s.micro_batch,
                           "checkpointing": s.checkpointing, "offload": s.offload, "cost": round(s.cost, 3),
                           **{k: round(v, 3) for k, v in s.estimate.gb().items()}} for s in settings], indent=2))
        return 0
    best = settings[0]
    overrides = plan_overrides(best, args.variant, args.image_size, args.precision, args.gpus, args.global_batch)
    print(f"ViT-{args.variant} at {args.image_size}px on {args.gpus} x {args.gpu_mem:g} GB, {args.precision}: "
          f"use ZeRO-{best.zero_stage}, micro-batch {best.micro_batch}"
          f"{', activation checkpointing' if best.checkpointing else ''}{', offload' if best.offload else ''}")
    print("  " + " ".join(f"--set {k}={v}" for k, v in overrides.items()))
    print(f"  {'zero':>4} {'micro':>5} {'ckpt':>4} {'offload':>7} {'states':>7} {'acts':>7} {'total GB':>8} {'cost':>5}")
    for s in settings[:args.top]:
        e = s.estimate
        print(f"  {s.zero_stage:>4} {s.micro_batch:>5} {'yes' if s.checkpointing else 'no':>4} "
              f"{'yes' if s.offload else 'no':>7} {e.states / 1e9:>7.2f} {e.activations / 1e9:>7.2f} "
              f"{e.device / 1e9:>8.2f} {s.cost:>5.2f}")
    return 0


def _add_plan(sub) -> Handler:
    p = sub.add_parser("plan", help="the cheapest ZeRO stage / micro-batch / checkpointing / offload that fits")
    p.add_argument("variant", help='e.g. "H/14"')
    _add_memory_args(p)
    p.add_argument("--gpus", type=positive(), default=8, help="data-parallel GPUs")
    p.add_argument("--gpu-mem", type=positive(float), default=80.0, help="GB per GPU (H100 80, H200 141, A100 40/80)")
    p.add_argument("--max-micro-batch", type=positive(), default=256, help="largest micro-batch tried")
    p.add_argument("--global-batch", type=positive(), default=4096,
                   help="images per optimizer step (the paper's 4096): the printed --set line derives "
                        "the gradient accumulation from it")
    p.add_argument("--top", type=int, default=6, help="settings listed, cheapest first")
    p.add_argument("--json", action="store_true", help="print JSON")
    return cmd_plan


def add_parsers(sub) -> dict[str, Handler]:
    """Add this group's subcommands to `sub`; returns {command name: handler}."""
    return {"config": _add_config(sub), "model": _add_model(sub), "plan": _add_plan(sub)}
