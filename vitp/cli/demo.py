"""`vitp demo`: the paper's point on one small machine. Local Ray -> fractal corpus -> ZeRO-2
pre-training -> export, register -> raw-pixel reference and few-shot (new fractal classes, digits)
-> Tune sweep (new fractal classes: 3 seeds, 3 data fractions; pre-trained vs scratch) -> seeds
table, low-data curve, MLflow. Orchestration only. docs/demo.md explains it.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from vitp import storage
from vitp.cli.args import Handler, add_address, key_value
from vitp.config import Run, set_values
from vitp.errors import InputError
from vitp.paths import RunPaths
from vitp.recipes import get_recipe

MAIN = ("demo_fractals", 0.2)  # the headline: new fractal classes, 20% of their train split
FRACTIONS = (0.05, 0.2, 1.0)  # the low-data curve on the same dataset
SEEDS = 3
MODEL_NAME = "vit-demo"  # the pre-trained model's name in the MLflow model registry
MARGIN = 0.05  # what "beats" means in the verdict: this much top-1 in every seed
RESULT_FILE = "demo-result.json"  # in the work dir: what the demo measured (demo_report.record)
UI_ADDRESS = "http://127.0.0.1:5000"  # where the printed `mlflow ui` command serves

# --quick: the same stages and the same headline comparison, smaller.
QUICK_PRETRAIN: dict[str, Any] = {
    "data.synth_classes": 50, "data.synth_images_per_class": 60, "data.num_classes": 50,
    "model.num_classes": 50, "train.steps": 200, "train.eval_every": 100, "train.checkpoint_every": 100,
}
QUICK_FINETUNE: dict[str, Any] = {"train.steps": 120, "train.eval_every": 60}
QUICK_FRACTIONS, QUICK_SEEDS = (0.2, 1.0), 1
# Reference and few-shot only (the sweep's time goes to the fractals): another domain, where these
# fractal features do not help (docs/demo.md)
OTHER_DOMAIN = "demo_finetune"


def _points(seed: int, quick: bool) -> list[dict[str, Any]]:
    """The sweep's trials (each crossed with both sources): the headline in SEEDS seeds (--quick:
    QUICK_SEEDS), the other fractions of the low-data curve in one."""
    recipe, main = MAIN
    pts = [{"recipe": recipe, "data.train_fraction": main, "train.seed": seed + i}
           for i in range(QUICK_SEEDS if quick else SEEDS)]
    return pts + [{"recipe": recipe, "data.train_fraction": f, "train.seed": seed}
                  for f in (QUICK_FRACTIONS if quick else FRACTIONS) if f != main]


def source_label(source: Any) -> str:
    """How the demo names a run's source: pre-trained, scratch, or the raw-pixel reference."""
    from vitp.eval.reference import SOURCE  # lazy: keeps vitp --help fast (ray)

    text = str(source or "?")
    return {"scratch": "scratch", SOURCE: "linear on raw pixels"}.get(text, "pre-trained")


class Stages:
    """Runs the demo's stages in order, timing each; a stage that fails is reported and the rest
    go on where they can (`required` stages stop the demo). `failed` decides the exit code."""

    def __init__(self, total: int, log: Callable[[str], None]):
        self.total, self.log, self.n = total, log, 0
        self.timings: dict[str, float] = {}
        self.failed: list[str] = []

    def run(self, name: str, what: str, fn: Callable[[], Any], required: bool = False) -> Any:
        self.n += 1
        self.log(f"[demo] {self.n}/{self.total} {name}: {what}")
        t = time.time()
        try:
            return fn()
        except Exception as e:
            lines = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {lines[-1] if lines else ''}"
            self.failed.append(f"{name}: {why}")
            self.log(f"[demo] {name} FAILED: {why}")
            if required:
                raise
            return None
        finally:
            self.timings[name] = time.time() - t
            self.log(f"[demo] {name}: {self.timings[name]:.0f}s")


# What the demo writes first into a work dir it makes (RunPaths.DEMO_MARKER): `--fresh` empties only
# a folder that holds it. A work dir of `vitp pretrain` holds the very names a demo writes (runs/,
# shards/, mlflow.db, mlartifacts/), so the names alone cannot tell the demo's from the user's.
MARKER = {"made_by": "vitp demo", "note": "vitp demo --fresh empties this folder; delete this file to stop it"}
MARKER_BYTES = 4096  # a marker is read only this small


