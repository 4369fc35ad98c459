"""Checkpoint I/O: how long training is blocked per checkpoint and how fast it reaches storage.

Run (from the repository root):

  # the debug model and a ViT-B/16-sized state, to the local disk and to an S3 API
  .venv/bin/python benchmarks/checkpoint_io.py --variant pico/8 --variant B/16 --dest local --dest s3

What one checkpoint costs: a real DeepSpeed engine (world of one, fp32, ZeRO `--zero`, AdamW state
after one step) writes its checkpoint into a local temporary directory with `checkpoint.save` (the
"save" column), then the files are copied to storage with `storage.upload_dir`, the copy a Train
worker's upload makes (the "persist" column). Blocked = save + persist is what a synchronous
checkpoint cost; since checkpoints upload in the background (train/uploads.py), a Train worker is
blocked for about the save only. MB/s = MB over persist. `--dest local` persists to another local directory; `--dest s3` to an S3 HTTP API:
AWS_ENDPOINT_URL if set, else a moto server started on 127.0.0.1 for the run (benchmarks/s3_disk_server.py:
objects in temporary files, so the figure is this machine's loopback, disk and CPU, not a network). Median of `--repeats` checkpoints.

With `--train`, what a real run pays (here B/16 and L/16 states on 32 px images, so steps stay short):

  .venv/bin/python benchmarks/checkpoint_io.py --train --variant B/16 --variant L/16 --dest local --dest s3

runs `vitp pretrain`'s Ray Train path on the debug recipe's data (2 workers, ZeRO-2, fp32,
`--train-steps` steps): once without checkpoints, then once per storage with a checkpoint every
`--every` steps. Per checkpoint (median, from the run's MLflow metrics): the snapshot, the time the
workers were blocked (waiting for the previous upload + the snapshot) and the background upload;
over the run, images/s beside the run without checkpoints.

The table is printed and appended to benchmarks/RESULTS.md (`--results PATH`, `--no-results`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)


def _moto() -> subprocess.Popen | None:
    """Point AWS_ENDPOINT_URL at a fresh moto server unless one is configured; returns it."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        return None
    from vitp.net import free_port

    port = free_port()
    # moto, its multipart uploads completed on disk: an L/16 checkpoint does not fit in memory twice
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "s3_disk_server.py")
    proc = subprocess.Popen([sys.executable, server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    for _ in range(300):
        try:
            urllib.request.urlopen(os.environ["AWS_ENDPOINT_URL"], timeout=1)
            return proc
        except Exception:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start (pip install 'moto[server]')")


def _bucket() -> str:
    import boto3

    name = f"ckpt-bench-{os.getpid()}"
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return f"s3://{name}"


def measure(variant: str, zero: int, dests: dict[str, str], repeats: int) -> list[dict]:
    import torch

    from vitp import storage
    from vitp.train import checkpoint as ckpt
    from vitp.train.loop import build_model_and_engine
    from vitp.train.step import train_step
    from train_step import bench_config  # noqa: E402  (benchmarks/train_step.py)

    args = types.SimpleNamespace(variant=variant, image_size=32 if variant.startswith("pico") else 224,
                                 num_classes=10, head="finetune", grad_checkpointing=False,
                                 device="cpu", batch=1, zero=zero, precision="fp32")
    cfg = bench_config(args)
    engine, _, _ = build_model_and_engine(cfg, world_size=1)
    x = torch.zeros(1, 3, args.image_size, args.image_size)
    train_step(engine, [(x, torch.zeros(1, dtype=torch.long))])  # AdamW state exists
    params = sum(p.numel() for p in engine.module.parameters())
    rows = []
    for name, dest in dests.items():
        saves, persists, mb = [], [], 0.0
        for i in range(repeats):
            local = tempfile.mkdtemp(prefix="ckpt-bench-")
            try:
                t0 = time.perf_counter()
                ckpt.save(engine, local, ckpt.TrainState(step=i + 1), cfg.to_dict())
                t1 = time.perf_counter()
                written = storage.upload_dir(local, storage.join(dest, f"checkpoint_{i:08d}"))
                t2 = time.perf_counter()
            finally:
                shutil.rmtree(local, ignore_errors=True)
            storage.rmtree(storage.join(dest, f"checkpoint_{i:08d}"), dest)
            saves.append(t1 - t0)
            persists.append(t2 - t1)
            mb = written / 1e6
        save, persist = statistics.median(saves), statistics.median(persists)
        rows.append({"variant": variant, "zero": zero, "params": params, "dest": name, "mb": mb,
                     "save_s": save, "persist_s": persist, "mb_s": mb / persist,
                     "blocked_s": save + persist})
        print(f"{variant} -> {name}: {mb:.1f} MB, save {save:.2f} s, persist {persist:.2f} s "
              f"({mb / persist:.0f} MB/s), blocked {save + persist:.2f} s", flush=True)
    return rows


def _history(client, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def run_rate(client, run_id: str, log_every: int) -> float:
    """Images/s of a run over its log windows after the first (which holds the start-up): the
    windows' images over their seconds, checkpoint pauses included."""
    ips = _history(client, run_id, "perf/images_per_sec")[1:]
    secs = [t * log_every for t in _history(client, run_id, "perf/step_time_s")[1:]]
    return sum(i * s for i, s in zip(ips, secs)) / sum(secs)


def train(variant: str, dests: dict[str, str], args: argparse.Namespace, work: str) -> list[dict]:
    """Ray Train pre-trainings of `variant` on the debug recipe's data, as `vitp pretrain` runs them
    (2 workers, ZeRO-2, fp32): one without checkpoints, then one per storage with a checkpoint every
    `--every` steps. From each run's MLflow metrics: per checkpoint, the snapshot and the time the
    workers were blocked (median), the upload; over the run, images/s."""
    from vitp.cluster.connect import connect_ray
    from vitp.config import Run
    from vitp.data.commands import run_preprocess
    from vitp.recipes import resolve
    from vitp.tracking.store import get_client
    from vitp.train.trainer import run_training

    shards, db = os.path.join(work, "shards"), f"sqlite:///{work}/mlflow.db"
    common = [f"data.shards={shards}", f"tracking.uri={db}", f"model.variant={variant}",
              f"data.image_size={args.train_px}", f"data.storage_size={args.train_px + args.train_px // 4}",
              f"train.steps={args.train_steps}", "train.log_every=5", "train.eval_every=0",
              "parallel.zero_stage=2", "parallel.num_workers=2", "train.keep_checkpoints=1",
              "optim.warmup_steps=1", "train.device_peak_tflops=1"]
    cfg = resolve("debug", [f"work_dir={work}/none", *common, "train.checkpoint_every=0"])
    connect_ray(cfg)  # first: a Ray that Ray Data started by itself would not know its address
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        run_preprocess(Run.of(cfg), log=lambda s: None)
    client = get_client(db)
    tag = variant.replace("/", "")
    base = run_training(Run.of(cfg), with_val=False)
    plain = run_rate(client, base.mlflow_run_id, 5)
    print(f"{variant} without checkpoints: {plain:.1f} images/s", flush=True)
    rows = []
    for name, dest in dests.items():
        c = resolve("debug", [f"work_dir={dest}/{tag}", *common, f"train.checkpoint_every={args.every}",
                              f"tracking.run_name=ckpt-{tag}-{name}"])
        try:
            res = run_training(Run.of(c), with_val=False)
        except Exception as e:  # e.g. Ray's memory monitor: the other rows still count
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            rows.append({"variant": variant, "dest": name, "failed": reason})
            print(f"{variant} -> {name}: failed: {reason}", flush=True)
            continue
        h = {k: _history(client, res.mlflow_run_id, f"perf/ckpt_{k}") for k in ("mb", "save_s", "blocked_s", "upload_s")}
        rate = run_rate(client, res.mlflow_run_id, 5)
        row = {"variant": variant, "dest": name, "checkpoints": len(h["mb"]), "mb": statistics.median(h["mb"]),
               **{k: statistics.median(v) for k, v in h.items() if k != "mb"}, "ips": rate, "ips_plain": plain}
        rows.append(row)
        print(f"{variant} -> {name}: {row['checkpoints']} checkpoints of {row['mb']:.0f} MB, snapshot "
              f"{row['save_s']:.2f} s, blocked {row['blocked_s']:.2f} s, upload {row['upload_s']:.2f} s; "
              f"{rate:.1f} images/s ({rate / plain:.3f}x without checkpoints)", flush=True)
    return rows


def train_table(rows: list[dict]) -> str:
    local = {r["variant"]: r["save_s"] for r in rows if r["dest"] == "local" and "failed" not in r}
    lines = ["| variant | storage | checkpoints | MB | snapshot s | blocked s | blocked / local snapshot | "
             "upload s | images/s | without checkpoints | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['variant']} | {r['dest']} | failed: {r['failed']} |" + " |" * 8)
            continue
        ref = local.get(r["variant"])
        lines.append(f"| {r['variant']} | {r['dest']} | {r['checkpoints']} | {r['mb']:.0f} | {r['save_s']:.2f} | "
                     f"{r['blocked_s']:.2f} | {r['blocked_s'] / ref:.2f}x | {r['upload_s']:.2f} | {r['ips']:.1f} | "
                     f"{r['ips_plain']:.1f} | {r['ips'] / r['ips_plain']:.3f} |" if ref else "")
    return "\n".join(line for line in lines if line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", help="model variant (repeatable; default pico/8)")
    ap.add_argument("--dest", action="append", choices=["local", "s3"], help="storage (repeatable; default both)")
    ap.add_argument("--zero", type=int, default=0, help="ZeRO stage of the engine (default 0)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train", action="store_true",
                    help="measure Ray Train pre-trainings instead (2 workers, ZeRO-2; --zero and --repeats unused)")
    ap.add_argument("--train-steps", type=int, default=60, help="steps of each --train run")
    ap.add_argument("--every", type=int, default=20, help="--train: a checkpoint every this many steps")
    ap.add_argument("--train-px", type=int, default=32, help="--train: image size (the state is the variant's)")
    add_results_args(ap)
    args = ap.parse_args()
    variants, dest_kinds = args.variant or ["pico/8"], args.dest or ["local", "s3"]
    if args.train:
        from vitp.console import log_env, quiet_env

        os.environ.update({**quiet_env(), **log_env()})
    moto = _moto() if "s3" in dest_kinds else None
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-store-")
    try:
        dests = {k: os.path.join(tmp, "store") if k == "local" else _bucket() for k in dest_kinds}
        if args.train:
            rows = [r for v in variants for r in train(v, dests, args, tmp)]
        else:
            rows = [r for v in variants for r in measure(v, args.zero, dests, args.repeats)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if moto:
            moto.terminate()
    if args.train:
        table = train_table(rows)
        print(table)
        append_result(args.results, "Checkpoints during Ray Train runs (`benchmarks/checkpoint_io.py --train`)", table,
                      notes="blocked = the slowest rank's wait for the previous upload + its snapshot, per "
                            "checkpoint (median); upload runs in the background; images/s over the log windows "
                            "after the first, checkpoint pauses included; s3 = moto on 127.0.0.1.")
        return 0
    table = "\n".join(["| variant | ZeRO | params | storage | MB | save s | persist s | MB/s | blocked s |",
                       "|---|---|---|---|---|---|---|---|---|"] +
                      [f"| {r['variant']} | {r['zero']} | {r['params'] / 1e6:.1f}M | {r['dest']} | {r['mb']:.1f} | "
                       f"{r['save_s']:.3f} | {r['persist_s']:.3f} | {r['mb_s']:.0f} | {r['blocked_s']:.3f} |"
                       for r in rows])
    print(table)
    append_result(args.results, "Checkpoint I/O (`benchmarks/checkpoint_io.py`)", table,
                  notes="save = checkpoint.save into a local temp dir; persist = the copy to storage "
                        "(what Ray Train's report does); s3 = moto on 127.0.0.1 unless AWS_ENDPOINT_URL is set.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
