"""`vitp compare` against a real SQLite store and a real `mlflow server`: rows, best trial, filters, formats, plot."""
import csv
import io
import json
import uuid

import pytest
from mlflow.tracking import MlflowClient

from vitp.tracking import PARENT_TAG, RunLogger, TrackingError
from vitp.tracking.compare import (
    COLUMNS,
    best_per_dataset,
    compare_rows,
    format_table,
    sweep_parents,
)
from vitp.tracking.plots import log_plot_to_parent, plot_compare
from vitp.tune.outcome import best_trials

CKPT = "/work/ckpt/pretrain-pico8-synthetic/checkpoint_000003"

# Sweep s1: 2 datasets x {scratch, pre-trained}. On digits the pre-trained trial has the higher peak
# (0.95) but the lower final value, so "best top-1" must be the max of the history, not the last step.
S1_TRIALS = [
    # name,      dataset,   source,    lr,    val/top1 per eval,   status
    ("t-dig-scr", "digits", "scratch", 0.01, [0.50, 0.70, 0.91], "FINISHED"),
    ("t-dig-pre", "digits", CKPT, 0.003, [0.60, 0.95, 0.85], "FINISHED"),
    ("t-c10-scr", "cifar10", "scratch", 0.01, [0.30, 0.45, 0.50], "FINISHED"),
    ("t-c10-pre", "cifar10", CKPT, 0.003, [0.35, 0.40, 0.42], "FAILED"),
]


def _config(dataset, lr, init_from, recipe="finetune_debug"):
    return {"recipe": recipe, "optim": {"lr": lr}, "model": {"variant": "pico/8"},
            "data": {"source": dataset}, "train": {"init_from": init_from}}


def _populate(uri, exp):
    """A pre-training run, sweep s1 (parent + 4 trials), sweep s2 (parent + 1 trial), a few-shot run."""
    ids = {}
    with RunLogger.start(uri, exp, "pretrain-pico8-synthetic",
                         tags={"recipe": "pretrain_debug", "variant": "pico/8", "dataset": "synthetic",
                               "checkpoint": CKPT}) as pre:
        pre.log_params(_config("synthetic", 0.001, "", "pretrain_debug"))
        for step, ips in enumerate([100.0, 120.0, 140.0]):
            pre.log_metrics({"train/loss": 2.0 - step, "perf/images_per_sec": ips}, step=step)
    ids["pretrain"] = pre.run_id

    common = {"recipe": "finetune_debug", "variant": "pico/8", "source_run_id": pre.run_id}
    with RunLogger.start(uri, exp, "sweep-s1", tags={**common, "sweep": "s1"}) as parent:
        for name, dataset, source, lr, top1, status in S1_TRIALS:
            child = RunLogger.start(uri, exp, name, parent_run_id=parent.run_id, resume_by_name=False,
                                    tags={**common, "sweep": "s1", "dataset": dataset, "source": source})
            child.log_params(_config(dataset, lr, "" if source == "scratch" else source))
            for i, v in enumerate(top1):
                child.log_metrics({"val/top1": v, "val/loss": 1 - v,
                                   "perf/images_per_sec": 50.0 + 10 * i}, step=(i + 1) * 10)
            child.end(status)
            ids[name] = child.run_id
        parent.log_metrics({"best/digits/val_top1": 0.95, "best/cifar10/val_top1": 0.50}, step=0)
        parent.set_tags({"best_trial/digits": ids["t-dig-pre"], "best_trial/cifar10": ids["t-c10-scr"]})
    ids["s1"] = parent.run_id

    with RunLogger.start(uri, exp, "sweep-s2", tags={**common, "sweep": "s2"}) as parent2:
        with RunLogger.start(uri, exp, "t-dig-s2", parent_run_id=parent2.run_id, resume_by_name=False,
                             tags={**common, "sweep": "s2", "dataset": "digits", "source": CKPT}) as c:
            c.log_params(_config("digits", 0.03, CKPT))
            c.log_metrics({"val/top1": 0.97}, step=10)
    ids["s2"], ids["t-dig-s2"] = parent2.run_id, c.run_id

    with RunLogger.start(uri, exp, "fewshot-pico8", tags={"recipe": "fewshot", "variant": "pico/8",
                                                          "dataset": "digits", "source": CKPT}) as fs:
        fs.log_metrics({"fewshot/5shot_top1": 0.62, "fewshot/10shot_top1": 0.71,
                        "fewshot/25shot_top1": 0.8}, step=0)
    ids["fewshot"] = fs.run_id
    return ids


@pytest.fixture(scope="module", params=["sqlite", "server"])
def store(request):
    """(tracking uri, experiment, {name: run id}): populated once per store, read by every test."""
    uri = request.getfixturevalue("sqlite_uri" if request.param == "sqlite" else "mlflow_server")
    uri = getattr(uri, "uri", uri)
    exp = f"compare-{uuid.uuid4().hex[:8]}"
    return uri, exp, _populate(uri, exp)


