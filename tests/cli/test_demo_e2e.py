"""`vitp demo --quick` end to end, and its MLflow store in a real browser (e2e): the summary has
both sources, the raw-pixel reference, few-shot and the plots; a broken stage makes the demo exit
non-zero (CI runs both at smaller sizes, TINY); headless Chromium on the
printed page shows the training runs, the sweep's nested trials, the dataset input and the
registered model, and on the page `vitp compare --sweep` names, the trials' parallel coordinates
over the params they differ in (screenshots in test-artifacts/).
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .test_every_command import ROOT, is_png, ok, vitp, vitp_env

ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo") / "work"
    r = ok(vitp("demo", "--quick", "--work-dir", str(work), timeout=1500))
    return work, r


@pytest.mark.long(reason="`vitp demo --quick` at its own sizes (~7 min); the CLI chain runs each stage's "
                         "command")
@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow
def test_demo_quick_prints_the_comparison_reference_fewshot_and_plots(demo):
    work, r = demo
    assert re.search(r"^demo finished in \d+s", r.out, re.M), str(r)
    for n, stage in enumerate(("corpus", "pre-training", "reference", "few-shot", "sweep", "results"), 1):
        assert f"[demo] {n}/6 {stage}: " in r.out, stage
    table = r.out[r.out.index("== vit-pipeline demo --quick"):]
    seeds = re.search(r"^  source\s+(seed \d+\s+)+mean \+- std$", table, re.M)
    assert seeds, str(r)
    for label in ("pre-trained", "scratch", "linear on raw pixels"):
        assert re.search(rf"^  {label}\s+0\.\d{{3}}", table, re.M), label
    assert re.search(r"^  margin \(points\)\s+[+-]\d", table, re.M)
    assert re.search(r"^pre-training (beat|did NOT beat) training from scratch", table, re.M)
    assert re.search(r"^few-shot linear probe .* on demo_fractals: 1-shot 0\.\d+", table, re.M), table
    for png in ("low_data.png", "compare.png"):
        assert f"{work}/{png}" in table and is_png(work / png)
    assert "status:  every stage succeeded" in table
    assert (work / "export" / "model.safetensors").is_file()
    # what the demo measured, as a file (docs/demo.md quotes such files): the numbers it printed
    saved = json.loads((work / "demo-result.json").read_text())
    assert f"results: {work}/demo-result.json" in r.out and saved["quick"] and saved["seed"] == 0
    assert set(saved["headline"]) == {"pre-trained", "scratch", "linear on raw pixels"}
    for label, group in saved["headline"].items():
        values = r"\s+".join(f"{v:.3f}" for v in group["values"])
        assert re.search(rf"^  {label}\s+{values}\b", table, re.M), (label, group)
    assert saved["verdict"]["margins"] and saved["failed"] == []


def _page_text(url: str, dump: Path, screenshot: Path | None = None) -> str:
    """The page's text after its scripts ran, as headless Chromium renders it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, ("no chromium on PATH: `make browser` installs Debian's package "
                      "(apt-get install chromium); browsers cannot be downloaded at run time")
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=20000", "--window-size=1600,1000"]
    p = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    dump.write_text(p.stdout)
    if screenshot:
        subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=180,
                       cwd=screenshot.parent)
        assert is_png(screenshot), f"no screenshot of {url}"
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", p.stdout, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))


@pytest.mark.long(reason="`vitp demo --quick` at its own sizes (~7 min); the CLI chain runs each stage's "
                         "command")
