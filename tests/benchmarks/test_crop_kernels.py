"""benchmarks/crop_kernels.py runs end to end on a few crops: a row per size with both kernels'
times, the kernel crop_resize picks there, and the section it appends to the results file given."""
import os
import re
import subprocess
import sys

import pytest

from vitp.data.decode import TORCH_CROP_MIN_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # torch imported twice in subprocesses: not for make test-fast
def test_crop_kernels_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    sizes = [TORCH_CROP_MIN_SIZE // 2, TORCH_CROP_MIN_SIZE]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "crop_kernels.py"), "--sizes",
                           *map(str, sizes), "--crops", "20", "--rounds", "1", "--results", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| [\d.]+ \| (torch|Pillow) \|$", proc.stdout, re.M)
    picked = {int(size): kernel for size, _, _, kernel in rows}
    assert picked == {sizes[0]: "Pillow", sizes[1]: "torch"}, proc.stdout
    assert all(int(t) > 0 and int(p) > 0 for _, t, p, _ in rows)
    recorded = results.read_text()
    assert "## Crop + resize kernels (`benchmarks/crop_kernels.py`)" in recorded
    assert "crop_kernels.py --sizes" in recorded and "Importing torch in a fresh process" in recorded
