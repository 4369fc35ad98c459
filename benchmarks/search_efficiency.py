"""Search efficiency on the demo's downstream task: grid vs random vs Optuna TPE (and ASHA + TPE),
the same trial budget and trial length, three seeds each, through the `vitp sweep` a user runs.

Each search fine-tunes the demo pre-training's export (`vitp pretrain demo`, exported once) on
demo_fractals at 20 % of its labels, `--budget` trials of the recipe's length, 2 at a time, over
the SGD learning rate and momentum: grid = 3 learning rates x 2 momenta (the paper's kind of grid);
random and optuna draw `optim.lr=loguniform(1e-3, 1)` and `optim.momentum=uniform(0.5, 0.99)`;
asha+optuna is optuna with ASHA stopping trials early. Seed s sets tune.seed and train.seed. From
MLflow (vitp.tracking.search_curve): the best val/top1 so far after each trial, in the order trials
ended, mean over seeds; and how many trials each search needed to reach the grid's best.

Run:  .venv/bin/python benchmarks/search_efficiency.py --workdir work/search-eff [--budget 6]
A rerun with the same --workdir reuses the export and finished sweeps. The table goes to stdout and
benchmarks/RESULTS.md (`--results PATH`, `--no-results`), the curves to --png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from augreg_demo import export_of_demo_pretraining, sweep  # benchmarks/, beside this script
from record import add_results_args, append_result

GRID = ["--space", "optim.lr=0.01,0.03,0.1", "--space", "optim.momentum=0.8,0.95"]
DRAWN = ["--space", "optim.lr=loguniform(1e-3, 1)", "--space", "optim.momentum=uniform(0.5, 0.99)"]
SEARCHES = {"grid": ["--search", "grid", *GRID], "random": ["--search", "random", *DRAWN],
            "optuna": ["--search", "optuna", *DRAWN],
            "asha+optuna": ["--search", "optuna", "--scheduler", "asha", *DRAWN]}


def curve(work: str, name: str) -> list[float]:
    """Best val/top1 so far after each ended trial of sweep `name` (one dataset)."""
    from vitp.paths import RunPaths
    from vitp.tracking.compare import compare_rows
    from vitp.tracking.search_curve import best_so_far

    rows = compare_rows(f"sqlite:///{RunPaths(work).mlflow_db()}", None, sweep=name)
    (points,) = best_so_far(rows).values()
    return [p["best"] if p["best"] is not None else float("nan") for p in points]


def trials_to_reach(values: list[float], target: float) -> int | None:
    return next((i + 1 for i, v in enumerate(values) if v >= target), None)


def plot(curves: dict[str, list[list[float]]], path: str, budget: int) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    for search, runs in curves.items():
        mean = [statistics.fmean(r[i] for r in runs) for i in range(budget)]
        ax.step(range(1, budget + 1), mean, where="post", label=f"{search} (mean of {len(runs)} seeds)")
    ax.set_xlabel("trials used")
    ax.set_ylabel("best val/top1 so far")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("demo_fractals fine-tuning: search efficiency")
    fig.tight_layout()
    fig.savefig(path, format="png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="work/search-eff", help="the work_dir of every command (kept: reruns reuse it)")
    ap.add_argument("--budget", type=int, default=6, help="trials per search (the grid's: 3 x 2 = 6)")
    ap.add_argument("--startup", type=int, default=3, help="optuna's random trials before TPE proposes")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fraction", type=float, default=0.2, help="the part of the train split's labels used")
    ap.add_argument("--searches", default=",".join(SEARCHES), help="which of " + ", ".join(SEARCHES))
    ap.add_argument("--extra", action="append", default=[], metavar="--set=KEY=VALUE",
                    help="more arguments for every sweep (e.g. --extra=--set=train.steps=40 for a smoke run)")
    ap.add_argument("--png", default="benchmarks/search_efficiency.png")
    add_results_args(ap)
    args = ap.parse_args()
    work, t0 = os.path.abspath(args.workdir), time.time()
    seeds = [int(s) for s in args.seeds.split(",")]
    export = export_of_demo_pretraining(work)
    curves: dict[str, list[list[float]]] = {}
    for search in args.searches.split(","):
        for seed in seeds:
            name = f"eff-{search.replace('+', '-')}-s{seed}"
            samples = 1 if search == "grid" else args.budget  # the grid is the budget; drawn searches draw it
            sweep(work, name, "--from", export, "--set", f"work_dir={work}", "--set",
                  f"data.train_fraction={args.fraction}", "--set", f"tune.num_samples={samples}",
                  "--set", f"tune.seed={seed}", "--set", f"train.seed={seed}",
                  "--set", "tune.max_concurrent_trials=2", "--set", f"tune.startup_trials={args.startup}",
                  *SEARCHES[search], *args.extra)
            values = curve(work, name)
            curves.setdefault(search, []).append(values + [values[-1]] * (args.budget - len(values)))
    target = statistics.fmean(r[-1] for r in curves["grid"]) if "grid" in curves else None
    marks = sorted({max(1, args.budget // 3), max(1, args.budget // 2), args.budget})
    lines = [f"| search | best top-1 after {' / '.join(map(str, marks))} trials (mean ± std of seeds) | trials to "
             "reach the grid's best (per seed) |", "|---|---|---|"]
    for search, runs in curves.items():
        cells = []
        for k in marks:
            at = [r[k - 1] for r in runs]
            cells.append(f"{statistics.fmean(at):.3f} ± {statistics.stdev(at) if len(at) > 1 else 0:.3f}")
        reach = [trials_to_reach(r, target) if target is not None else None for r in runs]
        lines.append(f"| {search} | {' / '.join(cells)} | {', '.join('-' if n is None else str(n) for n in reach)} |")
    table = "\n".join(lines)
    plot(curves, args.png, args.budget)
    notes = (f"demo_fractals fine-tuned from the demo pre-training's export, {args.fraction:.0%} of the labels, "
             f"{args.budget} trials per search, 2 at a time, seeds {args.seeds} (tune.seed and train.seed); grid: "
             f"optim.lr 0.01/0.03/0.1 x optim.momentum 0.8/0.95; random/optuna: optim.lr=loguniform(1e-3, 1), "
             f"optim.momentum=uniform(0.5, 0.99); optuna's first {args.startup} trials random (tune.startup_trials). "
             f"The grid's "
             f"best (mean of its seeds) is {target if target is None else f'{target:.3f}'}. Curves: {args.png}. "
             f"{time.time() - t0:.0f} s in all.")
    print(f"\n{notes}\n\n{table}")
    append_result(args.results, "Search efficiency (`benchmarks/search_efficiency.py`)", table, notes=notes)


if __name__ == "__main__":
    main()
