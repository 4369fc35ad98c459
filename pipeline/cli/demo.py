"""`vitp demo`: the whole pipeline on one small machine, each stage reusing what is built.

Local Ray -> fractal corpus -> shards -> ZeRO-2 pre-training -> export -> few-shot -> Tune sweep
(digits, pre-trained vs scratch) -> MLflow table + plot. Orchestration only: each stage calls the
module that owns it; configs change through typed values, never `--set` strings.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from pipeline import storage
from pipeline.cli.args import Handler, add_address
from pipeline.config import set_values, validate
from pipeline.recipes import get_recipe

# --quick: the same stages, small enough for under 3 minutes on 2 cores.
QUICK_PRETRAIN: dict[str, Any] = {
    "data.synth_classes": 10, "data.synth_images_per_class": 48, "data.num_classes": 10,
    "model.num_classes": 10, "train.steps": 40, "train.eval_every": 20, "train.checkpoint_every": 20,
    "optim.warmup_steps": 5,
}
QUICK_FINETUNE: dict[str, Any] = {
    "train.steps": 40, "train.eval_every": 20, "train.log_every": 20, "tune.space": {"optim.lr": [0.1]},
}


def run_demo(quick: bool = False, fresh: bool = False, work_dir: str | None = None,
             address: str | None = None, log: Callable[[str], None] = print) -> dict:
    from pipeline.cluster.connect import connect_ray  # lazy: keeps vitp --help fast (ray)
    from pipeline.data.commands import ensure_shards  # lazy: keeps vitp --help fast (ray, pyarrow)
    from pipeline.tracking.compare import compare_rows, format_table  # lazy: keeps vitp --help fast (mlflow)
    from pipeline.tracking.plots import log_plot_to_parent, plot_compare  # lazy: keeps vitp --help fast (mlflow)
    from pipeline.tracking.store import resolve_tracking_uri  # lazy: keeps vitp --help fast (mlflow)
    from pipeline.train.export import export  # lazy: keeps vitp --help fast (torch)
    from pipeline.train.trainer import run_training  # lazy: keeps vitp --help fast (torch, ray)
    from pipeline.tune.fewshot import run_fewshot  # lazy: keeps vitp --help fast (torch)
    from pipeline.tune.sweep import build_spec, dataset_configs, run_sweep  # lazy: keeps vitp --help fast (ray)

    t0 = time.time()
    work = work_dir or ("work/demo-quick" if quick else "work/demo")
    if fresh and storage.exists(work):
        log(f"[demo] --fresh: removing {work}")
        storage.rmtree(work)
    work = storage.abspath(work)
    pre = validate(set_values(get_recipe("demo"), {"work_dir": work, **(QUICK_PRETRAIN if quick else {})}),
                   check_paths=False)
    ft_changes = {"work_dir": work, **(QUICK_FINETUNE if quick else {})}
    ft = validate(set_values(get_recipe("demo_finetune"), ft_changes), check_paths=False)
    timings: dict[str, float] = {}

    def stage(name: str, t: float) -> None:
        timings[name] = time.time() - t
        log(f"[demo] {name}: {timings[name]:.0f}s")

    t = time.time()
    connect_ray(pre, address)
    stage("ray start", t)

    t = time.time()
    log(f"[demo] 1/5 corpus: {pre.data.synth_classes} fractal classes x {pre.data.synth_images_per_class} "
        f"images -> Parquet shards (reused if present)")
    ensure_shards(pre, log=log)
    stage("corpus + shards", t)

    t = time.time()
    log(f"[demo] 2/5 pre-training {pre.model.variant} for {pre.train.steps} steps with DeepSpeed "
        f"ZeRO-{pre.parallel.zero_stage} on {pre.parallel.num_workers} workers (resumes if interrupted)")
    summary = run_training(pre)
    export_dir = storage.join(work, "export")
    export(summary.checkpoint, export_dir)
    stage("pre-training", t)

    t = time.time()
    log("[demo] 3/5 few-shot linear evaluation of the pre-trained features on digits")
    fewshot = {}
    try:
        ensure_shards(ft, log=log)
        fewshot = run_fewshot(set_values(ft, {"tracking.experiment": pre.tracking.experiment}), export_dir)
        log("[demo]   " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in fewshot.items()
                                    if k.startswith("fewshot/")))
    except Exception as e:  # the demo goes on; the failure is shown, not hidden
        log(f"[demo]   few-shot evaluation failed: {e}")
    stage("few-shot", t)

    t = time.time()
    log("[demo] 4/5 Tune sweep: fine-tune digits from the pre-trained weights and from scratch")
    spec = build_spec("demo-quick" if quick else "demo", ft, "demo_finetune", [], changes=ft_changes,
                      sources=[export_dir, "scratch"])
    for cfg in dataset_configs(spec):
        ensure_shards(cfg, log=log)
    resume = storage.exists(storage.join(spec.work_dir, "sweeps", spec.name, "tuner.pkl"))
    sweep = run_sweep(spec, resume=resume, log=log)
    stage("sweep", t)

    log("[demo] 5/5 comparison from MLflow")
    uri = resolve_tracking_uri(ft)
    rows = compare_rows(uri, spec.experiment, sweep=spec.name)
    plot_path = storage.join(work, "compare.png")
    plot_compare(uri, rows, plot_path)
    log_plot_to_parent(uri, sweep["parent_run_id"], plot_path)
    print(format_table(rows))
    best = {r["run_name"]: r["best_top1"] for r in rows if r["best_top1"] is not None}
    by_src: dict[str, float] = {}
    for r in rows:
        if r["best_top1"] is not None:
            key = "scratch" if r["source"] == "scratch" else "pre-trained"
            by_src[key] = max(by_src.get(key, 0.0), r["best_top1"])
    if len(by_src) == 2:
        verdict = "beat" if by_src["pre-trained"] > by_src["scratch"] else "did not beat"
        print(f"\npre-training {verdict} training from scratch on digits: best top-1 "
              f"{by_src['pre-trained']:.3f} (pre-trained) vs {by_src['scratch']:.3f} (scratch)")
    total = time.time() - t0
    print(f"plot: {plot_path}")
    print(f"open MLflow: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    print(f"demo finished in {total:.0f}s ({', '.join(f'{k} {v:.0f}s' for k, v in timings.items())})")
    return {"rows": rows, "best": best, "fewshot": fewshot, "sweep": sweep, "seconds": total,
            "plot": plot_path, "tracking_uri": uri}


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(quick=args.quick, fresh=args.fresh, work_dir=args.work_dir, address=args.address)
    return 0


def _add_demo(sub) -> Handler:
    p = sub.add_parser("demo", help="the whole pipeline on this machine: corpus -> pre-train -> sweep -> table")
    p.add_argument("--quick", action="store_true", help="a smaller run (under ~3 minutes on 2 cores)")
    p.add_argument("--fresh", action="store_true", help="start over instead of reusing what is built")
    p.add_argument("--work-dir", help="where everything goes (default work/demo or work/demo-quick)")
    add_address(p)
    return cmd_demo


def add_parsers(sub) -> dict[str, Handler]:
    """Add this group's subcommands to `sub`; returns {command name: handler}."""
    return {"demo": _add_demo(sub)}