@pytest.mark.long_cases("server",
                        reason="a sweep beyond CI's (the CLI chain's, the rehearsal's, the ASHA, Optuna and "
                               "PBT ones)")
def test_sweep_table_lists_trials_and_the_best_trial_per_dataset(store):
    uri, exp, ids = store
    rows = compare_rows(uri, exp, sweep="s1")
    by_name = {r["run_name"]: r for r in rows}
    assert sorted(by_name) == sorted(t[0] for t in S1_TRIALS)  # no parent, no other sweep
    # params (for --seeds), the start/end times (for the search's best so far) and the experiment's
    # id (MLflow's compare page) are not columns
    assert all(set(r) == {*COLUMNS, "params", "start_time", "end_time", "experiment_id"} for r in rows)

    pre = by_name["t-dig-pre"]
    assert pre["best_top1"] == pytest.approx(0.95) and pre["final_top1"] == pytest.approx(0.85)
    assert pre["lr"] == pytest.approx(0.003) and pre["source"] == CKPT
    assert (pre["recipe"], pre["variant"], pre["dataset"]) == ("finetune_debug", "pico/8", "digits")
    assert pre["images_per_sec"] == pytest.approx(60.0)  # mean of 50, 60, 70
    assert pre["parent"] == ids["s1"] and pre["sweep"] == "s1" and pre["experiment"] == exp
    assert pre["run_id"] == ids["t-dig-pre"] and pre["status"] == "FINISHED"
    assert pre["wall_time_s"] is not None and 0 <= pre["wall_time_s"] < 120
    assert by_name["t-dig-scr"]["source"] == "scratch" and by_name["t-c10-pre"]["status"] == "FAILED"

    # The best trial per dataset is by peak, not final, top-1; the FAILED trial is not a candidate.
    best = best_per_dataset(rows)
    assert {d: r["run_id"] for d, r in best.items()} == {"digits": ids["t-dig-pre"], "cifar10": ids["t-c10-scr"]}
    # The rule a sweep uses to record its best trials on the parent gives the same answer.
    recorded = best_trials(uri, exp, ids["s1"])
    assert {d: b["run_id"] for d, b in recorded.items()} == {d: r["run_id"] for d, r in best.items()}
    assert recorded["digits"]["top1"] == pytest.approx(0.95)
    assert sweep_parents(rows) == [ids["s1"]]

    # Text: sorted by dataset then best top-1 descending; exactly the winners carry the `*`.
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["dataset", "recipe", "variant"] and set(lines[1]) <= {"-", " "}
    body = lines[2:]
    order = [next(n for n in by_name if n in line) for line in body]
    assert order == ["t-c10-scr", "t-c10-pre", "t-dig-pre", "t-dig-scr"]
    starred = sorted(o for o, line in zip(order, body) if line.startswith("*"))
    assert starred == ["t-c10-scr", "t-dig-pre"]
    assert "0.9500" in body[2] and "0.8500" in body[2] and "FAILED" in body[1]
    assert "5-shot" not in lines[0]  # no trial logged few-shot numbers: no empty columns


def test_ties_and_min_mode_agree_between_the_sweep_parent_and_compare(sqlite_uri):
    """Equal peaks go to the run name that sorts first, whatever order the runs were made in; for a
    "min" metric the lowest value over the history wins. compare and the sweep's rule agree."""
    exp = f"ties-{uuid.uuid4().hex[:8]}"
    with RunLogger.start(sqlite_uri, exp, "sweep-tie", tags={"sweep": "tie"}) as parent:
        # made newest-last: "t-b" is returned first by a newest-first search; both peak at 0.9
        for name, top1 in [("t-c", [0.95]), ("t-a", [0.5, 0.9]), ("t-b", [0.9, 0.8])]:
            child = RunLogger.start(sqlite_uri, exp, name, parent_run_id=parent.run_id, resume_by_name=False,
                                    tags={"sweep": "tie", "dataset": "digits"})
            for i, v in enumerate(top1):
                child.log_metrics({"val/top1": v, "val/loss": 1.0 - v + 0.01 * (name == "t-b")}, step=i)
            child.end("FAILED" if name == "t-c" else "FINISHED")
    rows = compare_rows(sqlite_uri, exp, sweep="tie")
    for order in (rows, rows[::-1]):
        assert best_per_dataset(order)["digits"]["run_name"] == "t-a"
    assert best_trials(sqlite_uri, exp, parent.run_id)["digits"]["run_name"] == "t-a"
    low = best_trials(sqlite_uri, exp, parent.run_id, metric="val/loss", mode="min")["digits"]
    assert low["run_name"] == "t-a" and low["top1"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="mode"):
        best_per_dataset(rows, mode="best")


