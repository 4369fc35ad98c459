"""What preprocess's Ray tasks run on the listed items: the split and train-subset of a key, a
row's image read, decoded, validated and stored (or its quarantine reason), the shard a row goes to,
and a shard written. One bad file never drops another row: each is an image or a quarantine record.
No Ray here; preprocess.py drives these.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from functools import lru_cache
from typing import Optional

import numpy as np
import pyarrow as pa

from ..errors import InputError
from ..storage import filesystem, join, open_input
from . import shards as sh
from .decode import DecodeError, decode_image, encode_jpeg, resize_center_crop
from .files import read_image
from .parquet import open_parquet
from .sources import SOURCE_COLUMNS, image_column
from .synth import class_system, render

# process_rows keeps these item columns and adds the stored image (or why there is none)
KEEP_FIELDS = ("key", "label", "split", "h", "group")
OUT_FIELDS = KEEP_FIELDS + ("image", "height", "width",
                            "reason",  # "" = usable; else one of decode.REASONS
                            "detail", "path")


def hash_fraction(key: str) -> float:
    """A key's position in [0, 1): sha1 of the file identity, independent of order and seed."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:12], 16) / float(1 << 48)


def assign_split(key: str, official: str, val_fraction: float) -> str:
    if official:
        return official
    return "val" if hash_fraction(key) < val_fraction else "train"


def in_train_subset(key: str, fraction: float) -> bool:
    """Whether a train item is among the kept `fraction` (data.train_fraction): a second hash of
    the key, so subsets are nested (5% of the images are among the 20%) and balanced on average."""
    return fraction >= 1.0 or hash_fraction("train-subset/" + key) < fraction


def subset_train(batch: pa.Table, val_fraction: float, train_fraction: float) -> pa.Table:
    """Items -> the same items less the train ones outside the train_fraction subset."""
    keys, official = batch.column("key").to_pylist(), batch.column("split").to_pylist()
    keep = [i for i, (k, s) in enumerate(zip(keys, official))
            if assign_split(k, s, val_fraction) != "train" or in_train_subset(k, train_fraction)]
    return batch if len(keep) == batch.num_rows else batch.take(keep)


@lru_cache(maxsize=4096)
def _system(seed: int, cls: int):
    return class_system(seed, cls)


def _one(row: dict, size: int, storage_format: str, jpeg_quality: int, max_pixels: int,
         num_classes: int, synth_seed: int) -> tuple[bytes, str, str]:
    """One input -> (stored bytes, reason, detail); reason "" means usable."""
    if row["error"]:
        reason, _, detail = row["error"].partition(": ")
        return b"", reason, detail
    if not 0 <= row["label"] < num_classes:
        return b"", "bad_label", f"label {row['raw_label'] or row['label']} outside 0..{num_classes - 1}"
    try:
        if row["synth"] >= 0:
            cls = row["label"]
            img = render(synth_seed, cls, row["synth"], size, _system(synth_seed, cls))
        elif row["shape"]:
            h, w, c = (int(v) for v in row["shape"].split("x"))
            img = np.frombuffer(row["data"], dtype=np.uint8).reshape(h, w, c)
        else:
            if row["data"]:
                data = row["data"]
            else:
                try:
                    data = read_image(row["path"], row["offset"], row["length"], max_pixels)
                except OSError as e:
                    return b"", "unreadable", f"cannot read ({e.__class__.__name__}: {e})"
            img = decode_image(data, max_pixels=max_pixels, draft_size=size)
        img = resize_center_crop(img, size)  # (size, size, 3) uint8
        if storage_format == "jpeg":
            return encode_jpeg(img, jpeg_quality), "", ""
        return np.ascontiguousarray(img).tobytes(), "", ""
    except DecodeError as e:
        return b"", e.reason, str(e)
    except Exception as e:  # noqa: BLE001 - anything else is quarantined, never raised
        return b"", "corrupt", f"{e.__class__.__name__}: {e}"


def process_rows(batch: pa.Table, size: int, storage_format: str, jpeg_quality: int,
                 max_pixels: int, num_classes: int, synth_seed: int) -> pa.Table:
    """Items -> the same rows with the stored image, or the reason it was refused (`reason`,
    "" = usable): one bad file never drops another row. Parquet sources' images are read by
    row group, each group once per call."""
    rows = batch.to_pylist()
    _attach_parquet_images(rows)
    out: dict[str, list] = {n: [] for n in OUT_FIELDS}
    for row in rows:
        image, reason, detail = _one(row, size, storage_format, jpeg_quality, max_pixels,
                                     num_classes, synth_seed)
        for n in KEEP_FIELDS:
            out[n].append(row[n])
        out["image"].append(image)
        out["height"].append(size if not reason else 0)
        out["width"].append(size if not reason else 0)
        out["reason"].append(reason)
        out["detail"].append(detail)
        out["path"].append(row["path"] or row["key"])
    return pa.table(out)


