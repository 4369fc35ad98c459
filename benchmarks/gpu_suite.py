"""The GPU suite: the training step of B/16, L/16 and H/14 at 224 px, bf16, SDPA attention,
eager and `torch.compile`, ZeRO 0 / 1 / 2 / 3 on one GPU, in one table.

Run (from the repository root):

  .venv/bin/python benchmarks/gpu_suite.py            # on a CUDA machine: the real suite
  .venv/bin/python benchmarks/gpu_suite.py --tiny     # anywhere (CPU here): the same cases on a
                                                      # pico/8 at 32 px, so the suite is known to run

On a GPU machine whose python3 has torch but not DeepSpeed, `benchmarks/device_bundle.sh` packs
what is missing into .gpu/; run there with PYTHONPATH=$PWD/.gpu/site:$PWD python3 benchmarks/....

Each case is one child process of benchmarks/train_step.py in engine mode (DeepSpeed engine of a
world of one and our train_step, no Ray imported; fused AdamW on CUDA), so device memory and
compile caches start clean. Columns: images/s (median of timed windows), MFU against 989 TFLOP/s
(H100/H200 dense bf16; on CPU one torch.mm peak measured first, for every case), peak device memory (CUDA allocator peak;
max RSS on CPU, which includes the Python/torch runtime) and the memory model's figure
(`vitp model VARIANT --zero S --micro-batch B`). The table is appended to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)

# variant -> micro-batch on an 80 GB GPU (`vitp plan` fits these at ZeRO 0 without checkpointing)
GPU_CASES = {"B/16": 128, "L/16": 64, "H/14": 32}
TINY_CASES = {"pico/8": 8}


def run_case(args, variant: str, batch: int, zero: int, compiled: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--mode", "engine", "--variant", variant,
               "--image-size", str(args.image_size), "--batch", str(batch), "--precision", args.precision,
               "--zero", str(zero), "--steps", str(args.steps), "--windows", str(args.windows),
               "--warmup", str(args.warmup), "--json", out, "--no-results"]
        if args.peak_tflops:
            cmd += ["--peak-tflops", repr(args.peak_tflops)]
        if compiled:
            cmd.append("--compile")
        print("$", " ".join(cmd), flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "zero": zero, "compile": compiled, "batch": batch,
                    "error": f"did not finish in --case-timeout {args.case_timeout} s"}
        if proc.returncode:
            return {"variant": variant, "zero": zero, "compile": compiled, "batch": batch,
                    "error": (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]}
        with open(out) as f:
            return json.load(f)


def table(rows: list[dict]) -> str:
    lines = ["| variant | px | batch | precision | ZeRO | compile | images/s | MFU | peak mem GB | model GB | "
             "peak / model |", "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | {r['batch']} | - | {r['zero']} | {r['compile']} | failed: "
                         f"{r['error']} | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['image_size']} | {r['batch']} | {r['precision']} | {r['zero']} | "
                     f"{'yes' if r['compile'] else 'no'} | {r['images_per_sec']:.2f} | {r['mfu']:.1%} | "
                     f"{r['mem_gb']:.2f} | {r['mem_model_gb']:.2f} | {r['mem_gb'] / r['mem_model_gb']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="pico/8 at 32 px on the CPU (tests, no GPU)")
    ap.add_argument("--zero", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--variants", nargs="+", default=None, metavar="V",
                    help=f"a subset of the cases, in this order (default: all of {list(GPU_CASES)})")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--compile-only", action="store_true", help="torch.compile cases only")
    ap.add_argument("--case-timeout", type=float, default=900, metavar="S",
                    help="seconds one case may take before it is recorded as failed (default 900)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="default: 989 on CUDA, measured on CPU")
    ap.add_argument("--json", default=None)
    add_results_args(ap)
    args = ap.parse_args(argv)
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device: run with --tiny to exercise the suite on the CPU")
    cases = TINY_CASES if args.tiny else GPU_CASES
    if args.variants:
        unknown = [v for v in args.variants if v not in cases]
        if unknown:
            ap.error(f"--variants {' '.join(unknown)}: not a case of this suite; choose from {' '.join(cases)}")
        cases = {v: cases[v] for v in args.variants}
    if args.no_compile and args.compile_only:
        ap.error("--no-compile and --compile-only exclude each other: give one")
    modes = (False,) if args.no_compile else (True,) if args.compile_only else (False, True)
    args.image_size, args.precision = (32, "fp32") if args.tiny else (224, "bf16")
    if args.peak_tflops is None and args.tiny:  # one measured CPU peak for every case's MFU
        import torch
        from train_step import measure_matmul_peak

        args.peak_tflops = measure_matmul_peak(torch.device("cpu"), torch.float32) / 1e12
        print(f"peak for MFU: measured 2048^3 fp32 torch.mm = {args.peak_tflops:.3f} TFLOP/s", flush=True)
    rows = [run_case(args, variant, batch, zero, compiled)
            for variant, batch in cases.items() for zero in args.zero
            for compiled in modes]
    text = table(rows)
    print(text)
    device = next((r["device_name"] for r in rows if "device_name" in r), None)
    append_result(args.results, "GPU suite (`benchmarks/gpu_suite.py" + (" --tiny" if args.tiny else "") + "`)",
                  text, device=device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
