"""Training images/s with few-shot probes during pre-training (train.fewshot_every) on vs off.

Run (from the repository root):

  .venv/bin/python benchmarks/fewshot_overhead.py --steps 200 --every 50 --rounds 2

The debug recipe (pico/8 at 32 px, 2 Ray Train workers, gloo, DeepSpeed ZeRO `--zero`, fp32) on its
synthetic corpus, `vitp pretrain` as a user runs it (run_training, MLflow in --workdir), the same
steps and config twice per round: `off` (fewshot_every=0) and `on` (fewshot_every=--every, digits
shards as `vitp preprocess debug_finetune` writes them). The order alternates between rounds.
images/s is the loop's perf/images_per_sec over its log windows (equal images each, so the total
is their harmonic mean), with and without the first window (start-up: the probe actor's process
start and dataset read fall in it). One local Ray with --cpus logical CPUs (connect_ray's sizing).
Appended to benchmarks/RESULTS.md (`--results`/`--no-results`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)


def harmonic(values: list[float]) -> float:
    return len(values) / sum(1.0 / v for v in values)


def one_run(cfg, name: str) -> dict:
    """Train `cfg` as run `name`; images/s (all windows, without the first) and probe figures."""
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.trainer import run_training

    cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, run_name=name))
    summary = run_training(Run.of(cfg))
    client = get_client(Run.of(cfg).tracking_uri)

    def hist(key):
        return [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, key),
                                        key=lambda m: m.step)]

    ips = hist("perf/images_per_sec")
    steps = [m.step for m in client.get_metric_history(summary.mlflow_run_id, "fewshot/digits_10shot_top1")]
    return {"all": harmonic(ips), "steady": harmonic(ips[1:]), "probes": steps,
            "top1": hist("fewshot/digits_10shot_top1"), "snap_s": hist("perf/fewshot_snapshot_s"),
            "eval_s": hist("perf/fewshot_eval_s"), "cpu_s": hist("perf/fewshot_eval_cpu_s"),
            "wall_s": summary.seconds, "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50, help="train.fewshot_every of the `on` runs")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--zero", type=int, default=2, help="ZeRO stage")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=4, help="Ray logical CPUs (2 workers + 2, as connect_ray)")
    ap.add_argument("--workdir", help="keep shards and runs here (default: a temporary directory)")
    add_results_args(ap)
    args = ap.parse_args()

    import ray

    from vitp.data.commands import run_preprocess
    from vitp.config import Run
    from vitp.recipes import resolve
    from vitp.storage import exists, join

    work = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="fewshot-bench-"))
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    base = resolve("debug", [f"work_dir={work}", f"train.steps={args.steps}", f"train.log_every={args.log_every}",
                             "train.eval_every=0", "train.checkpoint_every=0", f"parallel.zero_stage={args.zero}",
                             "tracking.system_metrics=false", "train.fewshot_datasets=digits"])
    for cfg in (base, resolve("debug_finetune", [f"work_dir={work}"])):
        if not exists(join(Run.of(cfg).shards, "manifest.json")):
            run_preprocess(Run.of(cfg), log=lambda s: None)
    on = dataclasses.replace(base, train=dataclasses.replace(base.train, fewshot_every=args.every))

    runs: dict[str, list[dict]] = {"off": [], "on": []}
    tag = os.urandom(3).hex()
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            res = one_run(base if mode == "off" else on, f"fewshot-bench-{tag}-{mode}-{r}")
            runs[mode].append(res)
            print(f"round {r} {mode:3s}: {res['all']:.1f} images/s (all windows), {res['steady']:.1f} "
                  f"(without the first), probes at {res['probes']}, wall {res['wall_s']:.0f} s, "
                  f"load average {res['load']:.1f}", flush=True)

    def med(mode, key):
        return statistics.median(x[key] for x in runs[mode])

    def ratio(key):  # on / off of the same round: the two runs of a pair saw about the same load
        return statistics.median(a[key] / b[key] for a, b in zip(runs["on"], runs["off"]))

    rows = ["| few-shot probes | images/s, all windows (median) | images/s without the first window "
            "(median) | per round (all / without first; load average at the end) |", "|---|---:|---:|---|"]
    for mode in ("off", "on"):
        per = ", ".join(f"{x['all']:.0f}/{x['steady']:.0f} ({x['load']:.1f})" for x in runs[mode])
        rows.append(f"| {mode} | {med(mode, 'all'):.1f} | {med(mode, 'steady'):.1f} | {per} |")
    rows.append(f"| on / off, median of the rounds' ratios | {ratio('all'):.3f} | {ratio('steady'):.3f} | "
                + ", ".join(f"{a['all'] / b['all']:.3f}/{a['steady'] / b['steady']:.3f}"
                            for a, b in zip(runs["on"], runs["off"])) + " |")
    snap = [s for x in runs["on"] for s in x["snap_s"]]
    ev = [s for x in runs["on"] for s in x["eval_s"]]
    cpu = [sum(x["cpu_s"]) / (2 * x["wall_s"]) for x in runs["on"]]  # of the run's 2-core budget
    notes = (f"{args.steps} steps, log every {args.log_every}, ZeRO-{args.zero}, batch {base.parallel.global_batch}; "
             f"`on`: a probe every {args.every} steps on digits (1/5/10/25 shots x 3 seeds), logged at steps "
             f"{runs['on'][0]['probes']}; 10-shot top-1 {[round(v, 3) for v in runs['on'][0]['top1']]}. "
             f"Rank 0's snapshot (copy + object store) took median {statistics.median(snap) * 1e3:.1f} ms of "
             f"the training step; the actor's evaluation median {statistics.median(ev):.2f} s (SCHED_IDLE, 1 thread), "
             f"its CPU seconds over a run {statistics.median(cpu):.2%} of the run's 2 cores x wall time.")
    table = "\n".join(rows)
    print(table + "\n\n" + notes)
    append_result(args.results, "Few-shot probes during pre-training (`benchmarks/fewshot_overhead.py`)",
                  table, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
