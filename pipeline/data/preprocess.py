"""Preprocess: items -> (Ray Data workers: read, decode, validate, resize, encode) -> shards.

Owns the per-row worker function (one bad file never drops another row: every row comes back
either as an image or as a quarantine record) and the driver loop that routes rows to the
shard writers in a deterministic order. Must not know about models or training.
"""
from __future__ import annotations

import hashlib
import time
from collections import Counter
from functools import lru_cache
from typing import Callable, Optional

import numpy as np
import pyarrow as pa

from ..errors import InputError
from . import shards as sh
from .decode import DEFAULT_MAX_PIXELS, DecodeError, decode_image, encode_jpeg, resize_center_crop
from .sources import Listing, read_bytes
from .synth import class_system, render

OUT_SCHEMA = pa.schema([
    ("key", pa.string()), ("label", pa.int64()), ("split", pa.string()),
    ("image", pa.binary()), ("height", pa.int32()), ("width", pa.int32()),
    ("reason", pa.string()),   # "" = usable; else one of decode.REASONS
    ("detail", pa.string()), ("path", pa.string()),
])


def hash_fraction(key: str) -> float:
    """A key's position in [0, 1): sha1 of the file identity, independent of order and seed."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:12], 16) / float(1 << 48)


def assign_split(key: str, official: str, val_fraction: float) -> str:
    if official:
        return official
    return "val" if hash_fraction(key) < val_fraction else "train"


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
        return b"", "bad_label", f"label {row['label']} outside 0..{num_classes - 1}"
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
                    data = read_bytes(row["path"], row["offset"], row["length"])
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


def process_batch(batch: pa.Table, size: int, storage_format: str, jpeg_quality: int,
                  max_pixels: int, num_classes: int, val_fraction: float, synth_seed: int) -> pa.Table:
    """Ray Data map_batches fn: a block of items -> a block of OUT_SCHEMA rows, same count."""
    out: dict[str, list] = {n: [] for n in OUT_SCHEMA.names}
    for row in batch.to_pylist():
        image, reason, detail = _one(row, size, storage_format, jpeg_quality, max_pixels,
                                     num_classes, synth_seed)
        out["key"].append(row["key"])
        out["label"].append(row["label"])
        out["split"].append(assign_split(row["key"], row["split"], val_fraction))
        out["image"].append(image)
        out["height"].append(size if not reason else 0)
        out["width"].append(size if not reason else 0)
        out["reason"].append(reason)
        out["detail"].append(detail)
        out["path"].append(row["path"] or row["key"])
    return pa.table(out, schema=OUT_SCHEMA)


def _items_table(listing: Listing) -> list[dict]:
    # Order inputs by hash of key: deterministic, and every shard mixes classes (a sorted
    # ImageFolder would otherwise put one class per shard).
    return sorted(listing.items, key=lambda it: (hash_fraction(it["key"]), it["key"]))


def preprocess(listing: Listing, out_dir: str, *, size: int, storage_format: str = "uint8",
               jpeg_quality: int = 95, shard_mb: float = 256, val_fraction: float = 0.02,
               num_classes: Optional[int] = None, overwrite: bool = False,
               max_pixels: int = DEFAULT_MAX_PIXELS, synth_seed: int = 0, rows_per_task: int = 128,
               manifest_extra: Optional[dict] = None, log: Callable[[str], None] = print) -> dict:
    """Run the whole preprocess and return the summary (also the manifest's `counts`)."""
    import ray  # lazy: ray (the per-row functions are used without it)

    t0 = time.time()
    fs, base = sh.prepare_output(out_dir, overwrite)
    classes = listing.classes
    ncls = num_classes or len(classes)
    items = _items_table(listing)
    n_in = len(items)
    if n_in == 0:
        raise InputError(f"{out_dir}: the source listed no inputs; check data.path")
    n_blocks = max(1, min(-(-n_in // rows_per_task), 10_000))
    ds = ray.data.from_items(items, override_num_blocks=n_blocks).map_batches(
        process_batch, batch_size=None, batch_format="pyarrow", zero_copy_batch=True,
        fn_kwargs=dict(size=size, storage_format=storage_format, jpeg_quality=jpeg_quality,
                       max_pixels=max_pixels, num_classes=ncls, val_fraction=val_fraction,
                       synth_seed=synth_seed))
    # Shards must not depend on which worker finished first.
    ds.context.execution_options.preserve_order = True

    target = int(shard_mb * (1 << 20))
    writers = {s: sh.ShardWriter(fs, base, s, target) for s in sh.SPLITS}
    per_class = {s: Counter() for s in sh.SPLITS}
    quarantine: list[dict] = []
    reasons: Counter = Counter()
    seen, last = 0, time.time()
    for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        cols = block.to_pydict()
        for i in range(block.num_rows):
            if cols["reason"][i]:
                quarantine.append({"path": cols["path"][i], "reason": cols["reason"][i],
                                   "detail": cols["detail"][i], "key": cols["key"][i]})
                reasons[cols["reason"][i]] += 1
                continue
            split = cols["split"][i]
            writers[split].add(cols["image"][i], cols["height"][i], cols["width"][i],
                               cols["label"][i], cols["key"][i])
            per_class[split][classes[cols["label"][i]]] += 1
        seen += block.num_rows
        if time.time() - last > 10:
            last = time.time()
            log(f"preprocess: {seen}/{n_in} inputs ({seen / (last - t0):.0f}/s), "
                f"{len(quarantine)} quarantined")
    for w in writers.values():
        w.flush()
    written = sum(sum(c.values()) for c in per_class.values())
    if written + len(quarantine) != n_in:  # the invariant the whole design exists for
        raise RuntimeError(f"{out_dir}: {n_in} inputs but {written} written + "
                           f"{len(quarantine)} quarantined; this is a bug, please report it")
    sh.write_quarantine(fs, base, quarantine)
    sh.write_json(fs, base, "classes.json", {c: i for i, c in enumerate(classes)})
    elapsed = time.time() - t0
    shard_list = {s: writers[s].shards for s in sh.SPLITS}
    total_bytes = sum(x["bytes"] for s in sh.SPLITS for x in shard_list[s])
    counts = {"input": n_in, "written": written, "quarantined": len(quarantine),
              "train": sum(per_class["train"].values()), "val": sum(per_class["val"].values())}
    manifest = {
        "version": sh.MANIFEST_VERSION,
        "created": sh.now(),
        "source": listing.info.get("source", ""),
        "official_split": listing.official_split,
        "storage": {"format": storage_format, "size": size, "jpeg_quality": jpeg_quality,
                    "channels": 3, "dtype": "uint8"},
        "num_classes": ncls,
        "counts": counts,
        "per_class": {s: dict(sorted(per_class[s].items())) for s in sh.SPLITS},
        "quarantine": {"count": len(quarantine), "reasons": dict(sorted(reasons.items()))},
        "shards": shard_list,
        "bytes": total_bytes,
        "timings": {"seconds": round(elapsed, 3), "images_per_sec": round(n_in / max(elapsed, 1e-9), 1)},
        **(manifest_extra or {}),
        **{k: v for k, v in listing.info.items() if k != "source"},
    }
    sh.write_json(fs, base, "manifest.json", manifest)  # last: marks the run finished
    n_shards = sum(len(v) for v in shard_list.values())
    reason_txt = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"
    log(f"wrote {written} images in {n_shards} shards ({total_bytes / 1e6:.1f} MB) to {out_dir}; "
        f"quarantined {len(quarantine)}: {reason_txt}; {n_in / max(elapsed, 1e-9):.0f} images/s")
    return {"out_dir": out_dir, "input": n_in, "written": written, "quarantined": len(quarantine),
            "reasons": dict(reasons), "shards": n_shards, "bytes": total_bytes,
            "train": counts["train"], "val": counts["val"], "seconds": elapsed,
            "images_per_sec": n_in / max(elapsed, 1e-9)}
