"""Preprocess: a source plan -> Ray Data (list, group by a (seed, key) hash into shards, read,
decode, validate, resize, write) -> shards written by the workers; the driver sees only metadata.
Shards are byte-identical for any worker count and committed one by one (resume=True writes the
missing ones). One bad file never drops another row: each is an image or a quarantine record.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from functools import lru_cache
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..console import get_logger, progress
from ..errors import InputError
from ..storage import filesystem, join, open_input
from . import shards as sh
from .decode import DEFAULT_MAX_PIXELS, DecodeError, decode_image, encode_jpeg, resize_center_crop
from .sources import Plan, classes_from_labels, expand_unit, image_column, read_image
from .synth import class_system, render

_log = get_logger(__name__)

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
            with open_input(path) as f:
                pf = pq.ParquetFile(f)
                col = pf.read_row_group(g, columns=[image_column(pf.schema_arrow.names)]).column(0)
        except OSError as e:
            for r in rs:
                r["error"] = f"unreadable: cannot read {path} ({e.__class__.__name__}: {e})"
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


# Stored bytes per image, to size the shard count before anything is decoded: raw pixels
# exactly; JPEG q95 4:4:4 of photos is ~1/5 of raw (benchmarks/RESULTS.md: 196 vs 37 KB).
def _stored_bytes(size: int, storage_format: str) -> float:
    return size * size * 3 * (1.0 if storage_format == "uint8" else 0.2) + 64


def _items_dataset(plan: Plan, rows_per_task: int):
    """The items as a Ray Dataset: listed by Ray tasks from the plan's units, or (small
    sources) from the plan's own items."""
    import ray  # lazy: ray

    parts = []
    if plan.units:
        units = ray.data.from_items(plan.units, override_num_blocks=min(len(plan.units), 2000))
        parts.append(units.flat_map(expand_unit))
    if plan.items:
        parts.append(ray.data.from_items(
            plan.items, override_num_blocks=max(1, min(-(-len(plan.items) // rows_per_task), 10_000))))
    if not parts:
        return None
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def preprocess(plan: Plan, out_dir: str, *, size: int, storage_format: str = "uint8",
               jpeg_quality: int = 95, shard_mb: float = 256, val_fraction: float = 0.02,
               num_classes: Optional[int] = None, overwrite: bool = False, resume: bool = False,
               max_pixels: int = DEFAULT_MAX_PIXELS, synth_seed: int = 0, train_fraction: float = 1.0,
               rows_per_task: int = 128,
               manifest_extra: Optional[dict] = None, log: Callable[[str], None] = _log.info) -> dict:
    """Run the whole preprocess and return the summary (also the manifest's `counts`).

    The driver lists directories/files (the plan), then Ray Data: listing tasks -> items ->
    group by shard -> per shard one task reads, decodes and writes it to `out_dir`. Only
    per-block counts and per-shard records come back here; no image bytes.
    """
    import ray  # lazy: ray (the per-row functions are used without it)
    from ray.data.context import ShuffleStrategy

    t0 = time.time()
    fs, base = sh.prepare_output(out_dir, overwrite, resume)
    if resume and fs.get_file_info(join(base, "manifest.json")).type == pafs.FileType.File:
        m = sh.read_manifest(out_dir)
        log(f"{out_dir}: already complete ({m['counts']['written']} images); nothing to resume")
        return _summary(out_dir, m, time.time() - t0)
    items = _items_dataset(plan, rows_per_task)
    if items is None:
        raise InputError(f"{out_dir}: the source listed no inputs; check data.path")
    if train_fraction < 1.0:
        items = items.map_batches(subset_train, batch_size=None, batch_format="pyarrow", fn_kwargs={
            "val_fraction": val_fraction, "train_fraction": train_fraction})
    items = items.materialize()  # the listing (metadata only), read twice below
    blocks = items.map_batches(split_counts, batch_size=None, batch_format="pyarrow",
                               fn_kwargs={"val_fraction": val_fraction}).take_all()
    per_split = {s: sum(b[s] for b in blocks) for s in sh.SPLITS}
    n_in = sum(per_split.values())
    if n_in == 0:
        raise InputError(f"{out_dir}: the source listed no inputs; check data.path")
    classes, label_index = plan.classes, None
    if classes is None:
        classes = classes_from_labels({r for b in blocks for r in json.loads(b["raw"])}, plan.label_order, num_classes)
        label_index = {c: i for i, c in enumerate(classes)}
    ncls = num_classes or len(classes)
    target = shard_mb * (1 << 20)
    buckets = {s: max(1, math.ceil(per_split[s] * _stored_bytes(size, storage_format) / target))
               for s in sh.SPLITS}
    decode = dict(size=size, storage_format=storage_format, jpeg_quality=jpeg_quality,
                  max_pixels=max_pixels, num_classes=ncls, synth_seed=synth_seed)
    sh.begin_run(fs, base, out_dir, {**decode, "val_fraction": val_fraction, "seed": synth_seed,
                                     "train_fraction": train_fraction,
                                     "buckets": buckets, "inputs": n_in, "classes": len(classes)})
    records = sh.committed_records(fs, base) if resume else {}
    if records:
        log(f"preprocess: resuming: {len(records)} shards already committed")
    subset = f" (train split cut to {train_fraction:.0%})" if train_fraction < 1.0 else ""
    log(f"preprocess: {n_in} inputs{subset}, {len(classes)} classes -> up to {sum(buckets.values())} shards "
        f"(train {buckets['train']}, val {buckets['val']})")
    ds = items.map_batches(assign_groups, batch_size=None, batch_format="pyarrow", fn_kwargs=dict(
        val_fraction=val_fraction, seed=synth_seed, buckets=buckets, label_index=label_index,
        done=frozenset(records)))
    if plan.decode_early:  # images stored in blocks (Parquet): decode where they are read,
        # a task per ~1,024 listed rows (in file order: each row group read about once)
        ds = ds.repartition(target_num_rows_per_block=max(rows_per_task, 1024)).map_batches(
            process_rows, batch_size=None, batch_format="pyarrow", fn_kwargs=decode)
    # Partitions spread the groups over the shard-writing tasks (a shard is one group either
    # way); the sort-based shuffle makes one per input block, hence the repartition. The rows
    # are metadata (but for Parquet sources): this shuffle, plain tasks, starts in a fraction
    # of the time the hash shuffle's aggregator actors take.
    cpus = int(ray.cluster_resources().get("CPU", 1))
    parts = max(1, min(sum(buckets.values()) - len(records), 4 * cpus, 200))
    ds = ds.repartition(parts)
    ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    out = ds.groupby("group", num_partitions=parts).map_groups(
        write_group, batch_format="pyarrow", fn_kwargs={"root": out_dir, "decode": decode})
    done0, t1, last = _inputs_of(records.values()), time.time(), time.time()
    for row in out.iter_rows():
        rec = json.loads(row["record"])
        records[rec["group"]] = rec
        if time.time() - last > 10:
            last = time.time()
            done = _inputs_of(records.values())
            rate = (done - done0) / max(last - t1, 1e-9)
            eta = f"{(n_in - done) / max(rate, 1e-9):.0f}s"
            progress(f"preprocess: {done}/{n_in} inputs in {len(records)} shards ({rate:.0f}/s, "
                     f"ETA {eta})", done, n_in, eta, log)
    return _finish(out_dir, fs, base, records, classes, ncls, n_in, plan, decode, t0,
                   manifest_extra, log)


def _inputs_of(records) -> int:
    return sum(r["rows"] + r["quarantined"] for r in records)


def _finish(out_dir, fs, base, records, classes, ncls, n_in, plan, decode, t0, manifest_extra, log):
    """Reconcile the records, merge the quarantine parts (in a Ray task), write classes.json
    and, last, the manifest."""
    import ray  # lazy: ray

    recs = sorted(records.values(), key=lambda r: r["group"])
    written = sum(r["rows"] for r in recs)
    quarantined = sum(r["quarantined"] for r in recs)
    if written + quarantined != n_in:  # the invariant the whole design exists for
        raise RuntimeError(f"{out_dir}: {n_in} inputs but {written} written + "
                           f"{quarantined} quarantined; this is a bug, please report it")
    parts = [r["quarantine_file"] for r in recs if r["quarantine_file"]]
    ray.get(ray.remote(sh.merge_quarantine).options(num_cpus=0.5).remote(out_dir, parts))
    sh.write_json(fs, base, "classes.json", {c: i for i, c in enumerate(classes)})
    shards = {s: [{k: r[k] for k in ("file", "rows", "bytes", "sha256", "labels", "row_groups")}
                  for r in recs if r["file"] and r["group"].startswith(s + "/")] for s in sh.SPLITS}
    per_class = {s: Counter() for s in sh.SPLITS}
    reasons: Counter = Counter()
    for r in recs:
        split = r["group"].split("/")[0]
        per_class[split].update({classes[int(k)]: v for k, v in r["per_class"].items()})
        reasons.update(r["reasons"])
    elapsed = time.time() - t0
    manifest = {
        "version": sh.MANIFEST_VERSION,
        "created": sh.now(),
        "source": plan.info.get("source", ""),
        "official_split": plan.official_split,
        "storage": {"format": decode["storage_format"], "size": decode["size"],
                    "jpeg_quality": decode["jpeg_quality"], "channels": 3, "dtype": "uint8"},
        "num_classes": ncls,
        "counts": {"input": n_in, "written": written, "quarantined": quarantined,
                   "train": sum(per_class["train"].values()), "val": sum(per_class["val"].values())},
        "per_class": {s: dict(sorted(per_class[s].items())) for s in sh.SPLITS},
        "quarantine": {"count": quarantined, "reasons": dict(sorted(reasons.items()))},
        "shards": shards,
        "bytes": sum(x["bytes"] for s in sh.SPLITS for x in shards[s]),
        "timings": {"seconds": round(elapsed, 3), "images_per_sec": round(n_in / max(elapsed, 1e-9), 1)},
        **(manifest_extra or {}),
        **{k: v for k, v in plan.info.items() if k != "source"},
    }
    sh.write_json(fs, base, "manifest.json", manifest)  # last: marks the run finished
    sh.remove_run_state(fs, base)
    res = _summary(out_dir, manifest, elapsed)
    res["nodes"] = dict(Counter(r["node"] for r in recs if r["node"]))  # shard tasks per node
    reason_txt = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"
    log(f"wrote {written} images in {res['shards']} shards ({res['bytes'] / 1e6:.1f} MB) to "
        f"{out_dir}; quarantined {quarantined}: {reason_txt}; {res['images_per_sec']:.0f} images/s; "
        f"written by {len(res['nodes'])} node(s)")
    return res


def _summary(out_dir: str, m: dict, seconds: float) -> dict:
    c = m["counts"]
    return {"out_dir": out_dir, "input": c["input"], "written": c["written"],
            "quarantined": c["quarantined"], "reasons": dict(m["quarantine"]["reasons"]),
            "shards": sum(len(v) for v in m["shards"].values()), "bytes": m["bytes"],
            "train": c["train"], "val": c["val"], "seconds": seconds,
            "images_per_sec": c["input"] / max(seconds, 1e-9)}
