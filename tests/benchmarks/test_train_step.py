"""benchmarks/train_step.py still runs: engine mode, debug model, a few CPU steps, JSON out."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_step_benchmark_engine_mode_cpu(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--mode", "engine",
           "--variant", "pico/8", "--image-size", "32", "--batch", "8", "--num-classes", "10",
           "--device", "cpu", "--precision", "fp32", "--zero", "1", "--warmup", "1", "--steps", "2",
           "--windows", "1", "--peak-tflops", "0.1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "engine" and res["variant"] == "pico/8" and res["batch"] == 8
    assert res["images_per_sec"] > 0 and 0 < res["mfu"] < 1
    assert res["train_flops_per_image"] > 0 and res["peak_tflops"] == 0.1
    assert res["params"] > 0 and res["loss_first"] > 0
    assert res["ray_imported"] is False  # engine mode must run where Ray is not installed
    assert "[engine] pico/8" in proc.stdout
