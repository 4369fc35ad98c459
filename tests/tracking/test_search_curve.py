"""`vitp compare --sweep`'s search view on a real SQLite store: the best top-1 so far after each
trial in the order trials ended (a failed trial is used but scores nothing), the best trial with the
values its parent says were searched, and the PNG of both curves logged to the parent."""
import json
import subprocess
import sys
import uuid

import pytest
from mlflow.tracking import MlflowClient

from vitp.tracking import RunLogger
from vitp.tracking.compare import compare_rows, sweep_parents
from vitp.tracking.search_curve import best_so_far, plot_search, search_plot_path, summary_lines, swept_keys

# name, val/top1 per evaluation, status, lr, optimizer: ended in this order
TRIALS = [("t1", [0.3, 0.4], "FINISHED", 0.01, "sgd"), ("t2", [0.6], "FAILED", 0.1, "adamw"),
          ("t3", [0.55, 0.5], "FINISHED", 0.003, "adamw"), ("t4", [0.7], "FINISHED", 0.0123, "sgd"),
          ("t5", [0.65], "KILLED", 0.02, "sgd")]
SPACE = {"optim.lr": "loguniform(1e-4, 1e-1)", "optim.name": ["sgd", "adamw"], "source": ["scratch"]}


def _sweep(uri):
    exp = f"search-{uuid.uuid4().hex[:8]}"
    with RunLogger.start(uri, exp, "sweep-sc", tags={"sweep": "sc", "kind": "sweep"}) as parent:
        parent.log_params({"sweep.space": json.dumps(SPACE), "sweep.search": "optuna"})
        for name, top1, status, lr, opt in TRIALS:
            child = RunLogger.start(uri, exp, name, parent_run_id=parent.run_id, resume_by_name=False,
                                    tags={"sweep": "sc", "dataset": "digits"})
            child.log_params({"optim": {"lr": lr, "name": opt}, "data": {"source": "digits"}})
            for i, v in enumerate(top1):
                child.log_metrics({"val/top1": v}, step=i + 1)
            child.end(status)
    return exp, parent.run_id


def test_best_so_far_counts_every_ended_trial_and_scores_only_finished_ones(sqlite_uri, tmp_path):
    exp, parent = _sweep(sqlite_uri)
    rows = compare_rows(sqlite_uri, exp, sweep="sc")
    (points,) = best_so_far(rows).values()
    assert [p["run_name"] for p in points] == ["t1", "t2", "t3", "t4", "t5"]
    assert [p["trials"] for p in points] == [1, 2, 3, 4, 5]
    assert [p["value"] for p in points] == [0.4, None, 0.55, 0.7, None]
    assert [p["best"] for p in points] == [0.4, 0.4, 0.55, 0.7, 0.7]
    walls = [p["wall_s"] for p in points]
    assert walls == sorted(walls) and walls[0] >= 0

    keys = swept_keys(sqlite_uri, sweep_parents(rows))
    assert keys == ["optim.lr", "optim.name"]  # the axes (source) are not config values
    lines = summary_lines(rows, keys)
    assert lines[0] == "best so far on digits, after each of 5 trial(s): 0.4000, 0.4000, 0.5500, 0.7000, 0.7000"
    assert lines[1].startswith("best configuration on digits: t4 top-1 0.7000: optim.lr=0.0123, optim.name=sgd "
                               "(trial 4 of 5, "), lines[1]

    png = plot_search(rows, tmp_path / "c-search.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert search_plot_path("out/compare.png") == "out/compare-search.png"


@pytest.mark.slow  # a whole `vitp compare --sweep --plot` (~11 s): make test, not test-fast
def test_compare_sweep_prints_the_search_and_logs_its_plot_to_the_parent(sqlite_uri, tmp_path):
    exp, parent = _sweep(sqlite_uri)
    out = subprocess.run([sys.executable, "-m", "vitp.cli", "compare", "--tracking-uri", sqlite_uri,
                          "--experiment", exp, "--sweep", "sc", "--plot", str(tmp_path / "cmp.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "best configuration on digits: t4 top-1 0.7000" in out.stdout, out.stdout
    assert (tmp_path / "cmp-search.png").stat().st_size > 10_000
    logged = sorted(a.path for a in MlflowClient(sqlite_uri).list_artifacts(parent, "compare"))
    assert logged == ["compare/cmp-search.png", "compare/cmp.png"]


def test_the_mlflow_page_of_the_trials_side_by_side_is_named_for_a_server_only(sqlite_uri):
    """compare_url: MLflow's compare page of the sweep's trials (its parallel-coordinates plot is
    checked in a browser by tests/cli/test_demo_e2e.py), without the login a URI may carry."""
    from urllib.parse import unquote

    from vitp.tracking.search_curve import compare_url

    exp, parent = _sweep(sqlite_uri)
    rows = compare_rows(sqlite_uri, exp, sweep="sc")
    assert compare_url(sqlite_uri, rows) is None  # a local store has no page
    url = compare_url("https://alice:s3cret@mlflow.example.com:8443/ml/", rows)
    base, query = url.split("/#/compare-runs?")
    assert base == "https://mlflow.example.com:8443/ml" and "s3cret" not in url
    runs, experiments = (json.loads(unquote(part.split("=", 1)[1])) for part in query.split("&"))
    assert sorted(runs) == sorted(r["run_id"] for r in rows if r["parent"]) and len(runs) == len(TRIALS)
    assert experiments == [rows[0]["experiment_id"]]


def test_a_runs_own_name_is_not_logged_as_a_param(sqlite_uri):
    """Every trial would differ in it, and MLflow's comparisons plot the params runs differ in."""
    exp = f"np-{uuid.uuid4().hex[:8]}"
    with RunLogger.start(sqlite_uri, exp, "r1") as run:
        run.log_config({"tracking": {"run_name": "r1", "experiment": exp}, "optim": {"lr": 0.1}})
    params = MlflowClient(sqlite_uri).get_run(run.run_id).data.params
    assert params == {"tracking.experiment": exp, "optim.lr": "0.1"}
