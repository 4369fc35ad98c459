"""Is training waiting for its data? The same Ray Train run fed by Ray Data vs fed from memory.

Run (from the repository root):

  .venv/bin/python benchmarks/data_feed.py --recipe debug --recipe demo --rounds 3

For each recipe (its shards made once in a temporary directory) a local Ray sized as `vitp` sizes
it (`connect.local_cpus`; `--reader-cpus N` sets its READER_CPUS, the logical CPUs beside the Train
workers' own) runs `--rounds` rounds of two Train runs, in alternating order:

  stream: each rank trains on its Ray Data stream as `vitp pretrain` does (RankStreams: shards read,
          decoded and augmented by Ray Data tasks while the loop trains);
  memory: each rank first takes the same stream's batches for every step into memory (the same
          images, labels and order), closes the stream, then trains on them.

Both build the same engine (DeepSpeed, the recipe's ZeRO stage, workers and batch) and run the same
loop (`run_loop`: no evaluation, no checkpoints) for `--steps` steps. Reported per recipe and feed:
images/s (the median of the log windows after the first, which holds the start-up), the loop's measured
`perf/data_wait_frac` over the same windows, and the ratio stream / memory (median over rounds).
The memory side's time to take its batches is not counted: it is what the stream side overlaps.
"starved": how many datasets Ray Data warned about: its share of the cluster could not run one of
its tasks for `--starved-after` seconds ("Cluster resources are not enough to run any task from
..."; Ray's own delay is a minute, longer than these runs).

The table is printed and appended to benchmarks/RESULTS.md (`--results PATH`, `--no-results`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)

# what Ray Data logs when a dataset's share of the cluster cannot run one of its tasks for 60 s
STARVED = "Cluster resources are not enough to run any task"


def feed_worker(config: dict) -> None:
    """A Ray Train worker: the engine and loop of `vitp pretrain`, fed by its stream or from memory.
    Rank 0 writes the loop's log windows to config["out"]."""
    import itertools

    import ray.train

    from vitp.config import Run, for_world
    from vitp.data.executor import pace_streaming_executor
    from vitp.data.ingest import iter_device_batches
    from vitp.train import checkpoint as ckpt
    from vitp.train.engine import device_for
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    pace_streaming_executor()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = for_world(Run.from_dict(config["cfg"]).cfg, world)
    engine, _, _ = build_model_and_engine(cfg, world)
    p = cfg.parallel
    stream = iter_device_batches(ray.train.get_dataset_shard("train"), p.micro_batch, device_for(cfg),
                                 mean=cfg.data.mean, std=cfg.data.std)
    if config["feed"] == "memory":
        batches = list(itertools.islice(stream, cfg.train.steps * p.grad_accum))
        stream.close()  # the Ray Data stream ends here: no reader runs beside this side's training
        stream = iter(batches)
    result = run_loop(cfg, engine, stream, ckpt.TrainState(), LoopHooks(), rank, world)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(result.history, f)


