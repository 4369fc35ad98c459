"""AugReg at demo scale, through the `vitp` commands a user runs, three seeds per setting:

  (a) from scratch on the demo's 10 new fractal classes (`demo_fractals`) at 20 % of their labels:
      train.augreg none vs light2 vs medium2;
  (c) fine-tuning the demo's pre-trained export on the same task: layer-wise LR decay 0.75 vs none.

Each is one `vitp sweep` (the seeds are a swept key), read back with `vitp compare --seeds` (best
val/top1 of each seed, mean +- std). A rerun with the same --workdir continues the sweeps (--resume)
and reuses the pre-training.

Run:  .venv/bin/python benchmarks/augreg_demo.py --workdir work/augreg-demo
The tables are printed and appended, with this command line, the date and the machine, to
benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).
"""
from __future__ import annotations

import argparse
import os
import re
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="work/augreg-demo", help="the work_dir of every command (kept: reruns reuse it)")
    ap.add_argument("--fraction", type=float, default=0.2, help="the part of the train split's labels used")
    add_results_args(ap)
    args = ap.parse_args()
    work = os.path.abspath(args.workdir)
    common = ["--set", f"work_dir={work}", "--set", f"data.train_fraction={args.fraction}",
              "--space", f"train.seed={SEEDS}"]
    t0 = time.time()
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
