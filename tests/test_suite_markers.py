"""The suite's own selection: a test that uses a Ray fixture (tests/conftest.py's RAY_FIXTURES) is
marked `ray`, and one on the session's real MLflow server `slow`, before `-m` deselects, so
`make test-fast` (-m "... and not slow and not ray") leaves them out (a SQLite twin stays)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests/cluster/test_connect.py"  # its one test, marked `ray` only through its fixture


def _collected(marks: str, probe: str = PROBE) -> set[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                        "-p", "no:cacheprovider", "-m", marks, probe],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 5), p.stdout[-3000:] + p.stderr[-3000:]  # 5: every test deselected
    return {line.split("::")[1] for line in p.stdout.splitlines() if "::" in line}


@pytest.mark.slow  # pytest collecting in subprocesses (torch, ray imports): make test, not test-fast
def test_a_test_using_a_ray_fixture_is_left_out_by_not_ray():
    name = "test_a_local_ray_beside_another_is_the_one_its_processes_find"
    assert _collected("ray") == {name}
    assert _collected("not ray") == set()


@pytest.mark.slow  # as above
def test_a_test_on_the_real_mlflow_server_is_slow_and_its_sqlite_twin_is_not():
    probe = "tests/tracking/test_runs.py"  # its tests take tracking_uri: one per store
    fast, everything = _collected("not slow", probe), _collected("", probe)
    twins = {t for t in fast if t.endswith("[sqlite]")}
    assert twins and not [t for t in fast if "[server]" in t], fast
    assert {t.replace("[sqlite]", "[server]") for t in twins} <= everything - fast


def test_durations_replace_the_entries_of_every_file_the_logs_ran(tmp_path, monkeypatch, capsys):
    import json

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import durations
    finally:
        sys.path.pop(0)
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / "tests" / name).write_text("")
    table = tmp_path / "tests" / "durations.json"
    table.write_text(json.dumps({"tests/test_a.py::test_renamed_since": 9, "tests/test_a.py::test_kept": 9,
                                 "tests/test_b.py::test_not_run_this_time": 7, "tests/test_gone.py::test_x": 5}))
    log = tmp_path / "run.log"
    log.write_text("12.50s call     tests/test_a.py::test_kept\n"
                   "0.40s setup    tests/test_a.py::test_kept\n"
                   "3.00s call     tests/test_a.py::test_bad[config debug --set optim.lr=nan]\n"
                   "0.30s call     tests/test_a.py::test_quick\n")
    monkeypatch.setattr(durations, "PATH", table)
    durations.main([str(log)])
    assert json.loads(table.read_text()) == {
        "tests/test_a.py::test_kept": 13,  # setup + call
        "tests/test_a.py::test_bad[config debug --set optim.lr=nan]": 3,  # an id with spaces, whole
        "tests/test_b.py::test_not_run_this_time": 7}  # a file the log did not run keeps its entries


def test_the_long_tier_is_what_the_test_files_mark():
    """A whole test marked `long` and the cases `long_cases` names are left out by `not long`; the
    grid's other cases stay in CI."""
    probe = "tests/train/test_resize.py"
    named = re.search(r"@pytest\.mark\.long_cases\(((?:\"[^\"]+\",\s*)+)", (ROOT / probe).read_text())
    cases = set(re.findall(r'"([^"]+)"', named.group(1)))
    grid = {t for t in _collected("", probe) if t.startswith("test_resume_at_another_world_size[")}
    long = {t for t in _collected("long", probe) if t.startswith("test_resume_at_another_world_size[")}
    assert cases and long == {f"test_resume_at_another_world_size[{c}]" for c in cases}
    assert grid - long and _collected("not long", probe) >= grid - long  # the grid's other cases stay in CI
    probe = "tests/tune/test_sweep.py"
    marked = re.findall(r"@pytest\.mark\.long\(.*\n(?:.*\n)*?def (test_\w+)", (ROOT / probe).read_text())
    assert marked and _collected("long", probe) == set(marked)


class _Item:
    """What tiers.mark_long reads of a pytest item."""

    def __init__(self, nodeid, marks, case=None):
        self.nodeid, self.marks, self.added = nodeid, marks, []
        self.callspec = type("Spec", (), {"id": case})() if case else None

    def iter_markers(self, name):
        return [m for m in self.marks if m.name == name]

    def get_closest_marker(self, name):
        return next(iter(self.iter_markers(name)), None)

    def add_marker(self, mark):
        self.added.append(mark)


def test_a_long_marker_needs_its_reason_and_a_case_that_exists():
    import pytest

    from tiers import mark_long

    cases = pytest.mark.long_cases("a", reason="CI keeps b").mark
    items = [_Item(f"t.py::f[{c}]", [cases], c) for c in ("a", "b")]
    mark_long(items, [])
    assert [len(i.added) for i in items] == [1, 0] and items[0].added[0].kwargs["reason"] == "CI keeps b"
    with pytest.raises(pytest.UsageError, match="reason="):
        mark_long([_Item("t.py::g", [pytest.mark.long.mark])], [])
    renamed = [_Item("t.py::f[b]", [pytest.mark.long_cases("gone", reason="r").mark], "b")]
    with pytest.raises(pytest.UsageError, match=r"t\.py::f\[gone\]"):
        mark_long(renamed, [])
    mark_long(renamed, ["t.py::f[b]"])  # one case asked for: its siblings were not collected


def test_only_the_long_targets_collect_the_long_tier():
    """Every Makefile target that selects tests by marker leaves `long` out, but test-long's own;
    `make test-fast` among them (it once collected long tests)."""
    text = (ROOT / "Makefile").read_text()
    targets = dict(re.findall(r"^([\w-]+):.*\n(?:\t.*\n)*?\t\$\(BIN\)/python -m pytest -m \"([^\"]+)\"", text, re.M))
    assert {"test", "test-fast", "test-e2e", "test-long"} <= set(targets), targets
    for target, marks in targets.items():
        if target == "test-long":
            assert marks.startswith("long and"), marks
        else:
            assert "not long" in marks, (target, marks)


E2E_TEST_TIMEOUT_S = 600  # CI's cap on one e2e test (issue: one test must not eat the suite's budget)


def test_no_test_ci_runs_may_take_more_than_ten_minutes():
    """`make test-e2e` passes --timeout=600, and no test outside the long tier raises its own
    timeout above it (a marker wins over the command line)."""
    text = (ROOT / "Makefile").read_text()
    (e2e,) = re.findall(r"^test-e2e:.*\n\t(.*)$", text, re.M)
    assert f"--timeout={E2E_TEST_TIMEOUT_S}" in e2e, e2e
    over = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        source = path.read_text()
        # a decorator block: lines from "@", with the indented continuations of a wrapped call
        for m in re.finditer(r"((?:^[ \t]*@.*\n)(?:^(?:[ \t]*@|[ \t]+\S).*\n)*)[ \t]*(?:async )?def (test_\w+)",
                             source, re.M):
            decorators, name = m.groups()
            limits = [int(x) for x in re.findall(r"@pytest\.mark\.timeout\((\d+)", decorators)]
            if any(t > E2E_TEST_TIMEOUT_S for t in limits) and "@pytest.mark.long(" not in decorators:
                over.append(f"{path.relative_to(ROOT)}::{name} ({max(limits)} s)")
    assert not over, "over the 10-minute cap outside the long tier: " + ", ".join(over)
