"""MLflow on PostgreSQL under the tracking load of a cluster: many ranks and trials logging at once.

Run (from the repository root):

  .venv/bin/python benchmarks/tracking_load.py --ranks 8 --trials 32 --steps 300 --rate 5

It starts a PostgreSQL server (Debian's package, in a temp dir, removed after) and an MLflow server
on it (`vitp.tracking.start_server`, `--workers` processes; artifacts in a temp dir, or
`--artifacts s3://...`), or uses `--tracking-uri`. Then, at once, one process per metric stream:
`--ranks` training ranks (20 keys a step, as rank 0 logs loss, lr, perf/* and system/*) and
`--trials` sweep trials (8 keys a step), each logging `--steps` steps at `--rate` steps/s through
the pipeline's own spool (`vitp.tracking.spool.MetricSender`: appended, posted by its thread).
Meanwhile a training loop (a ViT-Ti/16-shaped model at 32 px, batch 8, forward, backward, SGD, one
thread) warms up, then alternates rounds with and without logging each step (20 keys) to the same
server through `RunLogger`.

Reported: points sent and points stored (every run's history read back: each (key, step) once,
steps 1..N), the latency of the spool's posts (p50/p99 of each `log_batch` request, as the sender
makes them), how long each stream's close waited for its spool to drain, and the training loop's
steps/s with logging over without (interleaved rounds, both under the same load). `--json PATH`
writes it all; the table goes to benchmarks/RESULTS.md unless `--no-results`.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)

RANK_KEYS = ["train/loss", "train/lr", "train/grad_norm", "perf/images_per_s", "perf/step_s", "perf/data_wait",
             "perf/mfu", "perf/mem_gb", *[f"system/m{i}" for i in range(12)]]
TRIAL_KEYS = ["train/loss", "train/lr", "val/top1", "val/loss", "perf/images_per_s", "perf/step_s",
              "perf/data_wait", "evaluation"]


class TimedClient:
    """The sender's HTTP client, timing each request it makes (the latency the spool sees)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.points = inner, [], 0

    def log_batch(self, run_id, metrics=(), tags=()):
        t0 = time.perf_counter()
        self.inner.log_batch(run_id, metrics=metrics, tags=tags)
        self.seconds.append(time.perf_counter() - t0)
        self.points += len(metrics)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def stream(uri: str, experiment_id: str, name: str, keys: list[str], steps: int, rate: float, spool: str,
           out: str) -> None:
    """One process's metric stream: a run, `steps` steps of `keys` at `rate` steps/s, closed."""
    from vitp.tracking.spool import MetricSender
    from vitp.tracking.store import get_client

    client = get_client(uri)
    run_id = client.create_run(experiment_id, run_name=name).info.run_id
    sender = MetricSender(uri, run_id, {}, spool_dir=spool)
    sender.client = TimedClient(sender.client)
    sender.start()
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        sender.append(step, int(time.time() * 1000), {k: step + i / 100 for i, k in enumerate(keys)})
        time.sleep(max(0.0, t0 + step / rate - time.monotonic()))
    t_close = time.monotonic()
    drained = sender.close(timeout_s=600)
    close_s = time.monotonic() - t_close
    sender.terminate("FINISHED")
    with open(out, "w") as f:
        json.dump({"run_id": run_id, "name": name, "keys": keys, "steps": steps, "sent": steps * len(keys),
                   "posted": sender.client.points, "post_s": sender.client.seconds, "close_s": close_s,
                   "drained": drained, "left": sender.left}, f)


def train_rates(uri: str, experiment: str, rounds: int, steps: int, out: str) -> None:
    """Steps/s of a small training loop in rounds alternating: logging each step, not logging."""
    import torch

    from vitp.model.vit import ViT
    from vitp.tracking.runs import RunLogger

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ViT("Ti/16", image_size=32, num_classes=10, head="finetune").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    logger = RunLogger.start(uri, experiment, "train-loop", background=True)
    rates, step = {"logging": [], "not logging": []}, 0
    for r in range(-1, 2 * rounds):  # round -1 warms up, untimed
        mode = "logging" if r % 2 == 0 else "not logging"
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if mode == "logging":
                logger.log_metrics({k: loss.item() for k in RANK_KEYS}, step=step)
        if r >= 0:
            rates[mode].append(steps / (time.perf_counter() - t0))
    logger.end("FINISHED")
    with open(out, "w") as f:
        json.dump(rates, f)


