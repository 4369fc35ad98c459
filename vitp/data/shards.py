"""The on-disk shard format: D/{train,val}/part-NNNNN.parquet, classes.json, quarantine.parquet
and manifest.json, written last (without it readers refuse D); an unfinished run also leaves
_run.json, _records/, _quarantine/. Owns the formats (row groups, checksums, atomic writes,
per-shard commit records) and reading the manifest. Must not decode images or know Ray.
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
from ..storage import file_sizes, filesystem, join, rmtree
from .parquet import open_parquet

SHARD_SCHEMA = pa.schema([
    ("image", pa.binary()),   # uint8: H*W*3 raw bytes (row-major HWC); jpeg: the JPEG file
    ("height", pa.int32()),
    ("width", pa.int32()),
    ("label", pa.int64()),
    ("key", pa.string()),     # file identity (relative path), what the split hash uses
])
QUARANTINE_SCHEMA = pa.schema([("path", pa.string()), ("reason", pa.string()),
                               ("detail", pa.string()), ("key", pa.string())])
# What a reader checks a shard or quarantine part for before reading a row (parquet.open_parquet):
# shards may come from anyone (data.shards), and a run's unfinished parts lie in a folder it was given
SHARD_COLUMNS = {"image": "bytes", "height": "int", "width": "int", "label": "int", "key": "text"}
QUARANTINE_COLUMNS = {n: "text" for n in QUARANTINE_SCHEMA.names}
SPLITS = ("train", "val")
RECORDS = "_records"              # <split>-part-NNNNN.json per committed shard: its commit mark
QUARANTINE_PARTS = "_quarantine"  # <split>-part-NNNNN.parquet: the rows each shard task refused
RUN_FILE = "_run.json"            # the settings an unfinished run was started with (--resume)
OUR_ENTRIES = {"train", "val", "manifest.json", "classes.json", "quarantine.parquet", RECORDS,
               QUARANTINE_PARTS, RUN_FILE}
ROW_GROUP_BYTES = 8 << 20  # ~8 MB row groups: a reader streams a shard in pieces
MANIFEST_VERSION = 1


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
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


def _entries(fs: pafs.FileSystem, base: str) -> list[str]:
    return [e.base_name for e in fs.get_file_info(pafs.FileSelector(base))]


def prepare_output(root: str, overwrite: bool, resume: bool = False) -> tuple[pafs.FileSystem, str]:
    """Make `root` ready for shards; refuse to clobber without `overwrite`.

    With overwrite, only our own entries are removed; a directory holding anything else is
    refused either way (a mistyped --set data.shards=~ must not delete a home directory).
    With resume, an unfinished run's committed shards stay (see committed_records).
    """
    fs, base = filesystem(root)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.File:
        raise FileExistsError(f"{root}: is a file; data.shards must be a directory")
    if info.type == pafs.FileType.Directory:
        entries = _entries(fs, base)
        foreign = sorted(e for e in entries if e not in OUR_ENTRIES and not e.endswith(".tmp"))
        if foreign:
            raise FileExistsError(
                f"{root}: holds files that are not shards ({', '.join(foreign[:5])}); "
                "choose an empty directory with --set data.shards=DIR")
        if entries and not (overwrite or resume):
            if "manifest.json" in entries:
                raise FileExistsError(f"{root}: already holds shards; pass --overwrite to replace "
                                      "them or choose another --set data.shards=DIR")
            raise FileExistsError(f"{root}: already holds an unfinished preprocess run; pass "
                                  "--resume to finish it or --overwrite to start over")
        if overwrite:
            for e in entries:
                rmtree(join(root, e), root)
    fs.create_dir(base, recursive=True)
    for s in SPLITS + (RECORDS, QUARANTINE_PARTS):
        fs.create_dir(join(base, s), recursive=True)
    return fs, base


def begin_run(fs: pafs.FileSystem, base: str, root: str, settings: dict) -> None:
    """Record what defines this run's shards (RUN_FILE). A resumed run must have the same
    settings and inputs, else its committed shards would not belong to the new ones."""
    path = join(base, RUN_FILE)
    if fs.get_file_info(path).type == pafs.FileType.File:
        with fs.open_input_stream(path) as f:
            before = json.loads(f.read().decode())
        diff = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if diff:
            raise InputError(f"{root}: the unfinished run there was started with other "
                             f"{', '.join(diff)}; pass --overwrite to start over")
        return
    write_atomic(fs, path, json.dumps(settings, indent=1).encode())


def encode_shard(cols: dict) -> tuple[bytes, list[int]]:
    """SHARD_SCHEMA columns -> (Parquet file bytes, rows per row group). The same rows give
    the same bytes."""
    n = len(cols["key"])
    table = pa.table({k: cols[k] for k in SHARD_SCHEMA.names}, schema=SHARD_SCHEMA)
    per_row = max(1, sum(len(b) + 16 for b in cols["image"]) // max(n, 1))
    rg_rows = max(1, ROW_GROUP_BYTES // per_row)
    buf = pa.BufferOutputStream()
    # no compression on the image column: raw pixels barely compress and JPEG not at all,
    # and decompression would cost ingest CPU; dictionary-free for the same reason
    pq.write_table(table, buf, row_group_size=rg_rows,
                   compression="none", use_dictionary=False, write_statistics=["label"])
    return buf.getvalue().to_pybytes(), [min(rg_rows, n - i) for i in range(0, n, rg_rows)]


def quarantine_bytes(rows: list[dict]) -> bytes:
    cols = {n: [str(r.get(n, "")) for r in rows] for n in QUARANTINE_SCHEMA.names}
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table(cols, schema=QUARANTINE_SCHEMA), buf)
    return buf.getvalue().to_pybytes()


def merge_quarantine(root: str, parts: list[str]) -> int:
    """quarantine.parquet from the per-shard parts (written even when empty), rows sorted by
    key; returns the row count. Runs where the parts are (a Ray task), not on the driver."""
    fs, base = filesystem(root)
    rows: list[dict] = []
    for rel in parts:
        with fs.open_input_file(join(base, rel)) as f:
            part = open_parquet(f, join(root, rel), QUARANTINE_COLUMNS)
            rows.extend(part.read(columns=QUARANTINE_SCHEMA.names).to_pylist())
    rows.sort(key=lambda r: (r["key"], r["path"], r["reason"]))
    write_atomic(fs, join(base, "quarantine.parquet"), quarantine_bytes(rows))
    return len(rows)


def committed_records(fs: pafs.FileSystem, base: str) -> dict[str, dict]:
    """{group: record} of the shards an earlier attempt committed (its record is written after
    the shard and its quarantine part, so a record means all three are complete)."""
    out = {}
    for fi in fs.get_file_info(pafs.FileSelector(join(base, RECORDS), allow_not_found=True)):
        if fi.type == pafs.FileType.File and fi.base_name.endswith(".json"):
            with fs.open_input_stream(fi.path) as f:
                rec = json.loads(f.read().decode())
            out[rec["group"]] = rec
    return out


def remove_run_state(fs: pafs.FileSystem, base: str) -> None:
    """After the manifest: the records, quarantine parts and run file are no longer needed."""
    for d in (RECORDS, QUARANTINE_PARTS):
        if fs.get_file_info(join(base, d)).type == pafs.FileType.Directory:
            fs.delete_dir(join(base, d))
    if fs.get_file_info(join(base, RUN_FILE)).type == pafs.FileType.File:
        fs.delete_file(join(base, RUN_FILE))


def write_json(fs: pafs.FileSystem, base: str, name: str, obj) -> None:
    write_atomic(fs, join(base, name), json.dumps(obj, indent=2, sort_keys=False).encode())


def read_manifest(root: str) -> dict:
    """manifest.json of a finished preprocess run; a clear error for unfinished/missing ones."""
    fs, base = filesystem(root)
    p = join(base, "manifest.json")
    if fs.get_file_info(p).type != pafs.FileType.File:
        raise FileNotFoundError(
            f"{root}: no manifest.json, so these are not finished shards; run "
            "`vitp preprocess RECIPE` (add --overwrite to replace an unfinished run)")
    with fs.open_input_stream(p) as f:
        raw = f.read()
    try:
        m = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        m = None
    if not isinstance(m, dict) or not isinstance(m.get("shards"), dict):
        raise InputError(f"{root}/manifest.json: not a shards manifest (unreadable JSON or no shard list); "
                         "re-run `vitp preprocess RECIPE --overwrite` into this directory")
    if m.get("version") != MANIFEST_VERSION:
        raise InputError(f"{root}/manifest.json: version {m.get('version')} != {MANIFEST_VERSION}; "
                         "re-run vitp preprocess --overwrite")
    return m


def check_shard_files(root: str, manifest: Optional[dict] = None) -> None:
    """InputError unless every shard the manifest lists is a file under `root` and the first of
    each split is Parquet ("PAR1" at both ends): a deleted or foreign shard fails here, on the
    driver, once, not in every Train worker. One listing of `root` (not a request per shard)."""
    m = manifest or read_manifest(root)
    present = file_sizes(root)
    listed = [s["file"] for shards in m["shards"].values() for s in shards]
    missing = [f for f in listed if f not in present]
    if missing:
        raise InputError(f"{root}: {len(missing)} of the {len(listed)} shards its manifest lists are missing "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); restore them or "
                         "re-run `vitp preprocess RECIPE --overwrite`")
    fs, base = filesystem(root)
    for split, shards in m["shards"].items():
        if not shards:
            continue
        with fs.open_input_file(join(base, shards[0]["file"])) as f:
            size = f.size()
            head, tail = f.read_at(4, 0), f.read_at(4, max(size - 4, 0))
        if size < 12 or head != b"PAR1" or tail != b"PAR1":
            raise InputError(f"{join(root, shards[0]['file'])}: not a Parquet file, though the manifest lists it as "
                             f"a {split} shard; re-run `vitp preprocess RECIPE --overwrite`")


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
