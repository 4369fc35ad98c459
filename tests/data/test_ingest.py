"""Training ingest: equal batches per Train worker, no duplicates within an epoch, few left
out (and different ones each epoch), deterministic augmentation, normalisation on the device."""
import dataclasses
import threading
from collections import Counter

import numpy as np
import pytest
import torch

from vitp.data.commands import run_preprocess
from vitp.data.augment import augment_rows
from vitp.data.ingest import (_read_unit, build_eval_dataset, build_train_dataset, iter_device_batches, normalize,
                              plan_units)
from vitp.data.shards import read_manifest
from vitp.config import Run

from .conftest import make_cfg

pytestmark = pytest.mark.ray
WORLD, BATCH = 2, 8


@pytest.fixture(scope="module")
def shards(ray_session, tmp_path_factory):
    """10 classes x 23 synthetic images at 24px, ~10% val: 207-ish train rows (odd on purpose)."""
    tmp = tmp_path_factory.mktemp("ingest")
    cfg = make_cfg(tmp, synth_images_per_class=23, storage_size=24, image_size=16,
                   shard_mb=0.1, val_fraction=0.1, crop_scale_min=0.35)
    res = run_preprocess(Run.of(cfg))
    return cfg, res


def split_keys(ds, world=WORLD, batch=BATCH):
    """Consume streaming_split(world, equal=True) concurrently, as Train workers do."""
    its = ds.streaming_split(world, equal=True)
    seen = [[] for _ in range(world)]

    def consume(i):
        for b in its[i].iter_batches(batch_size=batch, drop_last=True):
            seen[i].append([(int(e), k) for e, k in zip(b["epoch"], b["key"])])

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(world)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return seen


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
def test_streaming_split_equal_no_duplicates_left_out_changes(shards):
    cfg, res = shards
    n = res["train"]
    assert n % (WORLD * BATCH) != 0  # otherwise nothing is left out and the test proves less
    left = []
    for epoch in (0, 1):
        seen = split_keys(build_train_dataset(Run.of(cfg), start_epoch=epoch, num_epochs=1, unit_rows=16))
        assert len(seen[0]) == len(seen[1]) > 0  # equal batches per worker
        keys = [k for w in seen for b in w for (e, k) in b]
        assert all(e == epoch for w in seen for b in w for (e, _) in b)
        assert len(keys) == len(set(keys))  # nobody sees an example twice in an epoch
        all_keys = {r["key"] for r in build_eval_dataset(Run.of(cfg), "train").select_columns(["key"]).take_all()}
        assert set(keys) <= all_keys and len(all_keys) == n
        left.append(all_keys - set(keys))
        assert len(left[-1]) < WORLD * BATCH
    assert left[0] != left[1]  # the left-out examples change between epochs


def test_multi_epoch_stream_covers_each_epoch(shards):
    cfg, res = shards
    seen = split_keys(build_train_dataset(Run.of(cfg), num_epochs=3))
    assert len(seen[0]) == len(seen[1])
    per_epoch = Counter(e for w in seen for b in w for (e, _) in b)
    n = res["train"]
    # blocks arrive in completion order, so the cut (< one global batch at the stream's end)
    # can fall in any epoch; nothing else is lost
    assert set(per_epoch) == {0, 1, 2} and all(c <= n for c in per_epoch.values())
    assert 3 * n - WORLD * BATCH < sum(per_epoch.values()) <= 3 * n
    pairs = [p for w in seen for b in w for p in b]
    assert len(pairs) == len(set(pairs))
    # default length covers train.steps x global_batch rows
    cfg2 = cfg.replace(train=dataclasses.replace(cfg.train, steps=20),
                       parallel=dataclasses.replace(cfg.parallel, global_batch=32))
    assert build_train_dataset(Run.of(cfg2)).count() >= 20 * 32


def test_augmentation_deterministic_and_varies_by_epoch(shards):
    cfg, _ = shards

    def images(start):
        ds = build_train_dataset(Run.of(cfg), start_epoch=start, num_epochs=1)
        return {k: im for b in ds.iter_batches(batch_size=None) for k, im in zip(b["key"], b["image"])}

    a, b, c = images(0), images(0), images(1)
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)  # same seed + epoch: same pixels
    same = sum(np.array_equal(a[k], c[k]) for k in a)
    assert same < len(a) // 10  # another epoch: other crops/flips
    assert next(iter(a.values())).shape == (16, 16, 3)
    order0 = [k for b_ in build_train_dataset(Run.of(cfg), num_epochs=1).iter_batches(batch_size=None)
              for k in b_["key"]]
    order1 = [k for b_ in build_train_dataset(Run.of(cfg), start_epoch=1, num_epochs=1)
              .iter_batches(batch_size=None) for k in b_["key"]]
    assert order0 != order1 and sorted(order0) == sorted(order1)  # reshuffled each epoch