def stored(uri: str, result: dict) -> tuple[int, list[str]]:
    """Points of one stream's run in the store, and what is wrong with its histories."""
    from vitp.tracking.store import get_client

    client, n, wrong = get_client(uri), 0, []
    for key in result["keys"]:
        steps = sorted(m.step for m in client.get_metric_history(result["run_id"], key))
        n += len(steps)
        if steps != list(range(1, result["steps"] + 1)):
            dup = len(steps) - len(set(steps))
            wrong.append(f"{result['name']} {key}: {len(steps)} points, {dup} duplicated, "
                         f"{result['steps'] - len(set(steps))} missing")
    return n, wrong


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Servers:
    """PostgreSQL and an MLflow server on it, in a temp dir (`uri`); `stop()` removes both."""

    def __init__(self, workers: int, artifacts: str | None):
        sys.path.insert(0, str(ROOT / "tests"))
        from postgres import PostgresServer  # tests/postgres.py

        from vitp.tracking import start_server

        self.root = Path(tempfile.mkdtemp(prefix="vitp-load-"))
        self.db = PostgresServer(Path(tempfile.mkdtemp(prefix="vitp-pg-", dir="/tmp")))  # its own: postgres owns it
        password = os.urandom(12).hex()
        self.db.create("mlflow", password, "mlflow")
        self.backend = f"postgresql://mlflow:{quote(password, safe='')}@127.0.0.1:{self.db.port}/mlflow"
        self.server = start_server(self.backend, artifacts or str(self.root / "artifacts"), workers=workers,
                                   timeout=180, log_path=self.root / "mlflow-server.log")
        self.uri = self.server.uri

    def stop(self) -> None:
        self.server.stop()
        self.db.stop()
        shutil.rmtree(self.db.root, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


def run(args) -> dict:
    from vitp.tracking.store import get_client

    servers = None if args.tracking_uri else Servers(args.workers, args.artifacts)
    uri = args.tracking_uri or servers.uri
    work = Path(tempfile.mkdtemp(prefix="vitp-load-work-"))
    try:
        client = get_client(uri)
        experiment = f"tracking-load-{int(time.time() * 1000)}"
        experiment_id = client.create_experiment(experiment)
        ctx = multiprocessing.get_context("spawn")
        jobs = [(f"rank{i}", RANK_KEYS) for i in range(args.ranks)] + [(f"trial{i}", TRIAL_KEYS)
                                                                      for i in range(args.trials)]
        procs = [ctx.Process(target=stream, args=(uri, experiment_id, name, keys, args.steps, args.rate,
                                                  str(work / "spool" / name), str(work / f"{name}.json")))
                 for name, keys in jobs]
        trainer = ctx.Process(target=train_rates, args=(uri, experiment, args.rounds, args.round_steps,
                                                        str(work / "train.json")))
        t0 = time.monotonic()
        print(f"[load] {len(procs)} streams ({args.ranks} ranks x {len(RANK_KEYS)} keys, {args.trials} trials x "
              f"{len(TRIAL_KEYS)} keys), {args.steps} steps at {args.rate}/s, to {'PostgreSQL at ' if servers else ''}{uri}",
              flush=True)
        for p in procs + [trainer]:
            p.start()
        for p in procs + [trainer]:
            p.join()
        wall = time.monotonic() - t0
        failed = [p.name for p in procs + [trainer] if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} load process(es) failed (exit codes non-zero): {failed[:5]}")
        results = [json.loads((work / f"{name}.json").read_text()) for name, _ in jobs]
        in_store, wrong = 0, []
        for r in results:
            n, bad = stored(uri, r)
            in_store += n
            wrong += bad
        posts = [s for r in results for s in r["post_s"]]
        rates = json.loads((work / "train.json").read_text())
        return {"streams": len(results), "ranks": args.ranks, "trials": args.trials, "steps": args.steps,
                "rate": args.rate, "workers": args.workers, "backend": "postgresql" if servers else uri,
                "sent": sum(r["sent"] for r in results), "stored": in_store, "wrong": wrong,
                "posts": len(posts), "post_p50_s": pct(posts, 0.5), "post_p99_s": pct(posts, 0.99),
                "close_max_s": max(r["close_s"] for r in results), "undrained": sum(r["left"] for r in results),
                "steps_per_s": {k: statistics.median(v) for k, v in rates.items()},
                "step_rate_ratio": statistics.median(rates["logging"]) / statistics.median(rates["not logging"]),
                "wall_s": wall}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if servers:
            servers.stop()


def table(r: dict) -> str:
    s = r["steps_per_s"]
    return "\n".join([
        "| streams | points sent | points stored | wrong histories | posts | post p50 | post p99 | longest drain at close | training steps/s logging / not (ratio) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['ranks']} ranks + {r['trials']} trials, {r['steps']} steps at {r['rate']}/s | {r['sent']} | {r['stored']} "
        f"| {len(r['wrong'])} | {r['posts']} | {r['post_p50_s'] * 1e3:.0f} ms | {r['post_p99_s'] * 1e3:.0f} ms "
        f"| {r['close_max_s']:.1f} s | {s['logging']:.1f} / {s['not logging']:.1f} ({r['step_rate_ratio']:.2f}) |"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300, help="steps each stream logs")
    ap.add_argument("--rate", type=float, default=5.0, help="steps/s of each stream")
    ap.add_argument("--workers", type=int, default=2, help="the MLflow server's worker processes")
    ap.add_argument("--rounds", type=int, default=5, help="training rounds of each kind")
    ap.add_argument("--round-steps", type=int, default=20, help="training steps per round")
    ap.add_argument("--tracking-uri", help="an MLflow server to load instead of starting PostgreSQL + MLflow")
    ap.add_argument("--artifacts", help="the started server's artifact destination (default: a temp dir)")
    ap.add_argument("--json", help="write the result here")
    add_results_args(ap)
    args = ap.parse_args()
    result = run(args)
    print(table(result))
    for line in result["wrong"][:20]:
        print(f"  {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    append_result(args.results, "Tracking load on PostgreSQL (`benchmarks/tracking_load.py`)", table(result),
                  notes=f"{result['streams']} processes logging through the spool while a training loop runs; "
                        f"{result['wall_s']:.0f} s in all; MLflow server workers: {result['workers']}.")
    sys.exit(1 if result["wrong"] or result["sent"] != result["stored"] else 0)


if __name__ == "__main__":
    main()
