"""The suite's own selection: a test that uses a Ray fixture (tests/conftest.py's RAY_FIXTURES) is
marked `ray`, and one on the session's real MLflow server `slow`, before `-m` deselects, so
`make test-fast` (-m "... and not slow and not ray") leaves them out (a SQLite twin stays)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests/cluster/test_connect.py"  # its one test, marked `ray` only through its fixture


def _collected(marks: str, probe: str = PROBE) -> set[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                        "-p", "no:cacheprovider", "-m", marks, probe],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 5), p.stdout[-3000:] + p.stderr[-3000:]  # 5: every test deselected
    return {line.split("::")[1] for line in p.stdout.splitlines() if "::" in line}


def test_a_test_using_a_ray_fixture_is_left_out_by_not_ray():
    name = "test_a_local_ray_beside_another_is_the_one_its_processes_find"
    assert _collected("ray") == {name}
    assert _collected("not ray") == set()


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


def test_the_long_tier_is_what_tests_long_txt_lists():
    """tests/long.txt's entries of a file are exactly the tests of it marked `long` (the whole
    list's entries are checked against what each run collects, in tests/conftest.py)."""
    from tiers import is_long, long_entries, stale_entries

    probe = "tests/tune/test_sweep.py"
    entries = [e for e in long_entries() if e.startswith(probe + "::")]
    assert entries and {e.split("::")[1] for e in entries} == _collected("long", probe)
    named = [f"{probe}::{name}" for name in _collected("", probe)]
    assert stale_entries(entries, named, [probe], ROOT) == []
    assert stale_entries([f"{probe}::test_renamed_since"], named, [probe], ROOT) == [f"{probe}::test_renamed_since"]
    assert stale_entries([f"{probe}::test_renamed_since"], named[:1], [named[0]], ROOT) == []  # one test asked for
    assert is_long(f"{probe}::test_x[a-b]", [f"{probe}::test_x"]) and not is_long(f"{probe}::test_xy", [f"{probe}::test_x"])
