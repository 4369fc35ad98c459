"""The suite's own selection: a test that uses a Ray fixture (tests/conftest.py's RAY_FIXTURES) is
marked `ray` before `-m` deselects, so `make test-fast` (-m "... and not ray") leaves it out."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests/cluster/test_connect.py"  # its one test, marked `ray` only through its fixture


def _collected(marks: str) -> set[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                        "-p", "no:cacheprovider", "-m", marks, PROBE],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 5), p.stdout[-3000:] + p.stderr[-3000:]  # 5: every test deselected
    return {line.split("::")[1] for line in p.stdout.splitlines() if "::" in line}


def test_a_test_using_a_ray_fixture_is_left_out_by_not_ray():
    name = "test_a_local_ray_beside_another_is_the_one_its_processes_find"
    assert _collected("ray") == {name}
    assert _collected("not ray") == set()
