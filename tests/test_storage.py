"""vitp.storage: local paths and URIs through one set of helpers (no network)."""
import json
import os
import subprocess
import sys

from vitp import storage
from vitp.config import Run


def test_is_uri():
    assert storage.is_uri("s3://bucket/key")
    assert storage.is_uri("gs://bucket")
    assert storage.is_uri("file:///tmp/x")
    assert not storage.is_uri("/tmp/x")
    assert not storage.is_uri("relative/dir")
    assert not storage.is_uri("")
    assert not storage.is_uri("scratch")


def test_join_local_and_uri():
    assert storage.join("/data", "shards", "cifar10") == "/data/shards/cifar10"
    assert storage.join("/data/", "/shards/", "x.parquet") == "/data/shards/x.parquet"
    assert storage.join("s3://bucket/work/", "runs") == "s3://bucket/work/runs"
    assert storage.join("file:///tmp/a", "b", "", "c") == "file:///tmp/a/b/c"
    assert storage.join("rel", "a") == "rel/a"


def test_abspath(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.abspath("work") == os.path.join(str(tmp_path), "work")
    assert storage.abspath("/already/absolute") == "/already/absolute"
    assert storage.abspath("s3://bucket/work") == "s3://bucket/work"
    assert storage.abspath("file:///tmp/x") == "file:///tmp/x"
    assert storage.abspath("") == ""
    assert storage.abspath("scratch") == "scratch"


def test_exists_filesystem_and_open_input(tmp_path):
    f = tmp_path / "a" / "b.bin"
    f.parent.mkdir()
    f.write_bytes(b"hello")
    for path in (str(f), "file://" + str(f)):
        assert storage.exists(path)
        with storage.open_input(path) as fh:
            assert fh.read() == b"hello"
    assert storage.exists("file://" + str(tmp_path / "a"))  # directories too
    assert not storage.exists(str(tmp_path / "missing"))
    assert not storage.exists("file://" + str(tmp_path / "missing"))
    fs, inner = storage.filesystem(str(tmp_path / "a"))
    assert inner == str(tmp_path / "a") and fs.type_name == "local"
    fs, inner = storage.filesystem("file://" + str(tmp_path / "a"))
    assert inner == str(tmp_path / "a")


def test_imports_no_pyarrow_torch_or_ray():
    code = ("import sys, vitp.storage, vitp.net; "
            "bad = [m for m in ('pyarrow', 'torch', 'ray') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_object_storage_round_trip(s3, tmp_path):
    """On the S3 server: whole-file writes, listings with sizes, directory copies both ways."""
    root = storage.join(s3.bucket(), "work")
    storage.write_json(storage.join(root, "meta.json"), {"step": 3})
    assert storage.read_json(storage.join(root, "meta.json")) == {"step": 3}
    local = tmp_path / "ckpt"
    (local / "state").mkdir(parents=True)
    (local / "state" / "w.pt").write_bytes(b"0123456789")
    (local / "complete").mkdir()
    (local / "complete" / "rank_0.json").write_text("{}")
    assert storage.upload_dir(str(local), storage.join(root, "c")) == 12
    assert storage.file_sizes(storage.join(root, "c")) == {"state/w.pt": 10, "complete/rank_0.json": 2}
    assert storage.file_sizes(storage.join(root, "c"), skip_dirs=("complete",)) == {"state/w.pt": 10}
    assert storage.listdir(root) == ["c", "meta.json"]
    assert storage.isdir(storage.join(root, "c")) and storage.isfile(storage.join(root, "meta.json"))
    assert storage.size(storage.join(root, "c/state/w.pt")) == 10
    assert storage.size(storage.join(root, "nothing")) is None and not storage.exists(storage.join(root, "nothing"))
    with storage.local_copy(storage.join(root, "c")) as d:
        assert open(os.path.join(d, "state", "w.pt"), "rb").read() == b"0123456789"
    with storage.local_copy(storage.join(root, "meta.json")) as f:
        assert json.load(open(f)) == {"step": 3}
    storage.rmtree(storage.join(root, "c"), root)
    assert storage.listdir(root) == ["meta.json"] and storage.listdir(storage.join(root, "c")) == []


def test_local_writes_are_atomic_and_listed(tmp_path):
    path = str(tmp_path / "d" / "x.json")
    storage.write_json(path, [1, 2])
    assert storage.read_json(path) == [1, 2] and os.listdir(tmp_path / "d") == ["x.json"]
    assert storage.file_sizes(str(tmp_path)) == {"d/x.json": os.path.getsize(path)}
    assert storage.listdir("file://" + str(tmp_path)) == ["d"]


def test_through_outages_tries_again_while_the_store_is_unreachable_not_on_a_missing_path():
    """A connection reset is tried again (said each time) until it answers; a missing path is the
    caller's answer at once; an outage longer than the limit raises its last error."""
    import pytest

    from vitp.storage import through_outages

    said, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: Connection reset")
        return "manifest"

    assert through_outages(flaky, "the shards", said.append, limit_s=5, first_pause_s=0.01) == "manifest"
    assert len(calls) == 3 and len(said) == 2 and all("the shards: storage unreachable" in s for s in said)

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://bucket/shards/manifest.json")

    calls.clear()
    with pytest.raises(FileNotFoundError):
        through_outages(missing, "the shards", said.append, limit_s=5, first_pause_s=0.01)
    assert len(calls) == 1

    def down():
        raise OSError("Connection refused")

    with pytest.raises(OSError, match="refused"):
        through_outages(down, "the shards", said.append, limit_s=0.05, first_pause_s=0.01)


def test_a_driver_checking_its_shards_waits_out_a_store_cut_off(debug_shards, s3):
    """S3 cut off for 12 s (tests/netproxy.py) as a driver checks its shards before training
    (`ensure_shards`): it tries again, says so, and goes on once S3 is back; before, `vitp
    pretrain` stopped with "internal error: OSError" (the chaos soak)."""
    import logging

    from vitp.data.commands import ensure_shards
    from vitp.recipes import resolve

    root = storage.join(s3.bucket(), "shards")
    storage.copy_dir(debug_shards, root)
    cfg = resolve("debug", [f"data.shards={root}", "tracking.run_name=cut"], check_paths=False)
    said, heard = [], logging.Handler(logging.WARNING)
    heard.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vitp.data.commands").addHandler(heard)
    try:
        with s3.proxy.cut_for(12.0):
            assert ensure_shards(Run.of(cfg), log=lambda _: None) == root
    finally:
        logging.getLogger("vitp.data.commands").removeHandler(heard)
    assert any("the shards at" in line and "storage unreachable" in line for line in said), said


def test_a_copy_whose_part_upload_the_store_never_got_raises_and_names_the_file(s3, tmp_path):
    """pyarrow's copy_files only logs a failed part upload (as the stream is destroyed) and returns
    with the file missing from the bucket: a checkpoint's marker, written next, then vouched for a
    file that was not there. copy_dir lists both sides and raises, naming it (a transient error,
    which `through_outages` tries again); once the store takes the writes, the copy goes through."""
    import pytest

    src = tmp_path / "checkpoint"
    (src / "state").mkdir(parents=True)
    (src / "meta.json").write_bytes(b"{}")
    (src / "state" / "optim.pt").write_bytes(os.urandom(5000))
    dest = storage.join(s3.bucket(), "checkpoint")
    s3.proxy.drop("optim.pt?partNumber")  # the upload starts; its part never reaches the store
    try:
        with pytest.raises(storage.IncompleteCopy, match=r"1 of 2 file\(s\) did not arrive whole \(state/optim\.pt\)"):
            storage.upload_dir(str(src), dest)
    finally:
        s3.proxy.drop("")
    assert storage.file_sizes(dest) == {"meta.json": 2}
    assert storage.upload_dir(str(src), dest) == 5002
    assert storage.file_sizes(dest) == {"meta.json": 2, "state/optim.pt": 5000}
