"""Dataset files from strangers: hostile labels, oversize members and files, list rows and
symlinks that lead out of the corpus. Each is listed and read in this process (the functions
Ray's listing and shard tasks call) and must be quarantined with its reason, nothing outside the
root opened; one run through Ray shows a hostile WebDataset shard quarantined, not raised."""
import csv
import io
import json
import os
import re
import sys
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vitp.data import bounds, catalog, files, sources
from vitp.data.commands import run_preprocess
from vitp.data.decode import max_file_bytes
from vitp.data.rows import process_rows
from vitp.errors import InputError
from vitp.config import Run

from .conftest import make_cfg, save

MAX_PIXELS = 1000  # images above max_file_bytes(1000), about 16.8 MB, are refused unread
BIG = 64 << 20  # a sparse file or tar member over that limit (no disk used)

# Paths opened or listed while `_RECORD` is on (audit events: open, os.open, scandir, listdir);
# pyarrow's own reads are C++ and do not show, so the checks below use local files.
_RECORD: list = []
_ON = [False]


def _audit(event, args):
    if _ON[0] and event in ("open", "os.scandir", "os.listdir") and args and isinstance(args[0], (str, bytes)):
        _RECORD.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def opened():
    """The paths opened or listed during the test (from the moment the fixture starts)."""
    _RECORD.clear()
    _ON[0] = True
    yield _RECORD
    _ON[0] = False


def touched(paths, outside):
    out = os.path.realpath(outside)
    return [p for p in paths if os.path.realpath(p) == out or os.path.realpath(p).startswith(out + os.sep)]


def png(color=(200, 0, 0), size=(12, 10)):
    b = io.BytesIO()
    Image.new("RGB", size, color).save(b, "PNG")
    return b.getvalue()


def add(tf, name, payload):
    ti = tarfile.TarInfo(name)
    ti.size = len(payload)
    tf.addfile(ti, io.BytesIO(payload))


def rows_of(items):
    """Listed items -> what process_rows gets from the shard grouping."""
    return pa.Table.from_pylist([{**it, "h": 0, "group": "train/part-00000"} for it in items])


def processed(items, num_classes=10):
    t = process_rows(rows_of(items), size=8, storage_format="uint8", jpeg_quality=95,
                     max_pixels=MAX_PIXELS, num_classes=num_classes, synth_seed=0)
    return {r["key"]: (r["reason"], r["detail"]) for r in t.to_pylist()}


# ---------------------------------------------------------------------------- labels


@pytest.mark.timeout(120)
def test_webdataset_labels_are_parsed_bounded_and_quarantined(tmp_path, monkeypatch):
    wds = tmp_path / "wds"
    wds.mkdir()
    labels = {"a": b"0", "b": b" 2\n", "huge": b"999999999999", "sup": "\u00b2".encode(),
              "digits": b"9" * 5000, "neg": b"-1", "binary": b"\xff\xfe", "cap": str(bounds.MAX_CLASSES).encode(),
              "wide": b"1" + b" " * (1 << 20)}  # a label padded to a megabyte: never read
    with tarfile.open(wds / "shard-000.tar", "w") as tf:
        for key, cls in labels.items():
            add(tf, f"{key}.png", png())
            add(tf, f"{key}.cls", cls)
    read = []
    real_extract = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile",
                        lambda self, m: read.append(getattr(m, "name", m)) or real_extract(self, m))

    lst = catalog.list_source("webdataset", str(wds))
    by = {it["key"].split("/")[-1]: it for it in lst.items}
    assert lst.classes == ["0", "1", "2"]  # from the good labels only: no 10**12 class names
    assert (by["a"]["label"], by["b"]["label"]) == (0, 2) and not by["a"]["error"] and not by["b"]["error"]
    tar = str(wds / "shard-000.tar")
    for key, says in (("huge", "label 999999999999, above the largest class index allowed (999999)"),
                      ("cap", f"label {bounds.MAX_CLASSES}, above"), ("sup", "holds '\u00b2', not a class index"),
                      ("neg", "holds '-1', not a class index"), ("binary", "not a class index"),
                      ("digits", "holds 5000 bytes, more than a class index takes (64)"),
                      ("wide", f"holds {(1 << 20) + 1} bytes")):
        err = by[key]["error"]
        assert err.startswith("bad_label: ") and says in err and f"{key}.cls in {tar}" in err, (key, err)
        assert "fix the label" in err and by[key]["raw_label"] == "" and by[key]["label"] == -1
    assert "digits.cls" not in read and "wide.cls" not in read and "a.cls" in read  # checked from the header
    # quarantined as bad_label before any image is read
    assert {k: r for k, (r, _) in processed(lst.items).items() if r} == {
        f"shard-000.tar/{k}": "bad_label" for k in ("huge", "cap", "sup", "neg", "binary", "digits", "wide")}


