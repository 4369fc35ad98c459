"""Training-step throughput (images/s) and MFU of our ViT, with and without Ray.

Run (from the repository root):

  # one GPU: the DeepSpeed engine + our train_step in one process (no Ray imported)
  .venv/bin/python benchmarks/train_step.py --variant H/14 --batch 64 --device cuda \\
      --precision bf16 --zero 1 --json /tmp/h14.json
  # CPU, everything in one invocation: engine, Ray Train (1 worker) and ours-vs-transformers
  .venv/bin/python benchmarks/train_step.py --all --variant S/16 --image-size 224 --batch 8 \\
      --device cpu --json /tmp/s16.json

What it measures, on synthetic inputs made on the device (uint8 images normalised there every
step, as `iter_device_batches` does in training; random labels):

  --mode engine (default)  `build_model_and_engine` (DeepSpeed, world of one via gloo/NCCL) and
                           `vitp.train.step.train_step`: forward, loss, backward, clip, AdamW.
                           Imports nothing from Ray.
  --mode ray               the same timed loop inside a 1-worker Ray Train `TorchTrainer`;
                           the numbers come back through `ray.train.report(checkpoint=...)`.
  --compare-hf             plain torch fwd + bwd + AdamW step of our `ViT` against
                           `transformers.ViTForImageClassification` of the same shape (linear
                           head on the class token, SDPA attention), same batch / dtype, in
                           interleaved rounds; prints ours / HF (>= 1.0 means ours is faster).
  --all                    the three above, each in its own child process, one markdown table.

Timing: `--warmup` untimed steps, then `--windows` windows of `--steps` steps each
(`torch.cuda.synchronize()` around every window on GPU); images/s is the median window.
MFU = images/s x training FLOPs per image (3 x the analytic forward, `training_flops`) / peak.
Peak: `--peak-tflops` (default 989, H100/H200 dense bf16, on CUDA). On CPU there is no
datasheet number, so without `--peak-tflops` the script measures one: the best of a few
square `torch.mm` calls in the benchmark dtype on all threads, and says so in its output.

The markdown table is printed and appended, with this command line, the date and the machine,
to benchmarks/RESULTS.md (`--results PATH` elsewhere, `--no-results` to only print).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)

# ---------------------------------------------------------------------------------- helpers


def _dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """Best achieved FLOP/s of an n x n x n `torch.mm` (a practical peak where no datasheet one is
    known, e.g. a CPU). Returns FLOP/s."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def resolve_peak(args) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops:g}"
    dev = torch.device(args.device)
    if dev.type == "cuda":
        return 989e12, "default 989 TFLOP/s (H100/H200 dense bf16)"
    flops = measure_matmul_peak(dev, _dtype(args.precision))
    return flops, (f"measured: best 2048^3 torch.mm in {args.precision} on {torch.get_num_threads()} "
                   f"threads = {flops / 1e12:.3f} TFLOP/s (no --peak-tflops given)")


def bench_config(args):
    """Our ExperimentConfig for a world-of-one benchmark of `args` (typed fields)."""
    from vitp.config import set_values
    from vitp.recipes import get_recipe

    return set_values(get_recipe("debug"), {
        "model.variant": args.variant, "data.image_size": args.image_size,
        "model.num_classes": args.num_classes, "model.head": args.head,
        "model.dropout": 0.0, "model.grad_checkpointing": bool(args.grad_checkpointing),
        "parallel.num_workers": 1, "parallel.use_gpu": args.device == "cuda",
        "parallel.global_batch": args.batch, "parallel.micro_batch": args.batch,
        "parallel.grad_accum": 1, "parallel.zero_stage": args.zero,
        "parallel.precision": args.precision, "optim.warmup_steps": 0, "optim.schedule": "constant",
        "train.steps": 10**9, "tracking.run_name": "bench-train-step",
        "train.compile": bool(getattr(args, "compile", False)),  # checkpoint_io.py's args have none
    })


def flops_per_image(args, head: str | None = None) -> float:
    from vitp.model.flops import training_flops
    from vitp.model.variants import decode_variant

    head = head or args.head
    rep = decode_variant(args.variant).width if head == "pretrain" else None
    return training_flops(args.variant, args.image_size, args.num_classes, rep)


