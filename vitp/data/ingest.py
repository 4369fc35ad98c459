"""Training and eval ingest: Parquet shards -> Ray Data (shuffle, augment on CPU workers: augment.py) -> device.
Owns the epoch streams (deterministic from (seed, epoch, key); each Train worker its own share,
resumable right after the rows it consumed), the eval transform, and the last hop: uint8
batches to the device, normalised there. Must not know models.
"""
from __future__ import annotations

import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa

from ..config import Run
from ..config.augreg import randaug_of
from ..errors import InputError
from ..storage import is_uri, join, open_input
from . import shards as sh
from .position import RankStream, Segment, current_segment, with_world
from .augment import augment_rows
from .decode import decode_stored, resize_center_crop
from .parquet import open_parquet


def train_rows_per_epoch(run: Run) -> int:
    """Training images per epoch, from the shards' manifest."""
    return int(sh.read_manifest(run.shards)["counts"]["train"])


# A read unit is (shard path, first row, stop row): up to UNIT_ROWS consecutive rows of one
# shard that one Ray task reads, permutes and augments. The epoch shuffle is a seeded
# permutation of units plus a seeded permutation of rows inside each unit; preprocess wrote
# rows in hash order, so every unit is already a class-mixed sample. No all-to-all shuffle.
# A unit is also one output block: 256 x 150 KB = 38 MB at 224 px. Ray tasks read several
# units (TASK_ROWS below); with 2048-row tasks, 128- and 256-row units streamed at the same
# rate on 2 CPUs (benchmarks/RESULTS.md).
UNIT_ROWS = 256


def plan_units(root: str, split: str, manifest: dict, unit_rows: int = UNIT_ROWS) -> list[tuple]:
    """The read units of `split`, in shard order: [(path, start, stop), ...]."""
    units = []
    for s in manifest["shards"].get(split, []):
        path = join(root, s["file"])
        for a in range(0, s["rows"], unit_rows):
            units.append((path, a, min(s["rows"], a + unit_rows)))
    return units


_CHECKED: set[tuple[str, str]] = set()  # (shards, split) whose every file passed, in this process


def check_shard_files(root: str, split: str, manifest: dict) -> None:
    """Every shard file of `split` passes the schema check (parquet.py) before a Ray task reads a
    row: a refusal raised here, in the worker, ends the run at once with its own line, where one
    raised in a read task would reach the worker wrapped and be retried as a fault. Footers only,
    16 at a time; each read task checks its file again as it opens it (_read_unit)."""
    if (root, split) in _CHECKED:
        return

    def one(s: dict) -> None:
        path = join(root, s["file"])
        with (open_input(path) if is_uri(path) else pa.OSFile(path)) as f:
            open_parquet(f, path, sh.SHARD_COLUMNS)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, manifest["shards"].get(split, [])))
    _CHECKED.add((root, split))


def _read_unit(unit: tuple, storage_format: str = "uint8") -> dict:
    """Rows [start, stop) of a shard -> numpy columns height, width, label, key, and image:
    for uint8 shards an (n, H, W, 3) view of the Parquet page buffer when every row is a raw
    H x W image (what preprocess writes), else an object array of per-row bytes (JPEG shards,
    mixed sizes). Only the row groups that overlap the range are read; local files go through
    Arrow's own reader."""
    path, a, b = unit
    with (open_input(path) if is_uri(path) else pa.OSFile(path)) as f:
        pf = open_parquet(f, path, sh.SHARD_COLUMNS)
        md = pf.metadata
        groups, first, row = [], None, 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if row < b and row + n > a:
                groups.append(g)
                first = row if first is None else first
            row += n
        ours = [n for n in sh.SHARD_COLUMNS if n in pf.schema_arrow.names]  # what the schema check covered
        t = pf.read_row_groups(groups, columns=ours) if groups else pa.table({})
    t = t.slice(a - (first or 0), b - a)
    out = {n: t.column(n).to_numpy(zero_copy_only=False) for n in t.column_names if n != "image"}
    if "image" in t.column_names:
        col = t.column("image")
        out["image"] = (_image_column(col, out.get("height"), out.get("width"))
                        if storage_format == "uint8" else col.to_numpy(zero_copy_only=False))
    return out


