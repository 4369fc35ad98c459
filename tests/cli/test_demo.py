"""The demo's bookkeeping without running it: stages record failures (required ones stop the
demo), the verdict pairs seeds, the summary prints every seed and says what failed."""
import re

import pytest

from vitp.cli.demo import Stages, _points, SEEDS, MAIN
from vitp.cli.demo_report import print_summary, verdict


def test_a_failed_stage_is_recorded_and_the_rest_go_on():
    lines = []
    stages = Stages(3, lines.append)
    assert stages.run("a", "first", lambda: 7) == 7

    def broken():
        raise ValueError("shard 3 of digits: checksum mismatch\nre-run vitp preprocess")

    assert stages.run("b", "second", broken) is None
    with pytest.raises(RuntimeError):
        stages.run("c", "third", lambda: (_ for _ in ()).throw(RuntimeError("no cluster")), required=True)
    assert stages.failed == ["b: ValueError: re-run vitp preprocess", "c: RuntimeError: no cluster"]
    assert set(stages.timings) == {"a", "b", "c"}
    assert "[demo] 2/3 b: second" in lines and "[demo] b FAILED: ValueError: re-run vitp preprocess" in lines


def test_points_hold_the_headline_in_every_seed_and_the_curve_once():
    pts = _points(seed=4, quick=False)
    recipe, fraction = MAIN
    head = [p for p in pts if (p["recipe"], p["data.train_fraction"]) == MAIN]
    assert [p["train.seed"] for p in head] == list(range(4, 4 + SEEDS))
    assert {p["data.train_fraction"] for p in pts if p["recipe"] == recipe} == {0.05, 0.2, 1.0}
    assert len(pts) == SEEDS + 2
    quick = _points(seed=0, quick=True)
    assert {p["data.train_fraction"] for p in quick} == {0.2, 1.0}


def _group(source, values):
    return {"recipe": "demo_fractals", "train_fraction": 0.2, "source": source, "dataset": "d", "lr": 0.03,
            "n": len(values), "seeds": list(range(len(values))), "values": values,
            "mean": sum(values) / len(values), "std": 0.0, "min": min(values), "max": max(values)}


def test_verdict_needs_the_margin_in_every_seed():
    main = {"pre-trained": _group("pre-trained", [0.50, 0.48, 0.47]),
            "scratch": _group("scratch", [0.30, 0.40, 0.41])}
    v = verdict(main, 0.05)
    assert v["margins"] == pytest.approx([0.20, 0.08, 0.06]) and v["holds"]
    main["scratch"]["values"][2] = 0.43  # one seed by 4 points only
    assert not verdict(main, 0.05)["holds"]
    assert verdict({"scratch": main["scratch"]}, 0.05)["holds"] is False


def test_summary_prints_every_seed_the_failures_and_the_ui_command():
    class Cfg:  # the two fields the headline names
        class data:
            num_classes = 10

        class train:
            steps = 200

    groups = [_group("pre-trained", [0.50, 0.48, 0.47]), _group("scratch", [0.30, 0.33, 0.29]),
              _group("linear on raw pixels", [0.25])]
    out = []
    result = {"seed": 0, "sweep_name": "demo", "groups": groups, "plots": ["/w/low_data.png"], "tracking_uri": "sqlite:////w/m.db",
              "experiment": "vit-pipeline-demo", "ui_url": "http://h:5000/#/experiments/3/runs", "seconds": 301.0, "timings": {"corpus": 20.0},
              "failed": ["few-shot: InputError: no shards"],
              "fewshot": {"demo_fractals": {"fewshot/5shot_top1": 0.61}}}
    v = print_summary(result, main=("demo_fractals", 0.2), margin=0.05, quick=False, main_cfg=Cfg, out=out.append)
    text = "\n".join(out)
    assert v["holds"] and re.search(r"pre-trained\s+0\.500\s+0\.480\s+0\.470\s+0\.483", text)
    assert re.search(r"margin \(points\)\s+\+20\.0\s+\+15\.0\s+\+18\.0", text)
    assert "linear on raw pixels" in text and "5-shot 0.610" in text
    assert "mlflow ui --backend-store-uri sqlite:////w/m.db --host h --port 5000" in text and "http://h:5000/#/experiments/3/runs" in text and "/w/low_data.png" in text
    assert "FAILED:  few-shot: InputError: no shards" in text and "every stage succeeded" not in text
