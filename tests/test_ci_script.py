"""`.ci/run` says in one line when a suite ran past its budget or into its 20% margin."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _budget_check(target: str, seconds: int, budget_min: int) -> str:
    """Run .ci/run's own budget_check function (sourced from the script, not copied)."""
    script = (ROOT / ".ci" / "run").read_text()
    start = script.index("budget_check() {")
    body = script[start:script.index("\n}\n", start) + 3]
    out = subprocess.run(["bash", "-c", f"{body}\nbudget_check {target} {seconds} {budget_min}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("seconds", [60, 384])
def test_a_suite_within_its_margin_says_nothing(seconds):
    assert _budget_check("test", seconds, 8) == ""


def test_a_suite_in_its_margin_is_warned_with_the_excess():
    (line,) = _budget_check("test", 400, 8).splitlines()
    assert line.startswith("CI: WARNING: make test took 400s, 16s into its 20% margin"), line


def test_a_suite_over_its_budget_is_warned_with_the_excess():
    (line,) = _budget_check("test-e2e", 1600, 25).splitlines()
    assert line.startswith("CI: WARNING: make test-e2e took 1600s, 100s over its 25 min budget"), line


def test_every_suite_ci_runs_is_checked_against_its_budget():
    script = (ROOT / ".ci" / "run").read_text()
    assert 'budget_check "$1"' in script[script.index("suite() {"):]
    assert "suite test 8" in script and "suite test-e2e 25" in script
