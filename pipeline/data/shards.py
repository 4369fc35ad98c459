"""The on-disk shard format: D/{train,val}/part-NNNNN.parquet, classes.json, quarantine.parquet
(path, reason, detail, key) and manifest.json, written last (without it readers refuse D).

Owns writing (shard size, row groups sized for streaming, checksums, write-to-temp then rename)
and reading the manifest back. Must not decode images or know about Ray.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import InputError
from ..storage import filesystem, join

SHARD_SCHEMA = pa.schema([
    ("image", pa.binary()),   # uint8: H*W*3 raw bytes (row-major HWC); jpeg: the JPEG file
    ("height", pa.int32()),
    ("width", pa.int32()),
    ("label", pa.int64()),
    ("key", pa.string()),     # file identity (relative path), what the split hash uses
])
QUARANTINE_SCHEMA = pa.schema([("path", pa.string()), ("reason", pa.string()),
                               ("detail", pa.string()), ("key", pa.string())])
SPLITS = ("train", "val")
OUR_ENTRIES = {"train", "val", "manifest.json", "classes.json", "quarantine.parquet"}
ROW_GROUP_BYTES = 8 << 20  # ~8 MB row groups: a reader streams a shard in pieces
MANIFEST_VERSION = 1


def _write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """No reader ever sees a partial file: on local disk write `<path>.tmp` (no .parquet/.json
    extension) then rename; object stores have no rename, and one PUT appears whole."""
    if fs.type_name != "local":
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def prepare_output(root: str, overwrite: bool) -> tuple[pafs.FileSystem, str]:
    """Make `root` ready for a fresh set of shards; refuse to clobber without `overwrite`.

    With overwrite, only our own entries are removed; a directory holding anything else is
    refused either way (a mistyped --set data.shards=~ must not delete a home directory).
    """
    fs, base = filesystem(root)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.File:
        raise FileExistsError(f"{root}: is a file; data.shards must be a directory")
    if info.type == pafs.FileType.Directory:
        entries = [e.base_name for e in fs.get_file_info(pafs.FileSelector(base))]
        foreign = sorted(e for e in entries if e not in OUR_ENTRIES and not e.endswith(".tmp"))
        if foreign:
            raise FileExistsError(
                f"{root}: holds files that are not shards ({', '.join(foreign[:5])}); "
                "choose an empty directory with --set data.shards=DIR")
        if entries and not overwrite:
            raise FileExistsError(
                f"{root}: already holds shards; pass --overwrite to replace them "
                "or choose another --set data.shards=DIR")
        for e in entries:
            p = join(base, e)
            if fs.get_file_info(p).type == pafs.FileType.Directory:
                fs.delete_dir(p)
            else:
                fs.delete_file(p)
    fs.create_dir(base, recursive=True)
    for s in SPLITS:
        fs.create_dir(join(base, s), recursive=True)
    return fs, base


class ShardWriter:
    """Buffers rows of one split and writes `part-XXXXX.parquet` each time ~target_bytes
    accumulate. Rows are written in the order added, so the same input gives the same files."""

    def __init__(self, fs: pafs.FileSystem, base: str, split: str, target_bytes: int):
        self.fs, self.base, self.split = fs, base, split
        self.target = max(1, int(target_bytes))
        self.cols: dict[str, list] = {n: [] for n in SHARD_SCHEMA.names}
        self.nbytes = 0
        self.shards: list[dict] = []

    def add(self, image: bytes, height: int, width: int, label: int, key: str) -> None:
        for n, v in zip(SHARD_SCHEMA.names, (image, height, width, label, key)):
            self.cols[n].append(v)
        self.nbytes += len(image) + len(key) + 16
        if self.nbytes >= self.target:
            self.flush()

    def flush(self) -> None:
        n = len(self.cols["key"])
        if n == 0:
            return
        table = pa.table(self.cols, schema=SHARD_SCHEMA)
        per_row = max(1, self.nbytes // n)
        buf = pa.BufferOutputStream()
        # no compression on the image column: raw pixels barely compress and JPEG not at all,
        # and decompression would cost ingest CPU; dictionary-free for the same reason
        rg_rows = max(1, ROW_GROUP_BYTES // per_row)
        pq.write_table(table, buf, row_group_size=rg_rows,
                       compression="none", use_dictionary=False, write_statistics=["label"])
        data = buf.getvalue().to_pybytes()
        rel = f"{self.split}/part-{len(self.shards):05d}.parquet"
        _write_atomic(self.fs, join(self.base, rel), data)
        labels = self.cols["label"]
        self.shards.append({"file": rel, "rows": n, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "labels": [int(min(labels)), int(max(labels))],
                            # rows per row group: ingest plans its read units from these
                            "row_groups": [min(rg_rows, n - i) for i in range(0, n, rg_rows)]})
        self.cols = {k: [] for k in SHARD_SCHEMA.names}
        self.nbytes = 0


def write_quarantine(fs: pafs.FileSystem, base: str, rows: list[dict]) -> None:
    """quarantine.parquet: one row per input that was not written (written even when empty)."""
    cols = {n: [str(r.get(n, "")) for r in rows] for n in QUARANTINE_SCHEMA.names}
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table(cols, schema=QUARANTINE_SCHEMA), buf)
    _write_atomic(fs, join(base, "quarantine.parquet"), buf.getvalue().to_pybytes())


def write_json(fs: pafs.FileSystem, base: str, name: str, obj) -> None:
    _write_atomic(fs, join(base, name), json.dumps(obj, indent=2, sort_keys=False).encode())


def read_manifest(root: str) -> dict:
    """manifest.json of a finished preprocess run; a clear error for unfinished/missing ones."""
    fs, base = filesystem(root)
    p = join(base, "manifest.json")
    if fs.get_file_info(p).type != pafs.FileType.File:
        raise FileNotFoundError(
            f"{root}: no manifest.json, so these are not finished shards; run "
            "`vitp preprocess RECIPE` (add --overwrite to replace an unfinished run)")
    with fs.open_input_stream(p) as f:
        m = json.loads(f.read().decode())
    if m.get("version") != MANIFEST_VERSION:
        raise InputError(f"{root}/manifest.json: version {m.get('version')} != {MANIFEST_VERSION}; "
                         "re-run vitp preprocess --overwrite")
    return m


def shard_paths(root: str, split: str, manifest: Optional[dict] = None) -> list[str]:
    """The shard files of `split` listed in the manifest (never a directory glob, so stray
    temp files or shards of a killed run are never read)."""
    m = manifest or read_manifest(root)
    return [join(root, s["file"]) for s in m["shards"].get(split, [])]


def verify_checksums(root: str, manifest: Optional[dict] = None) -> list[str]:
    """Shard files whose sha256 differs from the manifest (empty list = all good)."""
    m = manifest or read_manifest(root)
    fs, base = filesystem(root)
    bad = []
    for split in SPLITS:
        for s in m["shards"].get(split, []):
            with fs.open_input_stream(join(base, s["file"])) as f:
                if hashlib.sha256(f.read()).hexdigest() != s["sha256"]:
                    bad.append(s["file"])
    return bad


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