def _image_column(col, heights, widths):
    """A binary column -> (n, H, W, 3) uint8 without copying when every cell is exactly
    H * W * 3 bytes, else an object array of bytes (JPEG cells, mixed sizes)."""
    col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(col)
    if n and heights is not None and col.null_count == 0 and pa.types.is_binary(col.type):
        h, w = int(heights[0]), int(widths[0])
        item = h * w * 3
        offsets = np.frombuffer(col.buffers()[1], dtype=np.int32, count=n + 1, offset=col.offset * 4)
        if h > 0 and w > 0 and (heights == h).all() and (widths == w).all() and \
                (np.diff(offsets) == item).all():
            data = np.frombuffer(col.buffers()[2], dtype=np.uint8, count=n * item, offset=int(offsets[0]))
            return data.reshape(n, h, w, 3)
    return col.to_numpy(zero_copy_only=False)


class UnitReader:
    """Ray Data map_batches callable: ids of slots of one rank's stream -> augmented rows.

    Input rows are {"id": k} from ray.data.range; k is slot first_slot + k of the rank's
    RankStream (vitp.data.position): one unit, or the rest of one, of one epoch, so the whole
    multi-epoch stream is one lazy operator and any slot can be recomputed anywhere with the
    same result. A resumed stream starts mid-slot, less its first `skip_rows` rows (in their
    shuffled order), so nothing consumed is read again.
    """

    def __init__(self, units: list[tuple], stream: RankStream, size: int, mode: str,
                 scale_min: float, hflip: bool, storage_format: str, first_slot: int = 0,
                 skip_rows: int = 0, randaug: tuple[int, float] = (0, 0.0)):
        self.units, self.stream, self.first_slot, self.skip_rows = units, stream, first_slot, skip_rows
        self.kw = dict(size=size, mode=mode, scale_min=scale_min, hflip=hflip,
                       storage_format=storage_format, randaug=tuple(randaug))

    def __call__(self, batch: dict):
        for k in batch["id"]:
            u, epoch, skip = self.stream.slot(self.first_slot + int(k))
            rows = augment_rows(_read_unit(self.units[u], self.kw["storage_format"]),
                                seed=self.stream.seed, epoch=epoch,
                                shuffle_rows=self.stream.shuffle, **self.kw)
            skip += self.skip_rows if int(k) == 0 else 0
            if skip:
                rows = {c: v[skip:] for c, v in rows.items()}
            yield rows


def peek_rows(run: Run, split: str | tuple[str, ...] = "val", count: int = 4) -> dict:
    """The first `count` rows of `split` (or of the first of several that has rows), read straight
    from its first shard (no Ray, for a few pictures): {"stored": [(h, w, 3) uint8 as stored],
    "image": (n, S, S, 3) uint8 as evaluation sees them, "label": (n,) int64}."""
    root = run.shards
    manifest = sh.read_manifest(root)
    splits = (split,) if isinstance(split, str) else split
    units = next((u for s in splits if (u := plan_units(root, s, manifest, unit_rows=count))), [])
    if not units:
        raise InputError(f"{root}: no {' or '.join(splits)} rows to show")
    fmt = manifest["storage"]["format"]
    rows = _read_unit(units[0], fmt)
    stored = [decode_stored(rows["image"][i], int(rows["height"][i]), int(rows["width"][i]), fmt)
              for i in range(len(rows["key"]))]
    return {"stored": stored, "image": np.stack([resize_center_crop(s, run.cfg.data.image_size) for s in stored]),
            "label": np.asarray(rows["label"], dtype=np.int64)}


def unit_sizes(units: list[tuple]) -> np.ndarray:
    return np.fromiter((b - a for _, a, b in units), dtype=np.int64, count=len(units))


def resume_point(units: list[tuple], seed: int, epoch: int, offset: int, shuffle: bool = True,
                 rank: int = 0, world: int = 1) -> tuple[int, int]:
    """(first slot within `epoch`, rows of that slot to skip) for rank `rank`'s stream that
    resumes after `offset` of its rows of `epoch` were consumed."""
    return RankStream(unit_sizes(units), seed, Segment(world, 0, epoch), rank, shuffle).position(offset)