def one_run(run, feed: str, out: str) -> list[dict]:
    """One Train run of `run`'s config fed by `feed`; the loop's log windows."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from vitp.train.streams import RankStreams, train_placeholder

    cfg = run.cfg
    p = cfg.parallel
    cfg_dict = cfg.to_dict()
    TorchTrainer(
        feed_worker,
        train_loop_config={"cfg": cfg_dict, "feed": feed, "out": out},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=p.num_workers,
                                               resources_per_worker={"CPU": p.cpus_per_worker}),
        run_config=ray.train.RunConfig(name=f"feed-{feed}", storage_path=run.paths.runs),
        datasets={"train": train_placeholder},
        dataset_config=RankStreams(cfg_dict),
    ).fit()
    with open(out) as f:
        return json.load(f)


def summarize(history: list[dict]) -> tuple[float, float]:
    """(median images/s, mean data-wait fraction) of the log windows after the first."""
    rest = history[1:] or history
    return (statistics.median(h["perf/images_per_sec"] for h in rest),
            statistics.mean(h["perf/data_wait_frac"] for h in rest))


def bench_recipe(recipe: str, args: argparse.Namespace, work: str) -> list[dict]:
    import ray

    from vitp.cluster import connect
    from vitp.config import Run
    from vitp.data.commands import run_preprocess
    from vitp.recipes import resolve

    overrides = [f"work_dir={work}/{recipe}", f"data.shards={work}/{recipe}/shards",
                 "train.eval_every=0", "train.checkpoint_every=0"]
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    cfg = resolve(recipe, overrides)
    p = cfg.parallel
    if args.reader_cpus is not None:
        connect.READER_CPUS = args.reader_cpus
    cpus = connect.local_cpus(cfg)
    connect.connect_ray(cfg)  # as `vitp pretrain` starts its local Ray
    # this Ray's session directory (no public API names it), where Ray Data writes its logs
    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "ray-data")
    try:
        print(f"{recipe}: making the shards", flush=True)
        run_preprocess(Run.of(cfg), log=lambda s: None)
        rows: dict[str, list[tuple[float, float]]] = {"stream": [], "memory": []}
        for i in range(args.rounds):
            for feed in (("stream", "memory") if i % 2 == 0 else ("memory", "stream")):
                ips, wait = summarize(one_run(Run.of(cfg), feed, os.path.join(work, f"{recipe}-{feed}-{i}.json")))
                rows[feed].append((ips, wait))
                print(f"{recipe} round {i + 1}/{args.rounds} {feed}: {ips:,.0f} images/s, "
                      f"waiting for data {wait:.1%} of the time", flush=True)
    finally:
        ray.shutdown()
    # one log per dataset (ray-data.log repeats their warnings)
    starved = sum(STARVED in open(os.path.join(logs, f), errors="replace").read()
                  for f in os.listdir(logs) if f.startswith("ray-data-dataset_")) if os.path.isdir(logs) else 0
    med = {f: (statistics.median(r[0] for r in rows[f]), statistics.median(r[1] for r in rows[f])) for f in rows}
    ratios = [s[0] / m[0] for s, m in zip(rows["stream"], rows["memory"])]
    return [{"recipe": recipe, "variant": cfg.model.variant, "px": cfg.data.image_size,
             "workers": p.num_workers, "ray_cpus": cpus, "steps": cfg.train.steps,
             "stream": med["stream"], "memory": med["memory"], "ratio": statistics.median(ratios),
             "ratios": ratios, "starved": starved}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", action="append", help="recipe to run (repeatable; default debug and demo)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: the recipe's)")
    ap.add_argument("--reader-cpus", type=int, default=None,
                    help="logical CPUs beside the Train workers' (default: what vitp gives a local Ray)")
    ap.add_argument("--starved-after", type=float, default=5.0,
                    help="seconds a dataset's share must stay too small to run one task before Ray Data "
                         "warns (Ray's default: 60)")
    add_results_args(ap)
    args = ap.parse_args()
    from vitp.console import log_env, quiet_env

    os.environ.update({**quiet_env(), **log_env()})  # Ray Data's lines stay in its log files
    # Ray Data warns of a dataset starved for a minute; these runs are shorter
    os.environ["RAY_DATA_STARVATION_WARNING_DELAY_S"] = str(args.starved_after)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vitp-feed-") as work:
        for recipe in args.recipe or ["debug", "demo"]:
            rows += bench_recipe(recipe, args, work)
    lines = ["| recipe | model | workers | Ray CPUs | steps | stream images/s | stream data wait | "
             "memory images/s | memory data wait | stream / memory (per round) | starved |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['variant']} {r['px']} px | {r['workers']} | {r['ray_cpus']} | {r['steps']} | "
                     f"{r['stream'][0]:,.0f} | {r['stream'][1]:.1%} | {r['memory'][0]:,.0f} | {r['memory'][1]:.1%} | "
                     f"{r['ratio']:.3f}x ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | {r['starved']} |")
    table = "\n".join(lines)
    print(table)
    if args.results:
        append_result(args.results, "Data feed: Ray Data stream vs memory, same engine and batches", table)


if __name__ == "__main__":
    main()
