"""Deletes the user did not mean: `vitp synth --overwrite` and `vitp demo --fresh` remove what vitp
wrote there and nothing else; a folder holding anything else is refused whole, and `--fresh` empties
only a work dir the demo marked as its own when it made it (the bad-input table has the CLI lines: a
home directory named as --out / --work-dir, a real run's work dir as --work-dir)."""
import json
import os

import pytest

from vitp import storage
from vitp.cli.demo import claim_work_dir, made_by_demo
from vitp.errors import InputError
from vitp.data.commands import check_synth_output
from vitp.data.synth import class_name, foreign_files
from vitp.recipes import resolve
from vitp.config import Run


def _corpus(root, classes=2, images=3):
    """A corpus laid out as the renderer writes it (the bytes do not matter here)."""
    for c in range(classes):
        (root / class_name(c)).mkdir(parents=True)
        for i in range(images):
            (root / class_name(c) / f"{i:06d}.png").write_bytes(b"png")
    return root


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_an_earlier_corpus_may_be_replaced_but_not_a_folder_with_a_file_of_anyone_elses(tmp_path):
    cfg = resolve("debug", [f"work_dir={tmp_path}"], check_paths=False)
    out = _corpus(tmp_path / "corpus")
    assert foreign_files(str(out)) == []
    with pytest.raises(FileExistsError, match="not empty; pass --overwrite"):
        check_synth_output(Run.of(cfg), str(out))
    assert check_synth_output(Run.of(cfg), str(out), overwrite=True) == str(out)
    # one file of the user's inside a class folder, one beside them, an empty folder of theirs
    (out / class_name(1) / "keep.txt").write_text("mine")
    (out / "notes.md").write_text("mine")
    (out / "photos").mkdir()
    before = _tree(out)
    assert sorted(foreign_files(str(out))) == sorted(["fractal_00001/keep.txt", "notes.md", "photos"])
    with pytest.raises(FileExistsError, match="holds files vitp synth did not write"):
        check_synth_output(Run.of(cfg), str(out), overwrite=True)
    assert _tree(out) == before


def _paths(work):
    return Run.of(resolve("debug", [f"work_dir={work}"], check_paths=False)).paths


def _fill_as_a_demo_does(work):
    """What a demo (or `vitp pretrain` with this work_dir: the same names) writes there."""
    for name in ("runs/demo-run", "shards/synthetic", "mlartifacts/1", "sweeps/demo"):
        (work / name).mkdir(parents=True)
    (work / "runs" / "demo-run" / "meta.json").write_text("{}")
    (work / "mlflow.db").write_bytes(b"db")
    (work / "demo-result.json").write_text("{}")


def test_the_demo_marks_a_work_dir_it_makes_first_and_fresh_empties_only_that(tmp_path):
    work, lines = tmp_path / "demo", []
    claim_work_dir("work", _paths(work), fresh=False, log=lines.append)  # new: marked before anything else
    assert _tree(work) == [".vitp-demo"] and json.loads((work / ".vitp-demo").read_text())["made_by"] == "vitp demo"
    _fill_as_a_demo_does(work)
    claim_work_dir("work", _paths(work), fresh=False, log=lines.append)  # a re-run reuses it
    assert ".vitp-demo" in _tree(work) and "runs/demo-run/meta.json" in _tree(work) and lines == []
    claim_work_dir("work", _paths(work), fresh=True, log=lines.append)
    assert work.is_dir() and _tree(work) == [".vitp-demo"] and "--fresh: removing" in lines[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_work_dir("empty", _paths(empty), fresh=True, log=lines.append)  # empty: the demo's from now on
    assert _tree(empty) == [".vitp-demo"] and len(lines) == 1


def test_fresh_refuses_a_work_dir_holding_the_demos_names_that_the_demo_did_not_make(tmp_path):
    """`vitp pretrain`'s work dir (or a demo's from before the marker) has exactly the names a demo
    writes: without the marker --fresh deletes none of it, and a plain run does not mark it."""
    work, lines = tmp_path / "work", []
    _fill_as_a_demo_does(work)
    before = _tree(work)
    with pytest.raises(InputError, match=r"^--work-dir work: not made by vitp demo \(no \.vitp-demo file in it\)"):
        claim_work_dir("work", _paths(work), fresh=True, log=lines.append)
    assert _tree(work) == before
    claim_work_dir("work", _paths(work), fresh=False, log=lines.append)  # used, never marked
    assert _tree(work) == before and "not made by vitp demo" in lines[0]


@pytest.mark.parametrize("marker", ["link", "folder", "other json", "not json", "too large"])
def test_only_the_demos_own_marker_file_counts(tmp_path, marker):
    work = tmp_path / "work"
    _fill_as_a_demo_does(work)
    path, real = work / ".vitp-demo", tmp_path / "elsewhere"
    real.write_text(json.dumps({"made_by": "vitp demo"}))
    if marker == "link":
        path.symlink_to(real)
    elif marker == "folder":
        path.mkdir()
    else:
        path.write_text({"other json": '{"made_by": "someone"}', "not json": "vitp demo",
                         "too large": json.dumps({"made_by": "vitp demo", "pad": "x" * 5000})}[marker])
    before = _tree(work)
    assert not made_by_demo(_paths(work))
    with pytest.raises(InputError, match="not made by vitp demo"):
        claim_work_dir("work", _paths(work), fresh=True, log=print)
    assert _tree(work) == before and real.exists()


def test_a_marked_work_dir_holding_something_else_is_still_refused(tmp_path):
    work = tmp_path / "demo"
    claim_work_dir("demo", _paths(work), fresh=False, log=print)
    _fill_as_a_demo_does(work)
    (work / "notes.txt").write_text("mine")
    before = _tree(work)
    with pytest.raises(InputError, match=r"holds files a demo did not write \(notes.txt\)"):
        claim_work_dir("demo", _paths(work), fresh=True, log=print)
    assert _tree(work) == before


def test_a_work_dir_on_object_storage_is_marked_and_emptied_by_the_same_rule(s3):
    bucket = s3.bucket()
    work, other = storage.join(bucket, "demo"), storage.join(bucket, "work")
    claim_work_dir(work, _paths(work), fresh=False, log=print)
    assert storage.listdir(work) == [".vitp-demo"]
    for root in (work, other):
        for name in ("runs/r/meta.json", "shards/s/part-0.parquet", "demo-result.json"):
            storage.write_bytes(storage.join(root, name), b"x")
    with pytest.raises(InputError, match="not made by vitp demo"):
        claim_work_dir(other, _paths(other), fresh=True, log=print)
    assert storage.listdir(other) == ["demo-result.json", "runs", "shards"]
    claim_work_dir(work, _paths(work), fresh=True, log=print)
    assert storage.listdir(work) == [".vitp-demo"]