def test_filters_by_experiment_sweep_tag_and_filter_string(store):
    uri, exp, ids = store
    names = lambda rows: sorted(r["run_name"] for r in rows)  # noqa: E731
    everything = compare_rows(uri, exp)
    assert names(everything) == sorted(
        ["pretrain-pico8-synthetic", "fewshot-pico8", "t-dig-s2", *(t[0] for t in S1_TRIALS)])
    # Without the sweep filter, sweep s2's trial is the best on digits.
    assert best_per_dataset(everything)["digits"]["run_id"] == ids["t-dig-s2"]
    with_parents = compare_rows(uri, exp, include_parents=True)
    assert {"sweep-s1", "sweep-s2"} <= set(names(with_parents))
    assert next(r for r in with_parents if r["run_id"] == ids["s1"])["parent"] is None

    assert names(compare_rows(uri, exp, sweep="s2")) == ["t-dig-s2"]
    assert names(compare_rows(uri, exp, sweep="s1", tags={"dataset": "cifar10"})) == ["t-c10-pre", "t-c10-scr"]
    assert names(compare_rows(uri, exp, tags={"source": CKPT, "dataset": "digits"})) == [
        "fewshot-pico8", "t-dig-pre", "t-dig-s2"]
    assert names(compare_rows(uri, exp, filter_string="params.`optim.lr` = '0.003'")) == [
        "t-c10-pre", "t-dig-pre"]
    assert names(compare_rows(uri, exp, filter_string="attributes.status = 'FAILED'")) == ["t-c10-pre"]

    # Pre-training and few-shot runs fill the columns they have.
    pre = next(r for r in everything if r["run_id"] == ids["pretrain"])
    assert pre["images_per_sec"] == pytest.approx(120.0) and pre["best_top1"] is None
    assert pre["source"] == "scratch" and pre["dataset"] == "synthetic"
    fs = next(r for r in everything if r["run_id"] == ids["fewshot"])
    assert (fs["fewshot_5"], fs["fewshot_10"], fs["fewshot_25"], fs["fewshot_1"]) == (0.62, 0.71, 0.8, None)
    assert "5-shot" in format_table(everything).splitlines()[0]

    # experiment=None searches every experiment in the store.
    assert set(ids.values()) <= {r["run_id"] for r in compare_rows(uri, None, include_parents=True)}
    assert compare_rows(uri, exp, sweep="no-such-sweep") == []
    assert "no runs match" in format_table([])
    with pytest.raises(TrackingError, match="'no-such-exp' not found.*--experiment"):
        compare_rows(uri, "no-such-exp")


def test_csv_and_json_parse_back(store):
    uri, exp, ids = store
    rows = compare_rows(uri, exp)
    parsed = json.loads(format_table(rows, "json"))
    assert {r["run_id"] for r in parsed} == {r["run_id"] for r in rows}
    assert list(parsed[0]) == ["best", *COLUMNS]
    by_id = {r["run_id"]: r for r in parsed}
    assert by_id[ids["t-dig-pre"]]["best_top1"] == pytest.approx(0.95)
    assert by_id[ids["t-dig-pre"]]["lr"] == pytest.approx(0.003)
    assert {r["run_id"] for r in parsed if r["best"]} == {ids["t-dig-s2"], ids["t-c10-scr"]}

    table = list(csv.DictReader(io.StringIO(format_table(rows, "csv"))))
    assert [r["run_id"] for r in table] == [r["run_id"] for r in parsed]  # same order as JSON
    c = {r["run_id"]: r for r in table}
    assert float(c[ids["t-dig-scr"]]["final_top1"]) == pytest.approx(0.91)
    assert c[ids["t-dig-scr"]]["parent"] == ids["s1"] and c[ids["pretrain"]]["parent"] == ""
    assert c[ids["t-dig-pre"]]["source"] == CKPT  # full path in CSV, clipped only in text
    assert [r["run_id"] for r in table if r["best"] == "*"] == [ids["t-c10-scr"], ids["t-dig-s2"]]
    with pytest.raises(TrackingError, match="'yaml'.*text, csv or json"):
        format_table(rows, "yaml")


