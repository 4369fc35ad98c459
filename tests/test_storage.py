"""pipeline.storage: local paths and URIs through one set of helpers (no network)."""
import os
import subprocess
import sys

from pipeline import storage


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
    code = ("import sys, pipeline.storage, pipeline.net; "
            "bad = [m for m in ('pyarrow', 'torch', 'ray') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