def _attach_parquet_images(rows: list[dict]) -> None:
    """Set `data` of rows that point into a Parquet source (path, row_group, row)."""
    wanted: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r["row_group"] >= 0 and not r["error"]:
            wanted.setdefault((r["path"], r["row_group"]), []).append(r)
    for (path, g), rs in wanted.items():
        try:
            with open_input(path) as f:  # checked again: the file may have changed since its listing
                pf = open_parquet(f, path, SOURCE_COLUMNS)
                col = pf.read_row_group(g, columns=[image_column(pf.schema_arrow.names)]).column(0)
        except (OSError, InputError) as e:
            why = f"cannot read {path} ({e.__class__.__name__}: {e})" if isinstance(e, OSError) else str(e)
            for r in rs:
                r["error"] = f"unreadable: {why}"
            continue
        for r in rs:
            img = col[r["row"]].as_py()
            if isinstance(img, dict):  # HF-style struct {"bytes": ..., "path": ...}
                img = img.get("bytes")
            r["data"] = img or b""
            if not r["data"]:
                r["error"] = "empty: no image bytes in this row"


def shard_hash(seed: int, key: str) -> int:
    """A 60-bit hash of (seed, key): picks the shard and the order inside it."""
    return int(hashlib.sha1(f"{seed}:{key}".encode()).hexdigest()[:15], 16)


def assign_groups(batch: pa.Table, val_fraction: float, seed: int, buckets: dict,
                  label_index: Optional[dict], done: frozenset) -> pa.Table:
    """Items -> items with their split, label (from raw_label where the classes come from the
    labels), order hash `h` and `group` ("<split>/part-NNNNN", the shard they belong to);
    items of groups committed by an earlier attempt are dropped."""
    cols = batch.to_pydict()
    n = batch.num_rows
    split = [assign_split(k, s, val_fraction) for k, s in zip(cols["key"], cols["split"])]
    h = [shard_hash(seed, k) for k in cols["key"]]
    group = [f"{s}/part-{x % buckets[s]:05d}" for s, x in zip(split, h)]
    if label_index is not None:
        cols["label"] = [label_index.get(r, -1) if r else lab
                         for r, lab in zip(cols["raw_label"], cols["label"])]
    cols.update(split=split, h=h, group=group)
    keep = [i for i in range(n) if group[i] not in done]
    t = pa.table(cols)
    return t if len(keep) == n else t.take(keep)


def split_counts(batch: pa.Table, val_fraction: float) -> pa.Table:
    """One row per block: inputs per split and the distinct raw labels (the driver sums)."""
    cols = batch.to_pydict()
    n = {"train": 0, "val": 0}
    for k, s in zip(cols["key"], cols["split"]):
        n[assign_split(k, s, val_fraction)] += 1
    raw = sorted({r for r in cols["raw_label"] if r})
    return pa.table({"train": [n["train"]], "val": [n["val"]], "raw": [json.dumps(raw)]})


def write_group(batch: pa.Table, root: str, decode: dict) -> pa.Table:
    """All rows of one shard (Ray Data map_groups) -> the shard, its quarantine part and its
    commit record, written from here to `root`; returns the record (one row, JSON)."""
    import ray  # lazy: ray (the per-row functions are used without it)

    rows = batch if "reason" in batch.column_names else process_rows(batch, **decode)
    c = rows.to_pydict()
    order = sorted(range(rows.num_rows), key=lambda i: (c["h"][i], c["key"][i], c["label"][i], c["path"][i]))
    group = c["group"][0]
    split, name = group.split("/")
    fs, base = filesystem(root)
    good = [i for i in order if not c["reason"][i]]
    bad = [i for i in order if c["reason"][i]]
    rec = {"group": group, "file": "", "rows": len(good), "quarantined": len(bad),
           "per_class": dict(Counter(str(c["label"][i]) for i in good)),
           "reasons": dict(Counter(c["reason"][i] for i in bad)), "quarantine_file": "",
           "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""}
    if good:
        data, groups = sh.encode_shard({k: [c[k][i] for i in good] for k in sh.SHARD_SCHEMA.names})
        rec.update(file=f"{group}.parquet", bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                   labels=[min(c["label"][i] for i in good), max(c["label"][i] for i in good)],
                   row_groups=groups)
        sh.write_atomic(fs, join(base, rec["file"]), data)
    if bad:
        rec["quarantine_file"] = f"{sh.QUARANTINE_PARTS}/{split}-{name}.parquet"
        qrows = [{"path": c["path"][i], "reason": c["reason"][i], "detail": c["detail"][i],
                  "key": c["key"][i]} for i in bad]
        sh.write_atomic(fs, join(base, rec["quarantine_file"]), sh.quarantine_bytes(qrows))
    sh.write_atomic(fs, join(base, sh.RECORDS, f"{split}-{name}.json"), json.dumps(rec).encode())
    return pa.table({"record": [json.dumps(rec)]})
