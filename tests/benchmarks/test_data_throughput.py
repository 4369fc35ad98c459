"""benchmarks/data_throughput.py, ingest_ablation.py and randaug_cost.py still run end to end on a tiny corpus:
every path reports a positive rate, the ablation reads the shards the first one left, and each
appends its table with its command line to the results file it is given (never the repo's)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.ray


@pytest.mark.long(reason="a benchmark's smoke run or torch.compile on CPU; CI runs the checkpoint I/O "
                         "benchmark")
def test_data_throughput_and_ablation_smoke(tmp_path):
    env = dict(os.environ, RAY_ADDRESS="")  # their own local Ray, not the test session's
    work = str(tmp_path / "w")
    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "data_throughput.py"), "--images", "60",
           "--classes", "3", "--cpus", "2", "--storage", "40", "--size", "32", "--batch", "8",
           "--rounds", "1", "--epochs", "1", "--workdir", work, "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in proc.stdout.splitlines() if r.startswith("| (")]
    assert len(rows) == 7, proc.stdout[-3000:]
    for r in rows:  # "| path | batches | images/s | per core | vs DataLoader | rounds |"
        assert float(r.split("|")[3]) > 0, r
    refs = [r for r in rows if r.startswith("| (c) DataLoader")]
    assert len(refs) == 2 and all(r.split("|")[5].strip() == "1.00x" for r in refs)  # one per consumer
    assert os.path.exists(os.path.join(work, "shards-uint8", "manifest.json"))
    recorded = results.read_text()
    assert recorded.startswith("# Benchmark results\n")
    assert "## Data throughput (`benchmarks/data_throughput.py`)" in recorded
    assert "data_throughput.py --images 60 --classes 3" in recorded and "Machine: " in recorded
    assert all(r in recorded for r in rows)  # the printed table, row for row

    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "ingest_ablation.py"), "--workdir", work,
           "--cpus", "2", "--rounds", "1", "--epochs", "1", "--units", "16", "--size", "32", "--batch", "8",
           "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rates = [float(m) for m in re.findall(r"^\| 16 \| \d+ \| [^|]+ \| (\d+) \|", proc.stdout, re.M)]
    assert len(rates) == 3 and all(r > 0 for r in rates), proc.stdout[-3000:]
    recorded = results.read_text()
    assert recorded.count("## ") == 2 and "## Ingest task sizing" in recorded  # appended after
    assert "ingest_ablation.py --workdir" in recorded


@pytest.mark.long(reason="a benchmark's smoke run or torch.compile on CPU; CI runs the checkpoint I/O "
                         "benchmark")
def test_randaug_cost_smoke(tmp_path):
    """benchmarks/randaug_cost.py runs end to end on a tiny corpus: a row per setting with a positive
    rate, 'off' at 1.00x, the table appended with its command line."""
    env = dict(os.environ, RAY_ADDRESS="")
    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "randaug_cost.py"), "--images", "60", "--classes", "3",
           "--cpus", "2", "--storage", "40", "--size", "32", "--batch", "8", "--rounds", "1", "--epochs", "1",
           "--workdir", str(tmp_path / "w"), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in proc.stdout.splitlines() if r.startswith(("| off", "| 2 ops"))]
    assert len(rows) == 4 and all(float(r.split("|")[3]) > 0 for r in rows), proc.stdout[-3000:]
    assert rows[0].split("|")[4].strip() == "1.00x"
    recorded = results.read_text()
    assert "## RandAugment on the Ray Data workers" in recorded and "randaug_cost.py --images 60" in recorded