def synthetic_pool(batch: int, image_size: int, num_classes: int, device: torch.device,
                   n: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` (uint8 images (B, S, S, 3), int64 labels (B,)) pairs made on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randint(0, 256, (batch, image_size, image_size, 3), dtype=torch.uint8,
                           device=device, generator=g),
             torch.randint(0, num_classes, (batch,), device=device, generator=g))
            for _ in range(n)]


def timed_windows(step_fn, device: torch.device, warmup: int, steps: int, windows: int,
                  cpu_out: list[float] | None = None) -> list[float]:
    """Seconds of each of `windows` windows of `steps` calls, after `warmup` untimed calls.

    `cpu_out` gets each window's process CPU seconds (all threads): on a CPU shared with other
    work, images per CPU-second is far steadier than wall-clock images/s."""
    for i in range(warmup):
        step_fn(i)
    _sync(device)
    out, i = [], warmup
    for _ in range(windows):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step_fn(i)
            i += 1
        _sync(device)
        out.append(time.perf_counter() - t0)
        if cpu_out is not None:
            cpu_out.append(time.process_time() - c0)
    return out


def _env(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"device": str(device), "device_name": name, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "loadavg_1m_at_end": os.getloadavg()[0], "torch": torch.__version__}


# ------------------------------------------------------------------------- engine (no Ray)


def run_engine_step(args, peak: float, peak_source: str, mode: str = "engine") -> dict[str, Any]:
    """Build the DeepSpeed engine for a world of one (or join Ray's group) and time train_step."""
    from vitp.data.ingest import normalize
    from vitp.train.engine import device_for
    from vitp.train.loop import build_model_and_engine, memory_model
    from vitp.train.step import memory_gb, train_step

    cfg = bench_config(args)
    device = device_for(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine, _, _ = build_model_and_engine(cfg, world_size=1)
    dtype = next(engine.module.parameters()).dtype
    pool = synthetic_pool(args.batch, args.image_size, args.num_classes, device)
    mean, std = cfg.data.mean, cfg.data.std
    losses: list[float] = []

    def step(i: int) -> None:
        imgs, labels = pool[i % len(pool)]
        x = normalize(imgs, mean, std, dtype)  # on the device, every step, as in training
        losses.append(train_step(engine, [(x, labels)]).loss)

    cpu: list[float] = []
    secs = timed_windows(step, device, args.warmup, args.steps, args.windows, cpu)
    ips = [args.steps * args.batch / s for s in secs]
    fpi = flops_per_image(args)
    med = statistics.median(ips)
    import deepspeed

    return {
        "mode": mode, "variant": args.variant, "image_size": args.image_size, "batch": args.batch,
        "precision": args.precision, "zero": args.zero, "head": args.head,
        "grad_checkpointing": args.grad_checkpointing, "compile": bool(args.compile),
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
        "images_per_sec": med, "images_per_sec_best": max(ips), "images_per_sec_windows": ips,
        "step_time_s": args.batch / med,
        "images_per_cpu_sec": statistics.median(args.steps * args.batch / c for c in cpu),
        "train_flops_per_image": fpi, "achieved_tflops": med * fpi / 1e12,
        "peak_tflops": peak / 1e12, "peak_source": peak_source, "mfu": med * fpi / peak,
        "mem_gb": memory_gb(device), "mem_model_gb": memory_model(cfg, 1).device / 1e9, "loss_first": losses[0], "loss_last": losses[-1],
        "steps": args.steps, "windows": args.windows, "warmup": args.warmup,
        "deepspeed": deepspeed.__version__,
        "ray_imported": any(m == "ray" or m.startswith("ray.") for m in sys.modules), **_env(device),
    }


# ------------------------------------------------------------------------------- Ray Train


def _ray_worker(config: dict[str, Any]) -> None:
    """Ray Train worker: the engine-mode measurement, reported back with a checkpoint."""
    import ray.train

    torch.set_num_threads(config["threads"])  # same intra-op threads as the engine-mode run
    args = argparse.Namespace(**config["args"])
    res = run_engine_step(args, config["peak"], config["peak_source"], mode="ray")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump(res, f)
        # Train V2 keeps reported metrics only together with a checkpoint.
        ray.train.report({"images_per_sec": res["images_per_sec"]},
                         checkpoint=ray.train.Checkpoint.from_directory(d))


def run_ray(args, peak: float, peak_source: str) -> dict[str, Any]:
    """The same timed step in a 1-worker TorchTrainer (local Ray started here if none is)."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    use_gpu = args.device == "cuda"
    cpus = max(1, os.cpu_count() or 1)
    started = False
    t_start = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=args.verbose,
                 logging_level="WARNING")
        started = True
    storage = tempfile.mkdtemp(prefix="bench-ray-")
    try:
        resources = {"CPU": cpus}
        if use_gpu:
            resources["GPU"] = 1
        trainer = TorchTrainer(
            _ray_worker,
            train_loop_config={"args": vars(args), "peak": peak, "peak_source": peak_source,
                               "threads": torch.get_num_threads()},
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=use_gpu,
                                                   resources_per_worker=resources),
            run_config=ray.train.RunConfig(name="bench-train-step", storage_path=storage),
        )
        result = trainer.fit()
        if result.checkpoint is None:
            raise RuntimeError(f"the Ray Train worker reported no result: {result.error}")
        with result.checkpoint.as_directory() as d:
            with open(os.path.join(d, "result.json")) as f:
                res = json.load(f)
        res["ray_wall_s"] = time.perf_counter() - t_start  # start-up + build + timing + teardown
        return res
    finally:
        if started:
            ray.shutdown()
        import shutil

        shutil.rmtree(storage, ignore_errors=True)


# ------------------------------------------------------------------------ ours vs transformers


def hf_vit(args, device: torch.device, dtype: torch.dtype):
    """`transformers.ViTForImageClassification` with our ViT's shape (linear head, no pooler)."""
    from transformers import ViTConfig, ViTForImageClassification

    from vitp.model.variants import decode_variant

    s = decode_variant(args.variant)
    hf_cfg = ViTConfig(hidden_size=s.width, num_hidden_layers=s.depth, num_attention_heads=s.heads,
                       intermediate_size=s.mlp_dim, patch_size=s.patch, image_size=args.image_size,
                       num_channels=3, num_labels=args.num_classes, hidden_act="gelu",
                       layer_norm_eps=1e-6, qkv_bias=True, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    try:
        model = ViTForImageClassification._from_config(hf_cfg, attn_implementation="sdpa")
    except (TypeError, ValueError):  # older transformers without SDPA for ViT
        model = ViTForImageClassification(hf_cfg)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device=device, dtype=dtype).train()


def run_compare_hf(args) -> dict[str, Any]:
    """Interleaved rounds of plain-torch fwd + bwd + AdamW on ours and HF's ViT, same inputs."""
    import torch.nn.functional as F
    import transformers

    from vitp.data.ingest import normalize
    from vitp.model.vit import ViT
    from vitp.train.loop import seed_everything

    device, dtype = torch.device(args.device), _dtype(args.precision)
    seed_everything(0)
    # The linear ("finetune") head matches ViTForImageClassification (no pre-logits, no pooler).
    ours = ViT(args.variant, image_size=args.image_size, num_classes=args.num_classes, head="finetune",
               grad_checkpointing=args.grad_checkpointing).to(device=device, dtype=dtype).train()
    hf = hf_vit(args, device, dtype)
    n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (ours, hf))
    if n_ours != n_hf:
        raise RuntimeError(f"shape mismatch: ours has {n_ours} parameters, transformers {n_hf}")
    pool = synthetic_pool(args.batch, args.image_size, args.num_classes, device)

    def stepper(model, call):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.03)

        def step(i: int) -> None:
            imgs, labels = pool[i % len(pool)]
            x = normalize(imgs, (0.5,) * 3, (0.5,) * 3, dtype)
            loss = F.cross_entropy(call(x).float(), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {"ours": stepper(ours, ours), "hf": stepper(hf, lambda x: hf(pixel_values=x).logits)}
    for name, fn in steps.items():  # warm-up each before any timing
        timed_windows(fn, device, args.warmup, 0, 0)
    secs: dict[str, list[float]] = {"ours": [], "hf": []}
    cpu: dict[str, list[float]] = {"ours": [], "hf": []}
    for r in range(args.windows):
        order = ("ours", "hf") if r % 2 == 0 else ("hf", "ours")
        for name in order:
            secs[name] += timed_windows(steps[name], device, 0, args.steps, 1, cpu[name])
    ips = {k: [args.steps * args.batch / s for s in v] for k, v in secs.items()}
    med = {k: statistics.median(v) for k, v in ips.items()}
    # Rounds are adjacent in time, so a per-round ratio cancels most of a shared machine's load.
    paired = statistics.median(o / h for o, h in zip(ips["ours"], ips["hf"]))
    per_cpu = {k: statistics.median(args.steps * args.batch / c for c in v) for k, v in cpu.items()}
    return {
        "mode": "compare-hf", "variant": args.variant, "image_size": args.image_size, "batch": args.batch,
        "precision": args.precision, "grad_checkpointing": args.grad_checkpointing, "params": n_ours,
        "ours_images_per_sec": med["ours"], "hf_images_per_sec": med["hf"],
        "ours_windows": ips["ours"], "hf_windows": ips["hf"], "ratio_ours_over_hf": paired,
        "ours_images_per_cpu_sec": per_cpu["ours"], "hf_images_per_cpu_sec": per_cpu["hf"],
        "ratio_cpu_time": per_cpu["ours"] / per_cpu["hf"],
        "ratio_of_medians": med["ours"] / med["hf"], "ratio_of_bests": max(ips["ours"]) / max(ips["hf"]),
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "transformers": transformers.__version__, "steps": args.steps, "windows": args.windows,
        "warmup": args.warmup, **_env(device),
    }


# ------------------------------------------------------------------------------------ --all


def _child(args, mode_flags: list[str], peak_tflops: float | None) -> dict[str, Any]:
    """Run this script in a child process for one mode (clean process group / device memory,
    and engine mode really runs without Ray imported)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, os.path.abspath(__file__), *mode_flags, "--variant", args.variant,
               "--image-size", str(args.image_size), "--batch", str(args.batch), "--precision",
               args.precision, "--zero", str(args.zero), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--windows", str(args.windows), "--device", args.device,
               "--num-classes", str(args.num_classes), "--head", args.head, "--json", out,
               "--no-results"]  # the parent records the whole table once
        if peak_tflops is not None:
            cmd += ["--peak-tflops", repr(peak_tflops)]
        if args.grad_checkpointing:
            cmd.append("--grad-checkpointing")
        if args.verbose:
            cmd.append("--verbose")
        proc = subprocess.run(cmd, stdout=None if args.verbose else subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(mode_flags)} failed (rc {proc.returncode}):\n"
                               f"{(proc.stdout or '')[-4000:]}")
        with open(out) as f:
            return json.load(f)


def markdown_table(results: list[dict[str, Any]]) -> str:
    rows = ["| run | variant | px | batch | precision | ZeRO | images/s (median) | best window | "
            "images per CPU-s | MFU (median) | note |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    eng = [r for r in results if r["mode"] == "engine"]
    eng_ips = statistics.mean(r["images_per_sec"] for r in eng) if eng else None
    eng_cpu = statistics.mean(r["images_per_cpu_sec"] for r in eng) if eng else None
    for r in results:
        if r["mode"] in ("engine", "ray"):
            note = ""
            if r["mode"] == "ray" and eng:
                eng_best = max(e["images_per_sec_best"] for e in eng)
                note = (f"ray / engine: medians {r['images_per_sec'] / eng_ips:.3f}, best windows "
                        f"{r['images_per_sec_best'] / eng_best:.3f}, per CPU-s "
                        f"{r['images_per_cpu_sec'] / eng_cpu:.3f} (vs the engine runs' mean / best)")
            rows.append(f"| {r['mode']} | {r['variant']} | {r['image_size']} | {r['batch']} | {r['precision']} | "
                        f"{r['zero']} | {r['images_per_sec']:.2f} | {r['images_per_sec_best']:.2f} | "
                        f"{r['images_per_cpu_sec']:.2f} | {r['mfu']:.1%} | {note} |")
        else:
            for who in ("ours", "hf"):
                note = (f"ours / HF = {r['ratio_ours_over_hf']:.3f} (per-round median; medians "
                        f"{r['ratio_of_medians']:.3f}, bests {r['ratio_of_bests']:.3f}, "
                        f"CPU-time {r['ratio_cpu_time']:.3f})" if who == "hf"
                        else "plain torch fwd+bwd+AdamW, linear head")
                rows.append(f"| {'ours' if who == 'ours' else 'transformers'} | {r['variant']} | {r['image_size']} | "
                            f"{r['batch']} | {r['precision']} | - | {r[who + '_images_per_sec']:.2f} | "
                            f"{max(r[who + '_windows']):.2f} | {r[who + '_images_per_cpu_sec']:.2f} | - | {note} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------- main

TITLE = "Training step (`benchmarks/train_step.py`)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="B/16")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=32, help="micro-batch per step (grad_accum 1)")
    p.add_argument("--precision", choices=["bf16", "fp32", "fp16"], default=None,
                   help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps per window")
    p.add_argument("--windows", type=int, default=3, help="timed windows; images/s is their median")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU; default 989 on cuda; on cpu measured with torch.mm if unset")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--head", choices=["pretrain", "finetune"], default="pretrain",
                   help="head for engine/ray modes (--compare-hf always uses the linear head)")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="train.compile=true (torch.compile, inductor)")
    p.add_argument("--mode", choices=["engine", "ray"], default="engine")
    p.add_argument("--compare-hf", action="store_true", help="ours vs transformers ViT instead of --mode")
    p.add_argument("--all", action="store_true", help="engine, ray and compare-hf; markdown table")
    p.add_argument("--json", default=None, help="write the result(s) here")
    p.add_argument("--verbose", action="store_true", help="show DeepSpeed/Ray logs")
    add_results_args(p)
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: use --device cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        os.environ.setdefault("DEEPSPEED_LOG_LEVEL", "warning")
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if args.all:
        peak, source = resolve_peak(args)  # measured once, shared by every child
        # engine again after ray: on a shared machine the load drifts over minutes
        results = [_child(args, ["--mode", "engine"], peak / 1e12),
                   _child(args, ["--mode", "ray"], peak / 1e12),
                   _child(args, ["--mode", "engine"], peak / 1e12),
                   _child(args, ["--compare-hf"], peak / 1e12)]
        table = markdown_table(results)
        print(f"peak for MFU: {source}")
        print(table)
        out: dict[str, Any] = {"results": results, "peak_source": source, "peak_tflops": peak / 1e12}
        append_result(args.results, TITLE, table, device=results[0]["device_name"],
                      notes=f"Peak for MFU: {source}.")
    elif args.compare_hf:
        res = run_compare_hf(args)
        print(f"ours {res['ours_images_per_sec']:.2f} img/s, transformers {res['hf_images_per_sec']:.2f} img/s "
              f"({res['hf_attn_implementation']}): ours / HF = {res['ratio_ours_over_hf']:.3f} "
              f"(median of per-round ratios; ratio of medians {res['ratio_of_medians']:.3f}, "
              f"of best windows {res['ratio_of_bests']:.3f}; per CPU-second {res['ratio_cpu_time']:.3f})")
        out = res
        append_result(args.results, TITLE, markdown_table([res]), device=res["device_name"])
    else:
        peak, source = resolve_peak(args)
        res = run_engine_step(args, peak, source) if args.mode == "engine" else run_ray(args, peak, source)
        print(f"[{res['mode']}] {res['variant']} {res['image_size']}px batch {res['batch']} {res['precision']} "
              f"ZeRO-{res['zero']}: {res['images_per_sec']:.2f} img/s (windows "
              f"{', '.join(f'{x:.2f}' for x in res['images_per_sec_windows'])}), "
              f"{res['achieved_tflops']:.3f} TFLOP/s, MFU {res['mfu']:.1%} of {res['peak_tflops']:.3f} TFLOP/s "
              f"[{res['peak_source']}]")
        out = res
        append_result(args.results, TITLE, markdown_table([res]), device=res["device_name"],
                      notes=f"Peak for MFU: {res['peak_source']}.")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
