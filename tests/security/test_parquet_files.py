"""A Parquet file from anyone never runs code: importing ray.data registers Ray's pickled-object
Arrow extension type, whose values are unpickled when a row is turned into Python. Every reader of
a Parquet file handed to us (a Parquet corpus's listing and its image reads, shards named by
data.shards, an unfinished run's quarantine parts) checks the footer's schema first and refuses
any extension type, and any column of a type it does not read, before a row is read.

The planted file is first shown to work: a plain read of it does create the canary file, so a
reader that stopped checking would fail these tests."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray  # registers the type

from vitp.data import catalog
from vitp.data import shards as sh
from vitp.data.ingest import _read_unit, check_shard_files
from vitp.data.parquet import RAY_PICKLED_METADATA_ENV
from vitp.data.rows import _attach_parquet_images
from vitp.errors import InputError


class Plant:
    """Unpickling this opens `path` for writing: it creates the file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _pickled(canary, n: int = 2) -> pa.Array:
    return ArrowPythonObjectArray.from_objects([Plant(canary)] + ["x"] * (n - 1))


def _unknown_extension(values: list) -> tuple[pa.Array, pa.Field]:
    """A column marked as an extension type this process has never registered (its storage read as is)."""
    meta = {b"ARROW:extension:name": b"someone.elses_type", b"ARROW:extension:metadata": b""}
    return pa.array(values), pa.field("label", pa.string(), metadata=meta)


# name -> (what the file holds besides its image column, what the refusal says)
CASES = {
    "pickled-label": (lambda c: {"label": _pickled(c)}, "column 'label' has the Arrow extension type "
                                                        "'ray.data.arrow_pickled_object'"),
    "pickled-in-a-struct": (lambda c: {"label": ["a", "b"], "extra": pa.StructArray.from_arrays(
        [_pickled(c)], names=["inner"])}, "column 'extra' has the Arrow extension type"),
    "pickled-in-a-list": (lambda c: {"label": ["a", "b"], "extra": pa.ListArray.from_arrays(
        pa.array([0, 1, 2], pa.int32()), _pickled(c))}, "column 'extra' has the Arrow extension type"),
    "unregistered-extension": ("unknown", "column 'label' has the Arrow extension type 'someone.elses_type'"),
    "float-label": (lambda c: {"label": pa.array([1.5, 2.5])}, "column 'label' is double, expected string or integer"),
    "text-image": (lambda c: {"label": ["a", "b"], "image": ["not", "bytes"]}, "column 'image' is string, expected binary"),
}


def _write(path, case: str, canary) -> None:
    make, _ = CASES[case]
    cols = {"image": pa.array([b"\x89PNG", b"\x89PNG"])}
    if make == "unknown":
        arr, field = _unknown_extension(["a", "b"])
        table = pa.Table.from_arrays([cols["image"], arr], schema=pa.schema([pa.field("image", pa.binary()), field]))
    else:
        cols.update(make(canary))
        table = pa.table(cols)
    pq.write_table(table, path)


def test_a_pickled_column_runs_code_when_read_plainly(tmp_path):
    canary = tmp_path / "ran"
    _write(tmp_path / "x.parquet", "pickled-label", canary)
    pq.read_table(tmp_path / "x.parquet").column("label").to_pylist()
    assert canary.exists()  # what every reader below must never do


@pytest.mark.parametrize("case", CASES)
def test_a_parquet_source_with_a_column_we_do_not_read_safely_is_quarantined_unread(tmp_path, case):
    """The listing refuses the file (one quarantine entry naming the column); the image reads, for
    a file changed after its listing, refuse it too. No row becomes Python, no canary appears."""
    canary, src = tmp_path / "ran", tmp_path / "src"
    src.mkdir()
    _write(src / "bad.parquet", case, canary)
    pq.write_table(pa.table({"image": [b"\x89PNG"], "label": ["ok"]}), src / "good.parquet")
    items = {it["path"].rsplit("/", 1)[-1]: it for it in catalog.list_source("parquet", str(src)).items}
    assert items["bad.parquet"]["error"].startswith(f"unreadable: {src / 'bad.parquet'}: {CASES[case][1]}"), items
    assert items["good.parquet"]["error"] == ""
    row = {"path": str(src / "bad.parquet"), "row_group": 0, "row": 0, "error": ""}
    _attach_parquet_images([row])
    assert row["error"].startswith("unreadable: ") and CASES[case][1] in row["error"], row
    assert not canary.exists()