def default_unit_rows(rows_per_epoch: int, world: int) -> int:
    """Rows per read unit: UNIT_ROWS, less for small splits so each of `world` ranks gets at
    least 4 units. A run keeps the value it started with (TrainState.unit_rows)."""
    return max(1, min(UNIT_ROWS, rows_per_epoch // (4 * world)))


def epochs_needed(rows_per_epoch: int, steps: int, global_batch: int) -> int:
    """Epochs so that `steps` optimizer steps of `global_batch` rows never run dry."""
    return max(1, math.ceil(steps * global_batch / max(rows_per_epoch, 1)))


def _stream(run: Run, split: str, start_epoch: int, num_epochs: Optional[int], train: bool,
            unit_rows: Optional[int], start_offset: int = 0, rank: int = 0, world: int = 1,
            consumed: Optional[int] = None, resume: Optional[dict] = None):
    import ray  # lazy: ray (peek_rows / normalize are used without it)

    cfg, root = run.cfg, run.shards
    d = cfg.data
    manifest = sh.read_manifest(root)
    rows_per_epoch = manifest["counts"][split]
    if resume and resume.get("unit_rows"):
        unit_rows = int(resume["unit_rows"])
    elif unit_rows is None:
        unit_rows = default_unit_rows(rows_per_epoch, world)
    units = plan_units(root, split, manifest, unit_rows)
    check_shard_files(root, split, manifest)
    if not units:
        raise InputError(f"{root}: manifest lists no {split} shards ({manifest['counts']}); "
                         "check data.val_fraction or the source")
    if len(units) < world:
        raise InputError(f"{root}: {rows_per_epoch} {split} images cannot feed {world} workers; "
                         "lower parallel.num_workers or add data")
    sizes = unit_sizes(units)
    seg = Segment(world, 0, start_epoch)
    if resume:  # a run's data position: the worker counts it ran with and samples it consumed
        seen = int(resume["samples_seen"])
        seg = current_segment(sizes, cfg.train.seed, with_world(resume.get("worlds"), world, seen),
                              resume["dealing"])
        consumed = (seen - seg.start) // world
    stream = RankStream(sizes, cfg.train.seed, seg, rank, shuffle=train)
    first_slot, skip_rows = stream.position(consumed if consumed is not None else start_offset)
    if num_epochs is None:
        # each rank gets at least floor(units / world) units an epoch, so at least the rows of
        # that many of the smallest units: epochs for that share, +1 for a part-consumed one
        # (epochs past what training reads are never read)
        share = int(np.sort(sizes)[:len(units) // world].sum()) if world > 1 else rows_per_epoch
        num_epochs = epochs_needed(share * world, cfg.train.steps, cfg.parallel.global_batch) + \
            (1 if world > 1 else 0) if train else 1
    total = stream.epoch_start(seg.first_epoch + num_epochs) - first_slot
    reader = UnitReader(units, stream, size=d.image_size, mode=d.augment if train else "none",
                        scale_min=d.crop_scale_min, hflip=d.hflip and train,
                        storage_format=manifest["storage"]["format"],
                        first_slot=first_slot, skip_rows=skip_rows,
                        randaug=randaug_of(cfg) if train else (0, 0.0))
    return ray.data.range(total, override_num_blocks=num_read_tasks(total, unit_rows)).map_batches(
        reader, batch_size=None, batch_format="numpy")


# Rows one Ray task reads and augments: it yields them unit by unit (one block per unit), so
# memory per task stays one unit. Ray Data's scheduler leaves CPU slots idle between tasks
# (each new task waits for a scheduling round and a budget update), so short tasks waste
# cores: on 2 CPUs, 2048-row tasks streamed up to ~1.4x more 224 px crops per second than
# one-unit tasks (benchmarks/RESULTS.md). Ray Data's other defaults stay: its per-operator
# reservation is what bounds the blocks a slow (GPU-bound) consumer leaves in the object store.
TASK_ROWS = 2048


def num_read_tasks(total_slots: int, unit_rows: int) -> int:
    """Ray tasks for a stream of `total_slots` units: about TASK_ROWS rows each, but at least
    two per cluster CPU while there are slots for them, and at most 20,000."""
    import ray  # lazy: ray (peek_rows / normalize are used without it)

    per_task = max(1, TASK_ROWS // max(unit_rows, 1))
    tasks = -(-total_slots // per_task)
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    return max(1, min(total_slots, 20_000, max(tasks, 2 * cpus)))


def build_train_dataset(run: Run, start_epoch: int = 0, num_epochs: Optional[int] = None,
                        unit_rows: Optional[int] = None, start_offset: int = 0, rank: int = 0,
                        world: int = 1, consumed: Optional[int] = None, resume: Optional[dict] = None):
    """The training stream of rank `rank` of `world` (each rank its own disjoint share of every
    epoch): epochs start_epoch .. start_epoch + num_epochs - 1 back to back, beginning
    `start_offset` rows into start_epoch's order, or, given `consumed` (rows this rank already
    took at this world size), right after them; given `resume` (a run's TrainState: samples_seen,
    worlds, unit_rows), after what the run consumed with whatever worker counts it had.

    Rows: {"image" uint8 (S, S, 3), "label" int64, "epoch" int64, "key" str}. Default
    num_epochs covers train.steps x parallel.global_batch rows. Training hands rank r its
    stream through RankStreams (vitp.train.streams).
    """
    return _stream(run, "train", start_epoch, num_epochs, train=True, unit_rows=unit_rows,
                   start_offset=start_offset, rank=rank, world=world, consumed=consumed,
                   resume=resume)


def build_eval_dataset(run: Run, split: str = "val", unit_rows: Optional[int] = UNIT_ROWS):
    """Eval rows: resize + centre crop to S, shard order, no randomness; same columns (epoch 0)."""
    return _stream(run, split, 0, 1, train=False, unit_rows=unit_rows)


# ------------------------------------------------------------------------- on the device


def normalize(images_uint8_bhwc, mean: Sequence[float] = (0.5, 0.5, 0.5),
              std: Sequence[float] = (0.5, 0.5, 0.5), dtype=None):
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float: (x / 255 - mean) / std on x's device.

    Computed as x * a + b (one convert, two in-place passes) on a permuted view: memory stays
    channels-last, which conv2d (the patch embedding) reads as fast as contiguous NCHW; call
    .contiguous() if you need NCHW.
    """
    import torch  # lazy: torch (vitp preprocess imports this module and needs none)

    dtype = dtype or torch.float32
    if (images_uint8_bhwc.device.type == "cpu" and images_uint8_bhwc.dtype == torch.uint8
            and dtype == torch.float32):
        # numpy's uint8 -> float32 cast is ~3x faster than torch's CPU kernel (0.06 vs 0.2
        # ms per 224 px image on one core); the result is the same
        x = torch.from_numpy(images_uint8_bhwc.numpy().astype(np.float32))
    else:
        x = images_uint8_bhwc.to(dtype)
    x = x.permute(0, 3, 1, 2)  # (B, 3, H, W) view, channels-last
    if len(set(mean)) == 1 and len(set(std)) == 1:  # scalar ops: ~2x faster than per-channel
        return x.mul_(1.0 / (255.0 * std[0])).add_(-mean[0] / std[0])
    s = torch.tensor(std, dtype=torch.float64)
    a = (1.0 / (255.0 * s)).to(dtype=dtype, device=x.device).view(1, 3, 1, 1)
    b = (-torch.tensor(mean, dtype=torch.float64) / s).to(dtype=dtype, device=x.device).view(1, 3, 1, 1)
    return x.mul_(a).add_(b)


def iter_device_batches(data_iterator, batch_size: int, device, dtype=None,
                        mean: Sequence[float] = (0.5, 0.5, 0.5), std: Sequence[float] = (0.5, 0.5, 0.5),
                        drop_last: bool = True, prefetch_batches: int = 2,
                        raw: bool = False, on_keys=None) -> Iterator[tuple]:
    """Yield (images (B, 3, S, S) `dtype` normalised on `device`, labels (B,) int64 on `device`).

    `data_iterator`: a Ray DataIterator (ray.train.get_dataset_shard("train")) or a Dataset.
    Only uint8 crosses to the device (4x fewer bytes than float32); pinned for CUDA copies.
    raw=True yields the (B, S, S, 3) uint8 images as they arrived, for a step that normalises
    inside its own compiled graph; on CPU they can share Ray's read-only object-store memory,
    so treat them as read-only (normalise out of place). on_keys: called with each batch's
    sample keys and epochs as it is handed out.
    """
    import torch  # lazy: torch (vitp preprocess imports this module and needs none)

    dev = torch.device(device)
    dtype = dtype or torch.float32
    for batch in data_iterator.iter_batches(batch_size=batch_size, batch_format="numpy",
                                            drop_last=drop_last, prefetch_batches=prefetch_batches):
        if on_keys is not None:
            on_keys(batch["key"], batch["epoch"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only Arrow buffers: we never write
            imgs = torch.from_numpy(np.ascontiguousarray(batch["image"]))  # (B, S, S, 3) uint8
            labels = torch.from_numpy(np.asarray(batch["label"], dtype=np.int64))
        if dev.type == "cuda":
            imgs, labels = imgs.pin_memory(), labels.pin_memory()
        imgs = imgs.to(dev, non_blocking=True)
        labels = labels.to(dev, non_blocking=True)
        yield (imgs if raw else normalize(imgs, mean, std, dtype)), labels
