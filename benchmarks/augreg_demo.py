"""AugReg at demo scale, through the `vitp` commands a user runs, three seeds per setting:

  (a) from scratch on the demo's 10 new fractal classes (`demo_fractals`) at 20 % of their labels:
      train.augreg none vs light2 vs medium2;
  (b) with --pretraining STEPS,...: the demo pre-training (`vitp pretrain demo`) with train.augreg
      none vs light2 at each length, three seeds, each export transferred as the demo does: fine-tuned
      on demo_fractals at the same label fraction (one sweep over the six exports) and few-shot probed;
  (c) fine-tuning the demo's pre-trained export on the same task: layer-wise LR decay 0.75 vs none.

(a) and (c) are one `vitp sweep` each (the seeds are a swept key), read back with `vitp compare
--seeds` (best val/top1 of each seed, mean +- std). A rerun with the same --workdir continues the
sweeps (--resume) and reuses pre-trainings and exports.

Run:  .venv/bin/python benchmarks/augreg_demo.py --workdir work/augreg-demo [--pretraining 600,2400]
The tables are printed and appended, with this command line, the date and the machine, to
benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from record import add_results_args, append_result  # benchmarks/record.py, beside this script

VITP = [sys.executable, "-m", "vitp.cli"]
SEEDS = "0,1,2"


def vitp(*args: str) -> str:
    """Run one `vitp` command; its output (raises with it when the command fails)."""
    t0 = time.time()
    print("$ vitp " + " ".join(args), flush=True)
    proc = subprocess.run([*VITP, *args], capture_output=True, text=True, env=dict(os.environ, RAY_ADDRESS=""))
    if proc.returncode:
        raise SystemExit(f"vitp {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  ({time.time() - t0:.0f} s)", flush=True)
    return proc.stdout


def sweep(work: str, name: str, *args: str) -> None:
    """`vitp sweep demo_fractals --name NAME ...`, continued (--resume) where an earlier run left it."""
    resume = ["--resume"] if os.path.isdir(os.path.join(work, "sweeps", name)) else []
    vitp("sweep", "demo_fractals", "--name", name, *args, *resume)


def seeds_table(work: str, sweep: str) -> str:
    return vitp("compare", "--recipe", "demo_fractals", "--set", f"work_dir={work}", "--sweep", sweep, "--seeds")


def export_of_demo_pretraining(work: str) -> str:
    """The demo pre-training (`vitp pretrain demo`, 600 steps) exported once into <work>/export."""
    out = os.path.join(work, "export")
    if not os.path.exists(os.path.join(out, "config.json")):
        said = vitp("pretrain", "demo", "--set", f"work_dir={work}")
        checkpoint = re.search(r"checkpoint: (\S+)", said).group(1)
        vitp("export", checkpoint, "--out", out)
    return out


PRETRAIN_SETTINGS = ("none", "light2")


def pretrained_export(work: str, setting: str, steps: int, seed: int) -> str:
    """`vitp pretrain demo` with one AugReg setting, length and seed, exported once."""
    out = os.path.join(work, f"pretrain-{setting}-{steps}-s{seed}")
    if not os.path.exists(os.path.join(out, "config.json")):
        said = vitp("pretrain", "demo", "--set", f"work_dir={work}", "--set", f"train.augreg={setting}",
                    "--set", f"tracking.run_name={os.path.basename(out)}",  # one run each, not a resume
                    "--set", f"train.seed={seed}", "--set", f"train.steps={steps}",
                    "--set", f"train.eval_every={steps // 2}", "--set", f"train.checkpoint_every={steps // 2}")
        vitp("export", re.search(r"checkpoint: (\S+)", said).group(1), "--out", out)
    return out


def pretraining_table(work: str, steps: int, fraction: float) -> str:
    """(b) at one length: each export fine-tuned (one sweep, train.seed 0) and few-shot probed;
    per setting, the mean +- std over the pre-training seeds of best val/top1 and 10-shot top-1."""
    exports = {(setting, seed): pretrained_export(work, setting, steps, seed)
               for setting in PRETRAIN_SETTINGS for seed in map(int, SEEDS.split(","))}
    sources = [a for e in exports.values() for a in ("--from", e)]
    sweep(work, f"augreg-pretrain-{steps}", *sources, "--set", f"work_dir={work}",
          "--set", f"data.train_fraction={fraction}")
    rows = json.loads(vitp("compare", "--recipe", "demo_fractals", "--set", f"work_dir={work}", "--format", "json"))
    for export in exports.values():
        if not any(r["source"] == export and r.get("fewshot_10") is not None for r in rows):
            vitp("fewshot", "demo_fractals", "--from", export, "--set", f"work_dir={work}")
    rows = json.loads(vitp("compare", "--recipe", "demo_fractals", "--set", f"work_dir={work}", "--format", "json"))
    tuned = {r["source"]: r["best_top1"] for r in rows if r["sweep"] == f"augreg-pretrain-{steps}" and r["status"] == "FINISHED"}
    probed = {r["source"]: r["fewshot_10"] for r in rows if r.get("fewshot_10") is not None}

    def stat(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}  ({', '.join(f'{v:.3f}' for v in values)})"

    lines = [f"{'pre-training':<22} {'fine-tuned best top-1':<40} 10-shot top-1"]
    for setting in PRETRAIN_SETTINGS:
        mine = [e for (s, _), e in exports.items() if s == setting]
        lines.append(f"{setting + f' {steps} steps':<22} {stat([tuned[e] for e in mine]):<40} "
                     f"{stat([probed[e] for e in mine])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="work/augreg-demo", help="the work_dir of every command (kept: reruns reuse it)")
    ap.add_argument("--fraction", type=float, default=0.2, help="the part of the train split's labels used")
    ap.add_argument("--pretraining", default="", help="measure (b) alone, at these pre-training lengths in steps, "
                                                      "e.g. 600,2400")
    add_results_args(ap)
    args = ap.parse_args()
    work = os.path.abspath(args.workdir)
    common = ["--set", f"work_dir={work}", "--set", f"data.train_fraction={args.fraction}",
              "--space", f"train.seed={SEEDS}"]
    t0 = time.time()
    if args.pretraining:
        lengths = [int(n) for n in args.pretraining.split(",")]
        table = "\n\n".join(f"```\n{pretraining_table(work, n, args.fraction)}\n```" for n in lengths)
        notes = (f"(b) the demo pre-training (`vitp pretrain demo`: pico/8 at 32 px, 100 fractal classes x 100 "
                 f"images, batch 256) with train.augreg none / light2 (RandAugment(2, 10), Mixup 0.2) at "
                 f"{' and '.join(map(str, lengths))} steps, pre-training seeds {SEEDS}; each export fine-tuned on "
                 f"demo_fractals at {args.fraction:.0%} of the labels (train.seed 0, best val/top1) and probed "
                 f"10-shot (linear, frozen features). {time.time() - t0:.0f} s in all.")
        print(f"\n{notes}\n\n{table}")
        append_result(args.results, "AugReg at demo scale: pre-training (`benchmarks/augreg_demo.py`)", table,
                      notes=notes)
        return
    sweep(work, "augreg-scratch", "--from", "scratch", "--space", "train.augreg=none,light2,medium2", *common)
    scratch = seeds_table(work, "augreg-scratch")
    export = export_of_demo_pretraining(work)
    sweep(work, "augreg-llrd", "--from", export, "--space", "optim.layer_decay=1.0,0.75", *common)
    llrd = seeds_table(work, "augreg-llrd")
    notes = (f"demo_fractals (10 fractal classes never seen in pre-training, pico/8 at 32 px, SGD lr 0.03, 200 "
             f"steps of batch 32), {args.fraction:.0%} of the train split's labels, seeds {SEEDS} (train.seed: "
             f"initialisation, data order, augmentation; the label subset is the same); best val/top1 of each "
             f"run. (a) from scratch, train.augreg none / light2 (RandAugment(2, 10), Mixup 0.2) / medium2 "
             f"(RandAugment(2, 15), Mixup 0.5). (c) from the demo pre-training's export (`vitp pretrain demo`, "
             f"600 steps), optim.layer_decay 1.0 (off) / 0.75. {time.time() - t0:.0f} s in all.")
    table = ("(a) from scratch, by train.augreg:\n\n```\n" + scratch.strip() + "\n```\n\n"
             "(c) fine-tuned from the demo pre-training, by optim.layer_decay:\n\n```\n" + llrd.strip() + "\n```")
    print(f"\n{notes}\n\n{table}")
    append_result(args.results, "AugReg at demo scale (`benchmarks/augreg_demo.py`)", table, notes=notes)


if __name__ == "__main__":
    main()