def made_by_demo(paths: RunPaths) -> bool:
    """Whether the work dir holds the demo's marker: a regular file (not a link) of MARKER's JSON."""
    marker = paths.demo_marker
    if not storage.is_uri(marker) and os.path.islink(marker):
        return False
    size = storage.size(marker)  # None for a folder, a FIFO, nothing
    if size is None or size > MARKER_BYTES:
        return False
    try:
        return json.loads(storage.read_bytes(marker)).get("made_by") == MARKER["made_by"]
    except (OSError, ValueError, AttributeError):
        return False


def claim_work_dir(given: str, paths: RunPaths, fresh: bool, log: Callable[[str], None]) -> None:
    """Before the demo writes anything: a new or empty work dir is marked as the demo's (the marker is
    its first file). `fresh`: empty a marked one of what an earlier demo wrote (the marker stays);
    refuse (InputError, nothing deleted) one without the marker, or holding anything a demo does not
    write (`--work-dir ~` must not delete a home, `--work-dir work/debug` not a real run's work).
    `given`: the work dir as --work-dir gave it."""
    work = paths.work_dir
    if storage.exists(work) and not storage.isdir(work):
        raise InputError(f"--work-dir {given}: a file, not a folder; choose a folder for the demo's work")
    if not storage.listdir(work):
        storage.write_bytes(paths.demo_marker, json.dumps(MARKER).encode())
        return
    ours = made_by_demo(paths)
    if not fresh:
        if not ours:
            log(f"[demo] {work} was not made by vitp demo (no {paths.DEMO_MARKER} in it): reusing what is "
                "there; --fresh will not empty it")
        return
    if not ours:
        raise InputError(f"--work-dir {given}: not made by vitp demo (no {paths.DEMO_MARKER} file in it), so "
                         "--fresh deletes nothing there; choose a new --work-dir, or delete the folder yourself "
                         "if it holds only an older demo's work")
    foreign = paths.foreign_entries()
    if foreign:
        raise InputError(f"--work-dir {given}: holds files a demo did not write ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); --fresh removes only a demo's own work "
                         "dir: choose another --work-dir")
    own = [name for name in storage.listdir(work) if name != paths.DEMO_MARKER]
    if own:
        log(f"[demo] --fresh: removing {', '.join(own)} from {work}")
    for name in own:
        storage.rmtree(storage.join(work, name), work)


