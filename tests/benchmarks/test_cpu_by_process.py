"""benchmarks/cpu_by_process.py: a child's CPU is counted under its kind, whatever process
started it, and the command's exit status is passed on."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "cpu_by_process.py")
# A parent that waits while its child spins for about a second of CPU (0.4 s on a machine 2.5x as fast).
PARENT = ("import subprocess, sys; subprocess.run([sys.executable, '-m', 'timeit', '-n', '1', '-r', '1', "
          "'sum(range(60_000_000))'], check=True)")


def test_a_childs_cpu_is_counted_under_its_kind():
    proc = subprocess.run([sys.executable, SCRIPT, "--interval", "0.05", "--", sys.executable, "-c", PARENT],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = dict((name, float(cpu)) for cpu, name in re.findall(r"^\| ([\d.]+) \| \d+% \| `([^`]+)` \|$",
                                                                 proc.stdout, re.M))
    assert kinds.get("python -m timeit", 0) > 0.2, proc.stdout  # the child: its own kind, not the parent's
    total = float(re.search(r"exit 0, [\d.]+ s wall, ([\d.]+) CPU-s", proc.stdout).group(1))
    assert total >= kinds["python -m timeit"]


@pytest.mark.long(reason="a benchmark's smoke run or torch.compile on CPU; CI runs the checkpoint I/O "
                         "benchmark")
def test_exit_status_is_the_commands_and_no_command_is_a_usage_error():
    failed = subprocess.run([sys.executable, SCRIPT, "--", sys.executable, "-c", "raise SystemExit(3)"],
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 3 and "exit 3" in failed.stdout
    usage = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "no command" in usage.stderr
