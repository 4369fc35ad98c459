"""Deletes the user did not mean: `vitp synth --overwrite` and `vitp demo --fresh` remove what vitp
wrote there and nothing else; a folder holding anything else is refused whole (the bad-input table
has the CLI lines: a home directory named as --out / --work-dir)."""
import pytest

from vitp.cli.demo import _start_afresh
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


def test_fresh_removes_a_demos_own_entries_and_keeps_the_folder(tmp_path):
    work = tmp_path / "demo"
    for name in ("runs/demo-run", "shards/synthetic", "mlartifacts/1", "sweeps/demo"):
        (work / name).mkdir(parents=True)
    (work / "mlflow.db").write_bytes(b"db")
    (work / "demo-result.json").write_text("{}")
    lines = []
    _start_afresh("work", Run.of(resolve("debug", [f"work_dir={work}"])).paths, lines.append)
    assert work.is_dir() and _tree(work) == [] and "--fresh: removing" in lines[0]
    _start_afresh("never-made", Run.of(resolve("debug", [f"work_dir={tmp_path / 'never-made'}"])).paths,
                  lines.append)  # nothing there: nothing to do
    assert len(lines) == 1
