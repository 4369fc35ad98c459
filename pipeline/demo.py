"""`vitp demo`: the whole pipeline on one small machine, each stage reusing what is built.

Local Ray -> synthetic fractal corpus -> Parquet shards -> ZeRO-2 pre-training on 2 workers ->
export -> few-shot evaluation -> Tune sweep fine-tuning digits from the pre-trained weights and
from scratch -> MLflow comparison table + plot. Orchestration only: every stage is a call into
the modules that own it.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Callable

from .config import absolute_paths, apply_overrides
from .recipes import get_recipe

# --quick: the same stages, small enough for under 3 minutes on 2 cores.
QUICK_PRETRAIN = ["data.synth_classes=10", "data.synth_images_per_class=48", "data.num_classes=10",
                  "model.num_classes=10", "train.steps=40", "train.eval_every=20",
                  "train.checkpoint_every=20", "optim.warmup_steps=5"]
QUICK_FINETUNE = ["train.steps=40", "train.eval_every=20", "train.log_every=20", 'tune.space={"optim.lr": [0.1]}']


def run_demo(quick: bool = False, fresh: bool = False, work_dir: str | None = None,
             address: str | None = None, log: Callable[[str], None] = print) -> dict:
    from .tracking import resolve_tracking_uri
    from .tracking.compare import compare_rows, format_table
    from .tracking.plots import log_plot_to_parent, plot_compare
    from .train.export import export
    from .train.trainer import connect_ray, ensure_shards, run_training
    from .tune.sweep import build_spec, dataset_configs, run_sweep

    t0 = time.time()
    work = work_dir or ("work/demo-quick" if quick else "work/demo")
    if fresh and os.path.exists(work):
        log(f"[demo] --fresh: removing {work}")
        shutil.rmtree(work)
    work = os.path.abspath(work)
    common = [f"work_dir={work}"]
    pre = absolute_paths(apply_overrides(get_recipe("demo"), common + (QUICK_PRETRAIN if quick else [])))
    ft_overrides = common + (QUICK_FINETUNE if quick else [])
    ft = absolute_paths(apply_overrides(get_recipe("demo_finetune"), ft_overrides))
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
    export_dir = os.path.join(work, "export")
    export(summary.checkpoint, export_dir)
    stage("pre-training", t)

    t = time.time()
    log("[demo] 3/5 few-shot linear evaluation of the pre-trained features on digits")
    fewshot = {}
    try:
        from .tune.fewshot import run_fewshot

        ensure_shards(ft, log=log)
        fewshot = run_fewshot(apply_overrides(ft, ["tracking.experiment=" + pre.tracking.experiment]),
                              export_dir)
        log("[demo]   " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in fewshot.items()
                                    if k.startswith("fewshot/")))
    except Exception as e:  # the demo goes on; the failure is shown, not hidden
        log(f"[demo]   few-shot evaluation failed: {e}")
    stage("few-shot", t)

    t = time.time()
    log("[demo] 4/5 Tune sweep: fine-tune digits from the pre-trained weights and from scratch")
    spec = build_spec("demo-quick" if quick else "demo", ft, "demo_finetune", ft_overrides,
                      sources=[os.path.abspath(export_dir), "scratch"])
    for cfg in dataset_configs(spec):
        ensure_shards(cfg, log=log)
    sweep_path = os.path.join(spec.work_dir, "sweeps", spec.name)
    resume = os.path.exists(os.path.join(sweep_path, "tuner.pkl"))
    sweep = run_sweep(spec, resume=resume, log=log)
    stage("sweep", t)

    log("[demo] 5/5 comparison from MLflow")
    uri = resolve_tracking_uri(ft)
    rows = compare_rows(uri, spec.experiment, sweep=spec.name)
    table = format_table(rows)
    plot_path = os.path.abspath(os.path.join(work, "compare.png"))
    plot_compare(uri, rows, plot_path)
    log_plot_to_parent(uri, sweep["parent_run_id"], plot_path)
    print(table)
    best = {r["run_name"]: r["best_top1"] for r in rows if r["best_top1"] is not None}
    by_src = {}
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