def _shard_set(root, keys) -> None:
    """A one-shard set whose manifest lists it (what data.shards names), its `key` column `keys`."""
    (root / "train").mkdir(parents=True)
    n = len(keys)
    table = pa.table({"image": pa.array([bytes(12)] * n), "height": pa.array([2] * n, pa.int32()),
                      "width": pa.array([2] * n, pa.int32()), "label": pa.array([0] * n, pa.int64()), "key": keys})
    pq.write_table(table, root / "train" / "part-00000.parquet")
    (root / "manifest.json").write_text(json.dumps({"shards": {"train": [{"file": "train/part-00000.parquet",
                                                                          "rows": n}]}}))


def test_shards_from_elsewhere_are_refused_before_a_row_is_read(tmp_path):
    canary = tmp_path / "ran"
    good, bad = tmp_path / "good", tmp_path / "bad"
    _shard_set(good, pa.array(["a", "b"]))
    _shard_set(bad, _pickled(canary))
    check_shard_files(str(good), "train", json.loads((good / "manifest.json").read_text()))
    assert list(_read_unit((str(good / "train" / "part-00000.parquet"), 0, 2))["key"]) == ["a", "b"]
    says = f"{bad / 'train' / 'part-00000.parquet'}: column 'key' has the Arrow extension type"
    with pytest.raises(InputError, match=says):  # in the worker, before its read tasks start
        check_shard_files(str(bad), "train", json.loads((bad / "manifest.json").read_text()))
    with pytest.raises(InputError, match=says):  # and in each read task
        _read_unit((str(bad / "train" / "part-00000.parquet"), 0, 2))
    assert not canary.exists()


def test_an_unfinished_runs_quarantine_part_is_refused_before_a_row_is_read(tmp_path):
    canary = tmp_path / "ran"
    (tmp_path / sh.QUARANTINE_PARTS).mkdir()
    part = f"{sh.QUARANTINE_PARTS}/train-part-00000.parquet"
    pq.write_table(pa.table({"path": _pickled(canary), "reason": ["x", "y"], "detail": ["", ""], "key": ["a", "b"]}),
                   tmp_path / part)
    with pytest.raises(InputError, match="column 'path' has the Arrow extension type"):
        sh.merge_quarantine(str(tmp_path), [part])
    assert not canary.exists()


def test_rays_opt_in_to_unpickle_schemas_stops_every_read(tmp_path, monkeypatch):
    """With Ray's opt-in set, reading a schema may unpickle: no Parquet file is opened at all."""
    _shard_set(tmp_path, pa.array(["a", "b"]))
    monkeypatch.setenv(RAY_PICKLED_METADATA_ENV, "1")
    with pytest.raises(InputError, match=f"not opened while {RAY_PICKLED_METADATA_ENV} is set"):
        _read_unit((str(tmp_path / "train" / "part-00000.parquet"), 0, 2))


def test_preprocess_of_a_corpus_with_a_pickled_column_runs_no_code(ray_session, tmp_path):
    """The whole `vitp preprocess` on Ray Data: the planted file is quarantined with its reason,
    the rest of the corpus is written, and nothing ran in any listing or decoding task."""
    import io

    from PIL import Image

    from vitp.config import Run
    from vitp.data.commands import run_preprocess
    from vitp.recipes import resolve

    def png(shade: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (20, 20), (shade, shade, shade)).save(buf, "PNG")
        return buf.getvalue()

    canary, src, out = tmp_path / "ran", tmp_path / "src", tmp_path / "shards"
    src.mkdir()
    pq.write_table(pa.table({"image": [png(9), png(99)], "label": _pickled(canary)}), src / "planted.parquet")
    pq.write_table(pa.table({"image": [png(i * 40) for i in range(4)], "label": ["a", "b", "a", "b"]}),
                   src / "good.parquet")
    res = run_preprocess(Run.of(resolve("debug", [f"work_dir={tmp_path}", "data.source=parquet", f"data.path={src}",
                                                  f"data.shards={out}", "data.val_fraction=0.25"])), log=lambda s: None)
    assert res["written"] == 4 and res["reasons"] == {"unreadable": 1}, res
    (refused,) = pq.read_table(out / "quarantine.parquet").to_pylist()
    assert refused["path"] == str(src / "planted.parquet") and "'ray.data.arrow_pickled_object'" in refused["detail"]
    assert not canary.exists()
