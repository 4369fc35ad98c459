"""benchmarks/checkpoint_io.py still runs: the debug model's checkpoint to local disk and to the
S3 server, its table appended to the results file it is given."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.e2e
def test_checkpoint_io_benchmark_local_and_s3(tmp_path, s3):
    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "checkpoint_io.py"), "--variant", "pico/8",
           "--dest", "local", "--dest", "s3", "--repeats", "1", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|") for line in results.read_text().splitlines() if line.startswith("| pico/8")]
    assert [r[4].strip() for r in rows] == ["local", "s3"]
    for r in rows:
        mb, save, persist, rate, blocked = (float(c) for c in r[5:10])
        assert mb > 0.1 and save > 0 and persist > 0 and blocked >= save
    assert "checkpoint_io.py --variant pico/8" in results.read_text()
