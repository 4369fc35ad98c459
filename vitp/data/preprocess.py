"""Preprocess, its driver: a source plan -> Ray Data (list, group by a (seed, key) hash into shards,
read, decode, validate, resize, write: the tasks' functions are rows.py) -> shards written by the
workers; the driver sees only metadata, and writes classes.json and the manifest last. Shards are
byte-identical for any worker count and committed one by one (resume=True writes the missing ones).
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import pyarrow.fs as pafs

from ..console import get_logger, progress
from ..errors import InputError
from ..storage import join
from . import shards as sh
from .decode import DEFAULT_MAX_PIXELS
from .rows import assign_groups, process_rows, split_counts, subset_train, write_group
from .sources import Plan, classes_from_labels, expand_unit

_log = get_logger(__name__)

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


@dataclass(frozen=True)
class ShardSpec:
    """What the shards hold: each image as stored (`decode`: side, format, JPEG quality, the pixel
    bound, the class count, the corpus seed), and how the inputs split and group into shards."""

    size: int  # stored image side (resize + centre crop)
    storage_format: str = "uint8"
    jpeg_quality: int = 95
    max_pixels: int = DEFAULT_MAX_PIXELS  # a larger decoded image is quarantined
    num_classes: Optional[int] = None  # None: the classes the source names
    seed: int = 0  # the corpus's seed: the (seed, key) hash that places a row in a shard
    val_fraction: float = 0.02
    train_fraction: float = 1.0  # the part of the train split kept
    shard_mb: float = 256

    def decode(self, num_classes: int) -> dict:
        """What each shard-writing task decodes and stores an image by."""
        return dict(size=self.size, storage_format=self.storage_format, jpeg_quality=self.jpeg_quality,
                    max_pixels=self.max_pixels, num_classes=num_classes, synth_seed=self.seed)


def preprocess(plan: Plan, out_dir: str, spec: ShardSpec, *, overwrite: bool = False, resume: bool = False,
               rows_per_task: int = 128, manifest_extra: Optional[dict] = None,
               log: Callable[[str], None] = _log.info) -> dict:
    """Run the whole preprocess and return the summary (also the manifest's `counts`).

    The driver lists directories/files (the plan), then Ray Data: listing tasks -> items ->
    group by shard -> per shard one task reads, decodes and writes it to `out_dir`. Only
    per-block counts and per-shard records come back here; no image bytes.
    """
    t0 = time.time()
    fs, base = sh.prepare_output(out_dir, overwrite, resume)
    if resume and fs.get_file_info(join(base, "manifest.json")).type == pafs.FileType.File:
        m = sh.read_manifest(out_dir)
        log(f"{out_dir}: already complete ({m['counts']['written']} images); nothing to resume")
        return _summary(out_dir, m, time.time() - t0)
    items, per_split, raw_labels = _listing(plan, out_dir, spec, rows_per_task)
    n_in = sum(per_split.values())
    classes, label_index = plan.classes, None
    if classes is None:
        classes = classes_from_labels(raw_labels, plan.label_order, spec.num_classes)
        label_index = {c: i for i, c in enumerate(classes)}
    decode = spec.decode(spec.num_classes or len(classes))
    target = spec.shard_mb * (1 << 20)
    buckets = {s: max(1, math.ceil(per_split[s] * _stored_bytes(spec.size, spec.storage_format) / target))
               for s in sh.SPLITS}
    sh.begin_run(fs, base, out_dir, {**decode, "val_fraction": spec.val_fraction, "seed": spec.seed,
                                     "train_fraction": spec.train_fraction,
                                     "buckets": buckets, "inputs": n_in, "classes": len(classes)})
    records = sh.committed_records(fs, base) if resume else {}
    if records:
        log(f"preprocess: resuming: {len(records)} shards already committed")
    subset = f" (train split cut to {spec.train_fraction:.0%})" if spec.train_fraction < 1.0 else ""
    log(f"preprocess: {n_in} inputs{subset}, {len(classes)} classes -> up to {sum(buckets.values())} shards "
        f"(train {buckets['train']}, val {buckets['val']})")
    out = _shard_writes(items, plan, out_dir, spec, decode, buckets, label_index, records, rows_per_task)
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
    return _finish(out_dir, fs, base, records, classes, decode["num_classes"], n_in, plan, decode, t0,
                   manifest_extra, log)


def _listing(plan: Plan, out_dir: str, spec: ShardSpec, rows_per_task: int):
    """The plan's items (metadata, the train split cut to train_fraction), materialised; their
    counts per split; the raw labels they hold. InputError when there are none."""
    items = _items_dataset(plan, rows_per_task)
    if items is None:
        raise InputError(f"{out_dir}: the source listed no inputs; check data.path")
    if spec.train_fraction < 1.0:
        items = items.map_batches(subset_train, batch_size=None, batch_format="pyarrow", fn_kwargs={
            "val_fraction": spec.val_fraction, "train_fraction": spec.train_fraction})
    items = items.materialize()  # the listing (metadata only), read twice
    blocks = items.map_batches(split_counts, batch_size=None, batch_format="pyarrow",
                               fn_kwargs={"val_fraction": spec.val_fraction}).take_all()
    counts = {s: sum(b[s] for b in blocks) for s in sh.SPLITS}
    if sum(counts.values()) == 0:
        raise InputError(f"{out_dir}: the source listed no inputs; check data.path")
    return items, counts, {r for b in blocks for r in json.loads(b["raw"])}


def _shard_writes(items, plan: Plan, out_dir: str, spec: ShardSpec, decode: dict, buckets: dict,
                  label_index, records: dict, rows_per_task: int):
    """The Ray Data pipeline that writes the shards not yet committed: items -> groups -> (decoded
    where read, for a Parquet source) -> one task a shard; it yields each shard's record."""
    import ray  # lazy: ray (the per-row functions are used without it)
    from ray.data.context import ShuffleStrategy

    ds = items.map_batches(assign_groups, batch_size=None, batch_format="pyarrow", fn_kwargs=dict(
        val_fraction=spec.val_fraction, seed=spec.seed, buckets=buckets, label_index=label_index,
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
    return ds.groupby("group", num_partitions=parts).map_groups(
        write_group, batch_format="pyarrow", fn_kwargs={"root": out_dir, "decode": decode})


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
