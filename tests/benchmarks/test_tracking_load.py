"""MLflow on a real PostgreSQL under the load of many ranks and trials logging at once
(benchmarks/tracking_load.py, small): every point sent through the spool is stored once, each
history is steps 1..N, and the table with the posts' latency goes to the results file given."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.long_cases("12-streams", reason="the bigger load; CI runs 4 streams")
@pytest.mark.e2e
@pytest.mark.parametrize("ranks,trials,steps,rounds", [pytest.param(2, 2, 10, 1, id="4-streams"),
                                                       pytest.param(4, 8, 40, 2, id="12-streams")])
def test_postgresql_backed_mlflow_stores_every_point_of_many_streams_once(tmp_path, ranks, trials, steps, rounds):
    results, out = tmp_path / "RESULTS.md", tmp_path / "load.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "tracking_load.py"), "--ranks", str(ranks),
           "--trials", str(trials), "--steps", str(steps), "--rate", "10", "--rounds", str(rounds),
           "--round-steps", "5", "--json", str(out), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["backend"] == "postgresql" and r["streams"] == ranks + trials
    # 20 keys a step for a rank, 8 for a trial
    assert r["sent"] == ranks * steps * 20 + trials * steps * 8 == r["stored"] and r["wrong"] == [], r
    assert r["undrained"] == 0 and r["posts"] >= r["streams"] and 0 < r["post_p50_s"] <= r["post_p99_s"]
    assert r["steps_per_s"]["logging"] > 0 and r["steps_per_s"]["not logging"] > 0
    text = results.read_text()
    assert f"tracking_load.py --ranks {ranks}" in text and f"| {r['sent']} | {r['stored']} | 0 |" in text