@dataclass
class _Demo:
    """What the demo runs, resolved once (`plan`), and one method a stage: each stage's work and its
    lines; `run_demo` puts them in order."""

    work: str
    seed: int
    quick: bool
    mpp: str  # "-mpp" for masked patch prediction (the corpus's labels unused), else ""
    pre: Run  # the pre-training
    ft_changes: dict[str, Any]  # what every downstream run gets on top of its recipe
    points: list[dict[str, Any]]  # the sweep's trials
    datasets: list[Run]  # one run per downstream dataset and fraction (reference, shards)
    log: Callable[[str], None]

    @classmethod
    def plan(cls, quick: bool, work_dir: str | None, seed: int, objective: str,
             changes: dict[str, dict[str, Any]], log: Callable[[str], None]) -> tuple["_Demo", str]:
        """The demo's runs, and the work dir as the user gave it (or its default)."""
        mpp = "-mpp" if objective == "mpp" else ""
        given = work_dir or ("work/demo" + mpp + (f"-seed{seed}" if seed else "") + ("-quick" if quick else ""))
        work = storage.abspath(given)
        pre = Run.resolve(set_values(get_recipe("demo"), {"work_dir": work, "train.seed": seed,
                                                          "train.objective": objective,
                                                          **(QUICK_PRETRAIN if quick else {}),
                                                          **changes.get("pretrain", {})}), check_paths=False)
        demo = cls(work, seed, quick, mpp, pre, {"work_dir": work, **(QUICK_FINETUNE if quick else {}),
                                                   **changes.get("finetune", {})}, _points(seed, quick), [], log)
        demo.datasets = [demo.downstream(r, f) for r, f in dict.fromkeys(
            [*((p["recipe"], p["data.train_fraction"]) for p in demo.points), (OTHER_DOMAIN, 1.0)])]
        return demo, given

    @property
    def name(self) -> str:
        """The sweep's name (and its tag on every run of the demo)."""
        return "demo" + self.mpp + ("-quick" if self.quick else "")

    @property
    def export_dir(self) -> str:
        return self.pre.paths.export

    def downstream(self, recipe: str, fraction: float) -> Run:
        return Run.resolve(set_values(get_recipe(recipe), {**self.ft_changes, "data.train_fraction": fraction}),
                           check_paths=False)

    def corpus(self) -> None:
        from vitp.data.commands import ensure_shards  # lazy: keeps vitp --help fast (ray, pyarrow)

        for run in [self.pre, *self.datasets]:
            ensure_shards(run, log=self.log)

    def pretrain(self) -> dict[str, Any]:
        from vitp.train.export import export  # lazy: keeps vitp --help fast (torch)
        from vitp.train.registry import register_export  # lazy: keeps vitp --help fast (mlflow)
        from vitp.train.report import log_report  # lazy: keeps vitp --help fast (torch)
        from vitp.train.trainer import run_training  # lazy: keeps vitp --help fast (torch, ray)

        summary = run_training(self.pre)
        log_report(self.pre, summary)
        export(summary.checkpoint, self.export_dir)
        registered = register_export(self.export_dir, MODEL_NAME + self.mpp, self.pre.tracking_uri, log=self.log)
        return {"pretrain_run_id": summary.mlflow_run_id, "model": registered["model_uri"]}

    def reference(self) -> dict:
        from vitp.eval.reference import run_reference  # lazy: keeps vitp --help fast (ray)

        out = {}
        for run in self.datasets:  # one per dataset and fraction: the seeds share it
            out[(run.cfg.recipe, run.cfg.data.train_fraction)] = run_reference(run, tags={"sweep": self.name})["top1"]
        self.log("[demo]   " + ", ".join(f"{r} {f:.0%}: {v:.3f}" for (r, f), v in out.items()))
        return out

    def fewshot(self) -> dict:
        from vitp.eval.fewshot import run_fewshot  # lazy: keeps vitp --help fast (torch)

        out = {}
        for recipe in (MAIN[0], OTHER_DOMAIN):
            got = run_fewshot(self.downstream(recipe, 1.0), self.export_dir)
            out[recipe] = {k: v for k, v in got.items() if k.startswith("fewshot/")}
            self.log(f"[demo]   {recipe}: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in out[recipe].items()))
        return out

    def sweep(self, stages: "Stages") -> dict | None:
        from vitp.tune.spec import build_spec  # lazy: keeps vitp --help fast (ray)
        from vitp.tune.sweep import run_sweep

        spec = build_spec(self.name, self.datasets[0].cfg, MAIN[0], [], changes=self.ft_changes,
                          sources=[self.export_dir, "scratch"], points=self.points)
        resume = storage.exists(storage.join(spec.dir, "tuner.pkl"))
        sweep = stages.run("sweep", f"Tune: {len(self.points) * 2} fine-tuning runs, pre-trained vs "
                           "scratch", lambda: run_sweep(spec, resume=resume, log=self.log))
        if sweep and sweep["failed"]:
            stages.failed.append(f"sweep: {len(sweep['failed'])} trial(s) failed: "
                                 + "; ".join(f"{f['trial']}: {f['error']}" for f in sweep["failed"]))
        return sweep

    def results(self, sweep: dict | None) -> dict:
        from vitp.tracking.compare import compare_rows  # lazy: keeps vitp --help fast (mlflow)
        from vitp.tracking.plots import log_plot_to_parent, plot_compare, plot_low_data  # lazy (mlflow)
        from vitp.tracking.seeds import aggregate_rows  # lazy: mlflow (through compare)
        from vitp.tracking.store import get_client, ui_url  # lazy: keeps vitp --help fast (mlflow)

        uri, experiment = self.datasets[0].tracking_uri, self.datasets[0].cfg.tracking.experiment
        rows = compare_rows(uri, experiment, sweep=self.name)
        groups = aggregate_rows([{**r, "source": source_label(r.get("source"))} for r in rows])
        curve = storage.join(self.work, "low_data.png")
        plot_low_data([g for g in groups if g["recipe"] == MAIN[0]], curve, label=str)
        plot = storage.join(self.work, "compare.png")
        plot_compare(uri, [r for r in rows if r.get("source") != "pixels"], plot)
        if sweep:
            for path in (curve, plot):
                log_plot_to_parent(uri, sweep["parent_run_id"], path)
        exp_id = get_client(uri).get_experiment_by_name(experiment).experiment_id
        return {"rows": rows, "groups": groups, "plots": [curve, plot], "tracking_uri": uri,
                "experiment": experiment, "ui_url": ui_url(UI_ADDRESS, exp_id)}


def run_demo(quick: bool = False, fresh: bool = False, work_dir: str | None = None,
             address: str | None = None, seed: int = 0, log: Callable[[str], None] = print,
             objective: str = "classify", changes: dict[str, dict[str, Any]] | None = None) -> dict:
    """Run the demo's stages; returns what it measured (also written to RESULT_FILE in the work
    dir). `changes` ({"pretrain": {key: value}, "finetune": {...}}) goes on top of the recipes and
    --quick's sizes, the "finetune" part to every downstream dataset: a smaller run of the same
    stages (the e2e suite's)."""
    from vitp.cli.demo_report import print_summary, record  # the summary block, the result file
    from vitp.cluster.connect import connect_ray  # lazy: keeps vitp --help fast (ray)

    t0 = time.time()
    demo, given = _Demo.plan(quick, work_dir, seed, objective, changes or {}, log)
    claim_work_dir(given, demo.pre.paths, fresh, log)  # the marker first, or --fresh's refusal
    result: dict[str, Any] = {"work_dir": demo.work, "seed": seed, "sweep_name": demo.name}
    connect_ray(demo.pre.cfg, address)
    stages, pc = Stages(6, log), demo.pre.cfg
    stages.run("corpus", f"{pc.data.synth_classes} fractal classes x {pc.data.synth_images_per_class} "
               f"images for pre-training; {len(demo.datasets)} downstream shard sets (reused if present)",
               demo.corpus, required=True)
    result.update(stages.run(
        "pre-training", f"{pc.model.variant} {'masked patch prediction' if demo.mpp else 'classification'} "
        f"for {pc.train.steps} steps with DeepSpeed ZeRO-{pc.parallel.zero_stage} on {pc.parallel.num_workers} "
        f"workers, seed {seed} (resumes if interrupted), then export and register", demo.pretrain, required=True))
    result["reference"] = stages.run("reference", "a linear classifier on the raw pixels (scikit-learn) "
                                     "of each downstream dataset", demo.reference)
    result["fewshot"] = stages.run("few-shot", "linear probes on the frozen pre-trained features "
                                   "(1/5/10/25 images a class)", demo.fewshot)
    result["sweep"] = sweep = demo.sweep(stages)
    result.update(stages.run("results", "seeds table and low-data curve from MLflow", lambda: demo.results(sweep))
                  or {})
    result.update(seconds=time.time() - t0, timings=stages.timings, failed=stages.failed)
    result["verdict"] = print_summary(result, main=MAIN, margin=MARGIN, quick=quick,
                                      main_cfg=demo.downstream(*MAIN).cfg)
    path = storage.join(demo.work, RESULT_FILE)
    storage.write_bytes(path, json.dumps(record(result, MAIN, quick), indent=1).encode())
    log(f"results: {path}")
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    from vitp.config import parse_value

    changes = {part: {key: parse_value(key, text) for key, text in getattr(args, f"{part}_set")}
               for part in ("pretrain", "finetune")}
    result = run_demo(quick=args.quick, fresh=args.fresh, work_dir=args.work_dir, address=args.address,
                      seed=args.seed, objective=args.objective, changes=changes)
    return 1 if result["failed"] else 0


def _add_demo(sub) -> Handler:
    p = sub.add_parser("demo", help="the paper's point on this machine: pre-train, transfer, compare "
                                    "with training from scratch")
    p.add_argument("--quick", action="store_true", help="a smaller run (about 3 minutes on 2 cores)")
    p.add_argument("--fresh", action="store_true", help="start over instead of reusing what is built (empties "
                                                         "only a work dir the demo made: it holds .vitp-demo)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the pre-training; the fine-tunes use SEED, SEED+1, SEED+2 (default 0)")
    p.add_argument("--objective", choices=["classify", "mpp"], default="classify",
                   help="pre-training objective: the corpus's labels, or masked patch prediction (self-supervised)")
    p.add_argument("--work-dir", help="where everything goes (default work/demo[-mpp][-seedN][-quick])")
    for part, what in (("pretrain", "the pre-training"), ("finetune", "every fine-tune, reference and few-shot")):
        p.add_argument(f"--{part}-set", action="append", default=[], type=key_value, metavar="KEY=VALUE",
                       help=f"change a config field of {what} on top of the demo's sizes, e.g. "
                            f"--{part}-set train.steps=20 (repeatable; a smaller demo to try the stages)")
    add_address(p)
    return cmd_demo


def add_parsers(sub) -> dict[str, Handler]:
    """Add this group's subcommands to `sub`; returns {command name: handler}."""
    return {"demo": _add_demo(sub)}