def test_range_classes_stop_at_num_classes_and_the_cap():
    assert sources.classes_from_labels({"0", "5000"}, "range", 10) == [str(i) for i in range(10)]
    assert sources.classes_from_labels({"0", "2"}, "range", 10) == ["0", "1", "2"]
    assert sources.classes_from_labels({"0", str(bounds.MAX_CLASSES), "\u00b2"}, "range") == ["0"]


def test_parquet_and_csv_labels_are_bounded(tmp_path):
    long = "x" * (bounds.LABEL_CHARS + 1)
    pq.write_table(pa.table({"image": [png(), png()], "label": ["cat", long]}), tmp_path / "in.parquet")
    lst = catalog.list_source("parquet", str(tmp_path / "in.parquet"))
    assert lst.classes == ["cat"]
    assert lst.items[1]["error"].startswith("bad_label: row 1 of ") and "257 characters" in lst.items[1]["error"]
    (tmp_path / "a.png").write_bytes(png())
    with open(tmp_path / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label"), ("a.png", "cat"), ("a.png", long)])
    lst = catalog.list_source("csv", str(tmp_path / "labels.csv"))
    assert lst.classes == ["cat"] and "line 3 of " in lst.items[1]["error"]


# ------------------------------------------------------------------------------ reads


def test_a_parquet_row_group_too_large_to_read_at_once_is_quarantined_from_its_footer(tmp_path, monkeypatch):
    """Row groups are decompressed whole by the task that decodes them: one whose image column is
    larger than the bound (lowered here, the file is real) has its rows quarantined at listing,
    and the images are never read; a struct column's leaves ({bytes, path}) all count."""
    small, big = png(size=(4, 4)), png(size=(64, 64))
    structs = [{"bytes": b, "path": "x.png"} for b in (small, small, big, big)]
    pq.write_table(pa.table({"image": structs, "label": ["a", "a", "b", "b"]}), tmp_path / "in.parquet",
                   row_group_size=2)
    groups = [pq.ParquetFile(tmp_path / "in.parquet").metadata.row_group(g) for g in range(2)]
    sizes = [sum(g.column(i).total_uncompressed_size for i in range(g.num_columns)
                 if g.column(i).path_in_schema.startswith("image")) for g in groups]
    monkeypatch.setattr(bounds, "PARQUET_GROUP_BYTES", (sizes[0] + sizes[1]) // 2)
    items = catalog.list_source("parquet", str(tmp_path / "in.parquet")).items
    assert [bool(it["error"]) for it in items] == [False, False, True, True]
    assert items[2]["error"].startswith("too_large: row group 1 of ") and f"{sizes[1]} bytes" in items[2]["error"]
    out = processed(items)
    assert [out[it["key"]][0] for it in items] == ["", "", "too_large", "too_large"]


def sparse_tar(path, big_name, size, then=()):
    """A tar whose first member claims `size` bytes held in a hole (no disk used), then `then`."""
    with open(path, "wb") as f:
        ti = tarfile.TarInfo(big_name)
        ti.size = size
        f.write(ti.tobuf(format=tarfile.USTAR_FORMAT))
        f.seek(-(-size // 512) * 512, 1)
        for name, payload in then:
            t = tarfile.TarInfo(name)
            t.size = len(payload)
            f.write(t.tobuf(format=tarfile.USTAR_FORMAT) + payload + b"\0" * (-len(payload) % 512))
        f.write(b"\0" * 1024)


@pytest.mark.timeout(120)
def test_image_bytes_are_bounded_before_reading(tmp_path):
    assert max_file_bytes(MAX_PIXELS) < BIG
    root = tmp_path / "corpus"
    root.mkdir()
    sparse_tar(root / "s.tar", "big.png", BIG, [("big.cls", b"0"), ("ok.png", png()), ("ok.cls", b"1")])
    lst = catalog.list_source("webdataset", str(root))
    assert [it["length"] for it in lst.items] == [BIG, len(png())]
    got = processed(lst.items)
    assert got["s.tar/ok"] == ("", "")
    reason, detail = got["s.tar/big"]
    assert reason == "too_large" and f"{BIG} bytes, more than the {max_file_bytes(MAX_PIXELS)} allowed" in detail
    assert "raise max_pixels if genuine" in detail

    (root / "big.png").open("wb").truncate(BIG)  # a sparse local file
    os.mkfifo(root / "pipe.png")  # a plain open() of a FIFO waits for a writer forever
    items = [sources.item("big.png", 0, path=str(root / "big.png")), sources.item("pipe.png", 0, path=str(root / "pipe.png"))]
    got = processed(items)
    assert got["big.png"][0] == "too_large" and f"{BIG} bytes" in got["big.png"][1]
    assert got["pipe.png"][0] == "unreadable" and "not a regular file" in got["pipe.png"][1]


def test_metadata_reads_are_bounded_and_one_line(tmp_path, monkeypatch):
    (tmp_path / "labels.csv").write_text("path,label\n" + "a.png,0\n" * 200)
    monkeypatch.setattr(files, "METADATA_BYTES", 1000)
    with pytest.raises(InputError, match=r"labels.csv: \d+ bytes, more than the 1000 allowed for a dataset's metadata"):
        catalog.list_source("csv", str(tmp_path / "labels.csv"))
    monkeypatch.undo()
    (tmp_path / "latin1.csv").write_bytes(b"path,label\n\xe9t\xe9.png,0\n")
    with pytest.raises(InputError, match="latin1.csv: not a UTF-8 CSV with columns path,label"):
        catalog.list_source("csv", str(tmp_path / "latin1.csv"))
    (tmp_path / "wide.csv").write_text("path,label\n" + "x" * 200_000 + ",0\n")
    with pytest.raises(InputError, match="wide.csv: not a UTF-8 CSV .*field larger than field limit"):
        catalog.list_source("csv", str(tmp_path / "wide.csv"))


def test_a_broken_or_bloated_tar_keeps_what_came_before(tmp_path):
    d = tmp_path / "wds"
    d.mkdir()
    with tarfile.open(d / "a.tar", "w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "x.png", png())
        add(tf, "x.cls", b"0")
        ti = tarfile.TarInfo("y.png")
        ti.pax_headers = {"comment": "z" * (bounds.TAR_HEADER_BYTES + 1)}  # read whole by tarfile
        ti.size = len(png())
        tf.addfile(ti, io.BytesIO(png()))
    (d / "b.tar").write_bytes(b"not a tar at all" * 100)
    lst = catalog.list_source("webdataset", str(d))
    by = {it["key"]: it for it in lst.items}
    assert by["a.tar/x"]["label"] == 0 and not by["a.tar/x"]["error"]
    assert by["a.tar"]["error"].startswith("corrupt: ") and "more than 65536" in by["a.tar"]["error"]
    assert "re-write the tar" in by["b.tar"]["error"] and len(lst.items) == 3


# ------------------------------------------------------------------------------ roots


@pytest.fixture
def outside(tmp_path):
    """A folder beside the corpus, with an image and a secret in it."""
    out = tmp_path / "outside"
    save(Image.new("RGB", (12, 10), (0, 0, 255)), out / "x.png")
    (out / "secret.txt").write_text("password=hunter2")
    save(Image.new("RGB", (12, 10), (0, 255, 0)), out / "dogs" / "d.png")
    return out


def test_csv_rows_stay_inside_the_csv_folder(tmp_path, outside, opened):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "good.png").write_bytes(png())
    os.symlink(outside / "x.png", root / "link.png")  # inside the folder, leads out
    rows = [("good.png", "a"), ("sub/../good.png", "a"), (str(root / "good.png"), "b"),
            ("/etc/passwd", "a"), ("../outside/x.png", "a"), ("sub/../../outside/secret.txt", "b"),
            ("link.png", "a"), (f"file://{outside}/x.png", "b"), ("s3://another-bucket/x.png", "a")]
    with open(root / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label")] + rows)
    lst = catalog.list_source("csv", str(root / "labels.csv"))
    errors = {it["key"]: it["error"] for it in lst.items}
    assert [k for k, e in errors.items() if not e] == ["good.png", "sub/../good.png", str(root / "good.png")]
    for n, (p, _) in enumerate(rows[3:], start=5):
        assert errors[p] == (f"outside_root: line {n} of {root}/labels.csv names {p!r}, outside {root}; move it "
                             f"under {root}, or set data.allow_outside_root=true if you trust every path the corpus names")
    got = processed(lst.items)
    assert {k: r for k, (r, _) in got.items() if r} == {p: "outside_root" for p, _ in rows[3:]}
    assert not touched(opened, outside) and "/etc/passwd" not in opened

    trusted = catalog.plan_source("csv", str(root / "labels.csv"), allow_outside_root=True)
    assert not any(it["error"] for it in trusted.items)


def make_folder(root, outside):
    """An ImageFolder with links: a file and a directory leading out, a class directory leading
    out, a link inside the root (followed), and a link to its own directory (a loop)."""
    save(Image.new("RGB", (12, 10)), root / "cat" / "a.png")
    save(Image.new("RGB", (12, 10)), root / "cow" / "c.png")
    os.symlink(outside / "x.png", root / "cat" / "link.png")
    os.symlink(outside, root / "cat" / "dirlink")
    os.symlink(outside / "dogs", root / "dog")
    os.symlink(outside / "secret.txt", root / "top.png")
    os.symlink(root / "cow", root / "cat" / "cows")
    os.symlink(".", root / "cat" / "loop")


def test_imagefolder_links_out_of_the_root_are_not_followed(tmp_path, outside, opened):
    root = tmp_path / "corpus"
    make_folder(root, outside)
    lst = catalog.list_source("imagefolder", str(root))
    assert lst.classes == ["cat", "cow"]  # the linked-out "dog" is no class
    errors = {it["key"]: it["error"] for it in lst.items}
    assert sorted(errors) == ["cat/a.png", "cat/cows/c.png", "cat/dirlink", "cat/link.png", "cat/loop",
                              "cow/c.png", "dog", "top.png"]
    assert not errors["cat/a.png"] and not errors["cat/cows/c.png"] and not errors["cow/c.png"]
    assert errors["cat/link.png"].startswith(f"outside_root: {root}/cat/link.png is a symlink to a file outside {root};")
    assert errors["cat/dirlink"].startswith(f"outside_root: {root}/cat/dirlink is a symlink to a directory outside")
    assert errors["dog"].startswith(f"outside_root: {root}/dog is a symlink to a directory outside {root};")
    assert errors["top.png"].startswith("outside_root: ") and "data.allow_outside_root=true" in errors["dog"]
    assert errors["cat/loop"].startswith("unreadable: ") and "(a loop); remove the link" in errors["cat/loop"]
    got = processed(lst.items)
    assert {k: r for k, (r, _) in got.items() if r} == {
        "cat/link.png": "outside_root", "cat/dirlink": "outside_root", "dog": "outside_root",
        "top.png": "outside_root", "cat/loop": "unreadable"}
    assert not touched(opened, outside)

    unl = catalog.list_source("unlabelled", str(root))
    assert {it["key"] for it in unl.items if it["error"].startswith("outside_root")} == {
        "cat/link.png", "cat/dirlink", "dog", "top.png"}

    trusted = catalog.list_source("imagefolder", str(root), allow_outside_root=True)
    assert trusted.classes == ["cat", "cow", "dog"]
    assert {"cat/dirlink/x.png", "cat/link.png", "dog/d.png"} <= {it["key"] for it in trusted.items if not it["error"]}


def test_imagenet_and_pets_stay_inside(tmp_path, outside):
    inet = tmp_path / "imagenet"
    save(Image.new("RGB", (12, 10)), inet / "train" / "n01" / "a.JPEG")
    os.symlink(outside, inet / "val")
    with pytest.raises(InputError, match=re.escape(f"{inet}/val is a symlink to a directory outside {inet}; move it")):
        catalog.plan_source("imagenet", str(inet))

    pets = tmp_path / "pets"
    save(Image.new("RGB", (12, 10)), pets / "images" / "Abyssinian_1.jpg")
    (pets / "annotations").mkdir()
    (pets / "annotations" / "trainval.txt").write_text(
        "Abyssinian_1 1 1 1\n../../outside/x 1 1 1\nAbyssinian_2 \u00b2 1 1\nBengal_3\nBengal_4 0 1 1\n")
    (pets / "annotations" / "test.txt").write_text("")
    lst = catalog.list_source("pets", str(pets))
    errors = [it["error"] for it in lst.items]
    assert lst.classes == ["Abyssinian"] and errors[0] == ""
    assert errors[1].startswith("outside_root: '../../outside/x' in ")
    assert errors[2].startswith("bad_label: line 3 of ") and "not a class index" in errors[2]
    assert errors[3].startswith("bad_label: line 4 of ") and "holds ''" in errors[3]
    assert "class id 0 (ids start at 1)" in errors[4]


# ---------------------------------------------------------------------- through Ray


def test_hostile_webdataset_through_preprocess(ray_session, tmp_path):
    wds = tmp_path / "wds"
    wds.mkdir()
    with tarfile.open(wds / "shard-000.tar", "w") as tf:
        for key, cls in (("a", b"0"), ("b", b"1"), ("c", b"1"), ("big", b"999999999999"),
                         ("sup", "\u00b2".encode()), ("digits", b"7" * 5000), ("five", b"5")):
            add(tf, f"{key}.png", png())
            add(tf, f"{key}.cls", cls)
    cfg = make_cfg(tmp_path, source="webdataset", path=str(wds), storage_size=16, image_size=16,
                   num_classes=3, val_fraction=0.0)
    res = run_preprocess(Run.of(cfg))
    assert (res["written"], res["quarantined"], res["reasons"]) == (3, 4, {"bad_label": 4})
    out = tmp_path / "shards" / "webdataset"
    assert json.loads((out / "classes.json").read_text()) == {"0": 0, "1": 1, "2": 2}  # not 10**12 names
    q = {r["key"]: r["detail"] for r in pq.read_table(out / "quarantine.parquet").to_pylist()}
    assert q["shard-000.tar/five"] == "label 5 outside 0..2"
    assert "label 999999999999, above the largest class index" in q["shard-000.tar/big"]
    assert all(q.values())