def test_eval_dataset_and_device_batches(shards):
    cfg, res = shards
    ds = build_eval_dataset(Run.of(cfg))
    batches = list(iter_device_batches(ds, 8, "cpu", drop_last=False))
    assert sum(len(y) for _, y in batches) == res["val"]
    # Ray formats batches on several threads: unless preserve_order is set, the one short
    # batch can come anywhere in the stream
    sizes = sorted((len(y) for _, y in batches), reverse=True)
    assert sizes[:-1] == [8] * (len(sizes) - 1) and 0 < sizes[-1] <= 8
    x, y = max(batches, key=lambda b: len(b[1]))
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert -1.0 <= x.min() and x.max() <= 1.0
    u8 = torch.tensor([[[[0, 255, 51]]]], dtype=torch.uint8)  # (1, 1, 1, 3)
    out = normalize(u8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert out.shape == (1, 3, 1, 1) and torch.allclose(out.flatten(), torch.tensor([-1.0, 1.0, -0.6]))
    assert normalize(u8, (0, 0, 0), (1, 1, 1), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_unit_read_is_a_view_of_the_pages_and_matches_row_decode(shards):
    """uint8 shards come back as one (n, S, S, 3) array over the Parquet buffer, row for row
    the bytes preprocess wrote; JPEG-like cells (objects) take the per-row path, same output."""
    import pyarrow.parquet as pq

    from vitp.config import Run

    cfg, _ = shards
    root = Run.of(cfg).shards
    units = plan_units(root, "train", read_manifest(root), unit_rows=16)
    path, a, b = units[1]
    rows = _read_unit(units[1])
    # JPEG shards never take the view, even where a cell happens to be H * W * 3 bytes long
    assert _read_unit(units[1], "jpeg")["image"].dtype == object
    assert rows["image"].shape == (b - a, 24, 24, 3) and rows["image"].dtype == np.uint8
    t = pq.read_table(path).slice(a, b - a)
    for i, cell in enumerate(t.column("image").to_pylist()):
        assert rows["image"][i].tobytes() == cell
    assert list(rows["key"]) == t.column("key").to_pylist()
    as_objects = dict(rows, image=np.array([im.tobytes() for im in rows["image"]], dtype=object))
    kw = dict(size=16, mode="inception_crop", scale_min=0.35, hflip=True, seed=3, epoch=2,
              storage_format="uint8", shuffle_rows=True)
    x, y = augment_rows(rows, **kw), augment_rows(as_objects, **kw)
    assert (x["image"] == y["image"]).all() and list(x["key"]) == list(y["key"])


def test_read_tasks_sized_for_cpus_and_rows(ray_session):
    """About TASK_ROWS rows per Ray task, at least two tasks per CPU when there are units for
    them, never more tasks than units."""
    import ray

    from vitp.data.ingest import TASK_ROWS, num_read_tasks

    cpus = int(ray.cluster_resources()["CPU"])
    assert num_read_tasks(10_000, 256) == -(-10_000 // (TASK_ROWS // 256))
    assert num_read_tasks(3 * cpus, 256) == 2 * cpus  # few units: spread over the CPUs
    assert num_read_tasks(1, 256) == 1 and num_read_tasks(5, 16) == min(5, 2 * cpus)
    assert num_read_tasks(10 ** 7, 16) == 20_000


def test_each_train_worker_gets_its_own_stream_of_whole_batches(shards):
    """What Train's workers get: the streams RankStreams (the DataConfig the trainer passes Train)
    hands each rank, consumed at once as the workers do (configure() is what Train calls; no
    Train run is needed for it): each rank has whole batches for every step of the run, as host
    and as device batches, and within an epoch no key reaches two ranks. Each stream may use its
    equal part of the CPUs the Train workers leave, no more (so no stream takes them all)."""
    import ray

    from vitp.train.streams import RankStreams, train_placeholder

    cfg, _ = shards
    streams = RankStreams(cfg.to_dict()).configure({"train": train_placeholder()}, WORLD, None, [None] * WORLD)
    spare = ray.cluster_resources()["CPU"] - WORLD * cfg.parallel.cpus_per_worker
    for r in range(WORLD):
        limits = streams[r]["train"]._base_dataset.context.execution_options.resource_limits
        assert limits.cpu == max(1, spare // WORLD) and limits.cpu * WORLD <= max(spare, WORLD)
    out: list = [None] * WORLD

    def consume(r):
        it = streams[r]["train"]
        batches = [list(zip(b["epoch"].tolist(), b["key"].tolist()))
                   for b in it.iter_batches(batch_size=BATCH, drop_last=True)]
        devices = sum(1 for _ in iter_device_batches(it, BATCH, "cpu"))  # a second pass, on the device path
        out[r] = batches, devices

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(WORLD)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    steps_rows = cfg.train.steps * cfg.parallel.global_batch // WORLD  # what each rank trains on
    for batches, devices in out:
        assert len(batches) * BATCH >= steps_rows and devices == len(batches)
    pairs = [p for batches, _ in out for b in batches for p in b]
    assert len(pairs) == len(set(pairs))  # no (epoch, key) twice, within a rank or across ranks


def _ordered_keys(ds) -> list[tuple[int, str]]:
    ds.context.execution_options.preserve_order = True  # what Train's DataConfig sets for "train"
    return [(int(e), k) for b in ds.iter_batches(batch_size=None) for e, k in zip(b["epoch"], b["key"])]


def test_resumed_stream_starts_at_the_data_position(shards, unit_rows=16):
    """A stream resumed at (epoch, offset) is the uninterrupted stream from that position on:
    same keys in the same order, same pixels, and nothing before it is read (the first unit
    read is the one holding the position, not the epoch's first)."""
    from vitp.data.ingest import UnitReader, resume_point, unit_sizes
    from vitp.config import Run
    from vitp.data.position import RankStream, Segment

    cfg, res = shards
    n = res["train"]
    full = _ordered_keys(build_train_dataset(Run.of(cfg), start_epoch=0, num_epochs=2, unit_rows=unit_rows))
    assert len(full) == 2 * n
    for offset in (1, (3 * n) // 4, n - 1):  # inside the first unit, mid-epoch, its last row
        resumed = _ordered_keys(build_train_dataset(Run.of(cfg), start_epoch=0, num_epochs=2,
                                                    unit_rows=unit_rows, start_offset=offset))
        assert resumed == full[offset:], offset
    later = _ordered_keys(build_train_dataset(Run.of(cfg), start_epoch=1, num_epochs=1, unit_rows=unit_rows,
                                              start_offset=5))
    assert later == full[n + 5:]
    # the reader starts at the unit holding the offset: units before it are never read
    units = plan_units(Run.of(cfg).shards, "train", read_manifest(Run.of(cfg).shards), unit_rows)
    slot, skip = resume_point(units, cfg.train.seed, 0, (3 * n) // 4)
    assert slot > 0 and 0 <= skip < unit_rows
    stream = RankStream(unit_sizes(units), cfg.train.seed, Segment(1), 0)
    reader = UnitReader(units, stream, 16, "none", 1.0, False, "uint8", first_slot=slot, skip_rows=skip)
    first = next(reader({"id": np.array([0])}))
    assert [(0, k) for k in first["key"]] == full[(3 * n) // 4:(3 * n) // 4 + len(first["key"])]


@pytest.mark.parametrize("world", [2, 3])
def test_rank_streams_partition_each_epoch_and_resume_at_any_count(shards, world):
    """Each rank reads its own share of every epoch (disjoint, together the whole epoch) and a
    rank resumed after `consumed` of its rows continues its uninterrupted stream exactly, across
    an epoch boundary too: no row read twice, none skipped."""
    cfg, res = shards
    n = res["train"]
    full = [_ordered_keys(build_train_dataset(Run.of(cfg), num_epochs=2, rank=r, world=world, unit_rows=8))
            for r in range(world)]
    for epoch in (0, 1):
        keys = [k for f in full for e, k in f if e == epoch]
        assert len(keys) == len(set(keys)) == n, epoch  # a partition of the epoch
    assert full[0][:3] != full[1][:3]
    for r in range(world):
        own = len([1 for e, _ in full[r] if e == 0])  # this rank's rows in epoch 0
        for consumed in (5, own - 1, own + 3):  # mid-unit, the epoch's last row, into epoch 1
            resumed = _ordered_keys(build_train_dataset(Run.of(cfg), num_epochs=2, rank=r, world=world,
                                                        unit_rows=8, consumed=consumed))
            rest = full[r][consumed:]  # (epochs 0-1; a stream resumed in epoch 1 reads on into 2)
            assert rest and resumed[:len(rest)] == rest, (r, consumed)


def test_randaug_is_a_function_of_seed_epoch_and_key_at_any_world_size(shards):
    """RandAugment draws from each row's own RNG after its crop and flip: the same pixels for a key
    whichever rank reads it, at one worker or two, and after a resume mid-stream."""
    cfg, _ = shards
    ra = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, randaug_layers=2, randaug_magnitude=15.0))

    def images(c, **kw):
        ds = build_train_dataset(Run.of(c), num_epochs=1, unit_rows=8, **kw)
        return {(int(e), k): im for b in ds.iter_batches(batch_size=None)
                for e, k, im in zip(b["epoch"], b["key"], b["image"])}

    one, plain = images(ra), images(cfg)
    assert one.keys() == plain.keys()
    assert sum(np.array_equal(one[k], plain[k]) for k in one) < len(one) // 10  # RandAugment changed them
    two = {**images(ra, rank=0, world=2), **images(ra, rank=1, world=2)}
    assert two.keys() == one.keys() and all(np.array_equal(two[k], one[k]) for k in one)
    resumed = images(ra, rank=1, world=2, consumed=5)
    assert resumed and all(np.array_equal(im, one[k]) for k, im in resumed.items())