def test_plot_is_written_and_logged_to_the_sweep_parent(store, tmp_path):
    uri, exp, ids = store
    rows = compare_rows(uri, exp, sweep="s1")
    out = plot_compare(uri, rows, tmp_path / "plots" / "compare.png")
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

    (parent,) = sweep_parents(rows)
    assert log_plot_to_parent(uri, parent, out) == "compare/compare.png"
    client = MlflowClient(uri)
    assert [a.path for a in client.list_artifacts(parent, "compare")] == ["compare/compare.png"]
    fetched = client.download_artifacts(parent, "compare/compare.png", str(tmp_path / "dl"))
    assert open(fetched, "rb").read() == data
    assert client.get_run(ids["t-dig-pre"]).data.tags[PARENT_TAG] == parent

    with pytest.raises(TrackingError, match="parent run 'nope' not found"):
        log_plot_to_parent(uri, "nope", out)
    # No curves at all still gives a (placeholder) PNG rather than an error.
    empty = plot_compare(uri, compare_rows(uri, exp, tags={"recipe": "fewshot"}), tmp_path / "e.png")
    assert open(empty, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_seeds_aggregate_to_one_row_per_configuration(sqlite_uri, experiment):
    """Three seeds of two sources and a KILLED (pruned) run: one row per configuration, its values
    in seed order, mean and sample std of the best top-1s; the KILLED run is not counted."""
    import statistics

    from vitp.tracking.seeds import aggregate_rows, format_aggregate

    peaks = {("scratch", 0): 0.31, ("scratch", 1): 0.27, ("scratch", 2): 0.35,
             (CKPT, 0): 0.52, (CKPT, 1): 0.61, (CKPT, 2): 0.49}
    for (source, seed), peak in peaks.items():
        with RunLogger.start(sqlite_uri, experiment, f"t-{source[-3:]}-{seed}", resume_by_name=False,
                             tags={"recipe": "demo_fractals", "dataset": "synthetic-seed1",
                                   "train_fraction": "0.2", "source": source}) as run:
            run.log_params({"train": {"seed": seed}, "optim": {"lr": 0.03}})
            run.log_metrics({"val/top1": peak - 0.1}, step=50)
            run.log_metrics({"val/top1": peak}, step=100)
    pruned = RunLogger.start(sqlite_uri, experiment, "t-pruned", resume_by_name=False,
                             tags={"recipe": "demo_fractals", "dataset": "synthetic-seed1",
                                   "train_fraction": "0.2", "source": "scratch"})
    pruned.log_params({"train": {"seed": 3}, "optim": {"lr": 0.03}})
    pruned.log_metrics({"val/top1": 0.99}, step=50)
    pruned.end("KILLED")

    groups = aggregate_rows(compare_rows(sqlite_uri, experiment))
    assert len(groups) == 2
    by_source = {g["source"]: g for g in groups}
    for source in ("scratch", CKPT):
        g = by_source[source]
        want = [peaks[(source, s)] for s in range(3)]
        assert g["seeds"] == [0, 1, 2] and g["values"] == pytest.approx(want)
        assert g["mean"] == pytest.approx(statistics.mean(want))
        assert g["std"] == pytest.approx(statistics.stdev(want))
        assert (g["min"], g["max"], g["n"]) == (pytest.approx(min(want)), pytest.approx(max(want)), 3)
        assert g["train_fraction"] == pytest.approx(0.2)
    assert [g["source"] for g in groups] == [CKPT, "scratch"]  # best mean first

    text = format_aggregate(groups)
    assert f"{statistics.mean(peaks[(CKPT, s)] for s in range(3)):.3f} +- " in text and "0.990" not in text
    parsed = list(csv.DictReader(io.StringIO(format_aggregate(groups, "csv"))))
    assert [float(v) for v in parsed[0]["values"].split()] == pytest.approx([0.52, 0.61, 0.49])
    assert json.loads(format_aggregate(groups, "json"))[1]["seeds"] == [0, 1, 2]


def test_seeds_of_a_sweep_with_another_axis_are_one_row_per_value_of_it(sqlite_uri, experiment):
    """A sweep over train.augreg x train.seed: one row per augreg value (its "setting"), not one row
    for all of them; tracking.* and train.seed, which differ per run by construction, split nothing."""
    from vitp.tracking.seeds import aggregate_rows, format_aggregate

    for augreg, base in (("none", 0.2), ("medium2", 0.4)):
        for seed in range(3):
            with RunLogger.start(sqlite_uri, experiment, f"s-{augreg}-{seed}", resume_by_name=False,
                                 tags={"recipe": "demo_fractals", "dataset": "synthetic-seed1", "source": "scratch"}) as run:
                run.log_params({"train": {"seed": seed, "augreg": augreg}, "optim": {"lr": 0.03},
                                "tracking": {"run_name": f"s-{augreg}-{seed}"}})
                run.log_metrics({"val/top1": base + seed / 100}, step=10)
    groups = aggregate_rows(compare_rows(sqlite_uri, experiment))
    assert [(g["setting"], g["n"]) for g in groups] == [("augreg=medium2", 3), ("augreg=none", 3)]
    assert groups[0]["values"] == pytest.approx([0.40, 0.41, 0.42])
    text = format_aggregate(groups)
    assert "setting" in text.splitlines()[0] and "augreg=none" in text
