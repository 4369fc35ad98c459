"""benchmarks/train_step.py still runs: engine mode, debug model, a few CPU steps, JSON out, and
its table appended to the results file it is given; --no-results writes none."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.long(reason="a benchmark's smoke run or torch.compile on CPU; CI runs the checkpoint I/O "
                         "benchmark")
@pytest.mark.slow  # a benchmark process that builds a DeepSpeed engine
def test_train_step_benchmark_engine_mode_cpu(tmp_path):
    out = tmp_path / "r.json"
    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--mode", "engine",
           "--variant", "pico/8", "--image-size", "32", "--batch", "8", "--num-classes", "10",
           "--device", "cpu", "--precision", "fp32", "--zero", "1", "--warmup", "1", "--steps", "2",
           "--windows", "1", "--peak-tflops", "0.1", "--json", str(out), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "engine" and res["variant"] == "pico/8" and res["batch"] == 8
    assert res["images_per_sec"] > 0 and 0 < res["mfu"] < 1
    assert res["train_flops_per_image"] > 0 and res["peak_tflops"] == 0.1
    assert res["params"] > 0 and res["loss_first"] > 0
    assert res["ray_imported"] is False  # engine mode must run where Ray is not installed
    assert "[engine] pico/8" in proc.stdout
    recorded = results.read_text()
    assert "## Training step (`benchmarks/train_step.py`)" in recorded
    assert "train_step.py --mode engine --variant pico/8" in recorded
    assert "| engine | pico/8 | 32 | 8 | fp32 | 1 |" in recorded and "device: " in recorded


def test_results_file_by_default_and_no_results_only_prints(tmp_path):
    spec = importlib.util.spec_from_file_location("record", os.path.join(ROOT, "benchmarks", "record.py"))
    record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record)
    p = argparse.ArgumentParser()
    record.add_results_args(p)
    assert p.parse_args([]).results == os.path.join(ROOT, "benchmarks", "RESULTS.md")  # writes by default
    assert p.parse_args(["--no-results"]).results is None
    assert record.append_result(None, "t", "| a |") is None
    path = tmp_path / "sub" / "R.md"
    assert record.append_result(str(path), "Title", "| a |\n|---|") == str(path)
    record.append_result(str(path), "Again", "| b |")
    text = path.read_text()
    assert text.startswith("# Benchmark results\n\n## Title, ") and "\n## Again, " in text
    assert "Command (from the repository root):" in text and "CPUs (" in text