@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow
def test_the_printed_mlflow_page_shows_runs_lineage_and_the_model_in_a_browser(demo, tmp_path):
    from vitp.tracking import start_server

    work, r = demo
    printed = re.search(r"then open (http://127\.0\.0\.1:5000(/\S*))", r.out)
    assert printed, str(r)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    runs_in_store = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parent = next(x for x in runs_in_store if x.data.tags.get("kind") == "sweep")
    trials = [x.info.run_name for x in runs_in_store if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == 4, trials
    ARTIFACTS.mkdir(exist_ok=True)
    server = start_server(f"sqlite:///{work}/mlflow.db", str(work / "mlartifacts"), host="127.0.0.1", port=0)
    try:
        page = _page_text(server.uri + printed.group(2), tmp_path / "runs.html", ARTIFACTS / "mlflow-demo-runs.png")
        print(f"screenshot: {ARTIFACTS / 'mlflow-demo-runs.png'}")
        assert "Run Name" in page and "No data available" not in page, page[:2000]  # runs, not the GenAI overview
        assert "demo-pico8-synthetic" in page, page[:3000]  # the pre-training run ...
        assert re.search(r"synthetic \([0-9a-f]{12}\) train", page), page[:3000]  # ... its shards as Dataset
        assert "vitp pretrain demo" in page, page[:3000]  # ... its Source
        assert re.search(r"vit-demo v\d+", page), page[:3000]  # ... and the registered model it became
        assert "sweep-demo-quick" in page, page[:3000]
        # the trials are nested under the sweep parent: not top-level rows, but counted
        assert not [t for t in trials if t in page], page[:3000]
        assert f"{len(runs_in_store)} matching runs" in page, page[:3000]

        run_page = _page_text(f"{server.uri}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
                              "?workflowType=machine_learning", tmp_path / "parent.html")
        children = run_page[run_page.index("Child runs"):]
        assert all(t in children for t in trials), run_page[:3000]

        # `vitp compare --sweep` names MLflow's page of the trials side by side: its parallel
        # coordinates plot the first three params the trials differ in, each axis over its range
        r = ok(vitp("compare", "--tracking-uri", server.uri, "--sweep", parent.data.tags["sweep"]))
        url = re.search(r"parallel coordinates of the params they differ in\): (\S+)", r.out)
        assert url, r.out[-2000:]
        plot = _page_text(url.group(1), tmp_path / "compare.html", ARTIFACTS / "mlflow-demo-parallel-coordinates.png")
        trial_runs = [x for x in runs_in_store if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        differ = sorted(k for k in set().union(*(c.data.params for c in trial_runs))
                        if len({c.data.params.get(k) for c in trial_runs}) > 1)
        assert differ and "tracking.run_name" not in differ, differ  # a run's name is not a param
        shown = re.search(r"Parallel Coordinates Plot .*?Parameters: (.*?)\s+Metrics: (\S+)\s+Clear All", plot)
        assert shown and shown.group(1).split() == differ[:3], (differ, plot[:3000])
        assert all(shown.group(2) in c.data.metrics for c in trial_runs), shown.group(2)
        for key in differ[:3]:
            values = [c.data.params.get(key) for c in trial_runs]
            try:
                numbers = [float(v) for v in values]
            except (TypeError, ValueError):  # a categorical axis: each value a tick (cut to 10 characters)
                assert all(v[:10] in plot for v in values if v), (key, values)
                continue
            assert f"{key} {max(numbers):.5f} {min(numbers):.5f}" in plot, (key, values, plot[:3000])

        models = _page_text(server.uri + "/#/models", tmp_path / "models.html", ARTIFACTS / "mlflow-demo-models.png")
        assert "vit-demo" in models, models[:2000]
    finally:
        server.stop()


@pytest.mark.long(reason="`vitp demo --quick` at its own sizes (~7 min); the CLI chain runs each stage's "
                         "command")
@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow
def test_a_failed_stage_makes_the_demo_exit_non_zero(demo):
    """Run again on what the first run built, with one of the digits shards broken inside: the
    few-shot probe that reads it fails and says so, the other stages reuse their results, exit
    code 1. (Framed as Parquet, "PAR1" at both ends, the shard passes the driver's check of the
    shards' files, which refuses a file that is not Parquet at all: tests/test_uri_paths.py.)"""
    work, _ = demo
    shard = sorted((work / "shards" / "digits" / "train").glob("*.parquet"))[0]
    shard.write_bytes(b"PAR1" + b"not a parquet file" + b"PAR1")
    r = vitp("demo", "--quick", "--work-dir", str(work), timeout=1500)
    assert r.rc == 1, str(r)
    assert re.search(r"^\[demo\] few-shot FAILED: ", r.out, re.M), str(r)
    assert re.search(r"^FAILED:  few-shot: ", r.out, re.M), str(r)
    assert re.search(r"^  pre-trained\s+0\.\d{3}", r.out, re.M), str(r)  # the rest is still reported
    assert "every stage succeeded" not in r.out
    # ... and `vitp --help` says what that exit code means
    code1 = re.search(r"^  1 (.*?)^  2 ", vitp("--help").out, re.M | re.S).group(1)
    assert "a demo stage failed" in code1, code1


# The same stages at smaller sizes, on the session's Ray: what CI runs of the demo (the CLI chain runs each
# stage's own command)
TINY = [*(f"--pretrain-set={kv}" for kv in (
            "data.synth_classes=10", "data.synth_images_per_class=24", "data.num_classes=10",
            "model.num_classes=10", "parallel.global_batch=32", "parallel.micro_batch=16",
            "optim.warmup_steps=2", "train.steps=10", "train.eval_every=10", "train.checkpoint_every=10")),
        *(f"--finetune-set={kv}" for kv in ("optim.warmup_steps=2", "train.steps=10", "train.eval_every=10"))]


@pytest.mark.e2e
def test_the_demos_stages_report_every_source_and_a_broken_stage(tmp_path, ray_session):
    """`vitp demo --quick` at TINY sizes: every stage runs and the summary, the result file and the
    plots hold both sources, the raw-pixel reference and few-shot; run again with a digits shard
    broken inside, the few-shot stage fails and says so (exit 1) while the others reuse what the
    first run built."""
    from vitp.cli.demo import MODEL_NAME, RESULT_FILE

    work = tmp_path / "work"
    args = ("demo", "--quick", "--work-dir", str(work), "--address", ray_session.get_runtime_context().gcs_address,
            *TINY)
    # the session's Ray asks for a token where ray.init turned token authentication on (its default):
    # the demo joins it as a user does, with the RAY_AUTH_* settings it was started with
    env = {**vitp_env(), **{k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH")}}
    r = ok(vitp(*args, timeout=900, env=env))
    for n, stage in enumerate(("corpus", "pre-training", "reference", "few-shot", "sweep", "results"), 1):
        assert f"[demo] {n}/6 {stage}: " in r.out, (stage, str(r))
    assert "10 fractal classes x 24 images" in r.out  # the changes reached the recipe
    assert "for 10 steps with DeepSpeed" in r.out
    assert (work / "export" / "model.safetensors").is_file()
    table = r.out[r.out.index("== vit-pipeline demo --quick"):]
    for label in ("pre-trained", "scratch", "linear on raw pixels"):
        assert re.search(rf"^  {label}\s+[01]\.\d{{3}}", table, re.M), (label, table)
    assert re.search(r"^pre-training (beat|did NOT beat) training from scratch", table, re.M), table
    assert re.search(r"^few-shot linear probe .* on demo_fractals: 1-shot [01]\.\d+", table, re.M), table
    assert "status:  every stage succeeded" in table
    for png in ("low_data.png", "compare.png"):
        assert f"{work}/{png}" in table and is_png(work / png)
    saved = json.loads((work / RESULT_FILE).read_text())
    assert saved["quick"] and saved["failed"] == []
    assert set(saved["headline"]) == {"pre-trained", "scratch", "linear on raw pixels"}
    for label, group in saved["headline"].items():
        values = r"\s+".join(f"{v:.3f}" for v in group["values"])
        assert re.search(rf"^  {label}\s+{values}\b", table, re.M), (label, group)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parent = next(x for x in runs if x.data.tags.get("kind") == "sweep")
    trials = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == 4, [t.info.run_name for t in trials]  # 2 fractions x 2 sources
    assert client.get_latest_versions(MODEL_NAME), "the pre-trained model is not registered"
    pretrained = [x.info.run_id for x in runs if x.info.run_name.endswith("-synthetic")]  # demo-pico8-synthetic
    assert len(pretrained) == 1, [x.info.run_name for x in runs]

    shard = sorted((work / "shards" / "digits" / "train").glob("*.parquet"))[0]
    shard.write_bytes(b"PAR1" + b"not a parquet file" + b"PAR1")
    again = vitp(*args, timeout=900, env=env)
    assert again.rc == 1, str(again)
    assert re.search(r"^\[demo\] few-shot FAILED: ", again.out, re.M), str(again)
    assert re.search(r"^FAILED:  few-shot: ", again.out, re.M) and "every stage succeeded" not in again.out
    assert re.search(r"^  pre-trained\s+[01]\.\d{3}", again.out, re.M), str(again)  # the rest is still reported
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [x.info.run_id for x in runs if x.info.run_name.endswith("-synthetic")] == pretrained  # reused
    # ... and `vitp --help` says what that exit code means
    code1 = re.search(r"^  1 (.*?)^  2 ", vitp("--help").out, re.M | re.S).group(1)
    assert "a demo stage failed" in code1, code1
