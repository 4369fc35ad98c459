"""benchmarks/gpu_suite.py --tiny runs every case of the GPU suite (ZeRO 0/1/2/3, eager and
torch.compile) on a pico/8 on the CPU, so the command is known to work before a GPU appears: the
eager cases in `make test`, the compiled ones (--compile-only) in `make test-long` (`make test`
compiles one run: tests/train/test_compile.py)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.e2e)],
                         ids=["eager", "compiled"])  # 3 inductor compiles: ~2 min here
@pytest.mark.long_cases("compiled", reason="torch.compile of every ZeRO stage; CI compiles one "
                                               "(tests/train/test_compile.py)")
def test_gpu_suite_runs_every_case_tiny_on_cpu(tmp_path, compiled):
    out, results = tmp_path / "suite.json", tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_suite.py"), "--tiny", "--steps", "2",
           "--windows", "1", "--warmup", "1", "--peak-tflops", "0.1", "--json", str(out),
           "--results", str(results)] + (["--compile-only"] if compiled else ["--no-compile"])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert {(r["zero"], r["compile"]) for r in rows} == {(z, compiled) for z in (0, 1, 2, 3)}
    for r in rows:
        assert r["variant"] == "pico/8" and r["images_per_sec"] > 0 and 0 < r["mfu"] < 1
        assert r["mem_gb"] > 0 and r["mem_model_gb"] > 0 and r["ray_imported"] is False
    recorded = results.read_text()
    assert "## GPU suite (`benchmarks/gpu_suite.py --tiny`)" in recorded
    assert recorded.count("| pico/8 | 32 | 8 | fp32 |") == len(rows)
