"""Preprocess as the workers do it: counts reconcile over many shards and blocks, the shards do
not depend on the number of workers or the source's layout, and a SIGKILLed run finished with
--resume equals an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vitp.data.commands import run_preprocess
from vitp.data.shards import read_manifest, verify_checksums
from vitp.config import Run

from .conftest import make_cfg, read_shards, save, smooth_image

pytestmark = pytest.mark.ray
S = 24
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mixed_corpus(root, rng):
    """3 classes: small PNG/JPEG, photo-sized JPEGs (2400 x 1800: the draft-decode branch)
    and the broken kinds (zero bytes, text named .jpg, a truncated JPEG), plus a file at the
    top level (no class). Returns {relative path: expected quarantine reason or ""}."""
    expect = {}
    for c in ("cat", "dog", "eel"):
        for i in range(5):
            ext, fmt = (("png", "PNG"), ("jpg", "JPEG"))[i % 2]
            save(Image.fromarray(smooth_image(rng, 30 + 4 * i, 40)), root / c / f"s{i}.{ext}", fmt)
            expect[f"{c}/s{i}.{ext}"] = ""
        save(Image.fromarray(smooth_image(rng, 1800, 2400)), root / c / "photo.jpg", "JPEG", quality=90)
        expect[f"{c}/photo.jpg"] = ""
        (root / c / "zero.jpg").write_bytes(b"")
        (root / c / "text.jpg").write_text("not an image")
        (root / c / "cut.jpg").write_bytes((root / c / "photo.jpg").read_bytes()[:2000])
        expect.update({f"{c}/zero.jpg": "empty", f"{c}/text.jpg": "not_an_image",
                       f"{c}/cut.jpg": "truncated"})
    save(Image.fromarray(smooth_image(rng, 20, 20)), root / "stray.png")
    expect["stray.png"] = "bad_label"
    return expect


def as_parquet(corpus, out, expect):
    """The same inputs as a Parquet source: two files, row groups of 4 rows, key = the
    ImageFolder-relative path, label = the class name (the stray file has a null label)."""
    keys = sorted(expect)
    out.mkdir()
    for part, chunk in enumerate((keys[::2], keys[1::2])):
        t = pa.table({"key": chunk, "label": [k.split("/")[0] if "/" in k else None for k in chunk],
                      "image": [(corpus / k).read_bytes() for k in chunk]})
        pq.write_table(t, out / f"part-{part}.parquet", row_group_size=4)


def test_counts_reconcile_and_shards_do_not_depend_on_workers_or_layout(ray_session, tmp_path, rng):
    from ray.data import DataContext, ExecutionResources

    corpus = tmp_path / "corpus"
    expect = mixed_corpus(corpus, rng)
    data = dict(storage_size=S, image_size=S, num_classes=3, val_fraction=0.3, shard_mb=0.004)

    ctx = DataContext.get_current()
    saved = ctx.execution_options.resource_limits
    ctx.execution_options.resource_limits = ExecutionResources(cpu=1)  # one worker at a time
    try:
        one = run_preprocess(Run.of(make_cfg(tmp_path, source="imagefolder", path=str(corpus),
                                      shards=str(tmp_path / "one"), **data)),
                             rows_per_task=2, log=lambda s: None)
    finally:
        ctx.execution_options.resource_limits = saved
    run_preprocess(Run.of(make_cfg(tmp_path, source="imagefolder", path=str(corpus),
                                   shards=str(tmp_path / "many"), **data)), log=lambda s: None)

    # nothing lost: every input is written or quarantined, for the reason it has
    good = sum(1 for r in expect.values() if not r)
    assert one["input"] == len(expect) == one["written"] + one["quarantined"]
    assert one["written"] == good and one["reasons"] == {"empty": 3, "not_an_image": 3, "truncated": 3,
                                                         "bad_label": 1}
    m1, m2 = read_manifest(str(tmp_path / "one")), read_manifest(str(tmp_path / "many"))
    assert len(m1["shards"]["train"]) >= 3 and m1["shards"]["val"]  # many shards
    assert sum(s["rows"] for sp in ("train", "val") for s in m1["shards"][sp]) == good
    q = pq.read_table(tmp_path / "one" / "quarantine.parquet").to_pylist()
    assert {os.path.relpath(r["path"], corpus): r["reason"] for r in q} == \
        {k: v for k, v in expect.items() if v}

    # one worker with 2-row blocks vs all workers: byte-identical shards and quarantine list
    assert m1["shards"] == m2["shards"] and m1["counts"] == m2["counts"]
    assert (tmp_path / "one" / "quarantine.parquet").read_bytes() == \
        (tmp_path / "many" / "quarantine.parquet").read_bytes()
    assert verify_checksums(str(tmp_path / "one")) == []
    assert not {p.name for p in (tmp_path / "one").iterdir()} & {"_records", "_quarantine", "_run.json"}

    # the photo went through the draft decode (1/8 scale) and still matches a full decode
    back = read_shards(str(tmp_path / "one"))
    ref = Image.open(corpus / "dog" / "photo.jpg").convert("RGB")
    ref = np.asarray(ref.crop((300, 0, 2100, 1800)).resize((S, S), Image.BICUBIC)).astype(int)
    assert np.abs(back["dog/photo.jpg"][1].astype(int) - ref).mean() < 6

    # the same inputs from Parquet (images read by row group, decoded before the shuffle):
    # the same rows, labels, splits and pixels
    as_parquet(corpus, tmp_path / "pq", expect)
    pq_res = run_preprocess(Run.of(make_cfg(tmp_path, source="parquet", path=str(tmp_path / "pq"),
                                     shards=str(tmp_path / "from-pq"), **data)), log=lambda s: None)
    assert pq_res["written"] == good and pq_res["reasons"] == one["reasons"]
    back_pq = read_shards(str(tmp_path / "from-pq"))
    assert back_pq.keys() == back.keys()
    for k, (label, img, split) in back.items():
        assert back_pq[k][0] == label and back_pq[k][2] == split and np.array_equal(back_pq[k][1], img), k


def test_an_unfinished_preprocess_resumes_to_the_same_shards(ray_session, tmp_path, monkeypatch):
    """CI's form of the next test, without the kill: a run whose driver died before the manifest,
    with some of its shards' commits (records) and files gone, as a driver killed mid-run leaves
    them. It is refused without --resume and with other settings; --resume writes only what is
    missing and ends with the uninterrupted run's manifest."""
    import vitp.data.preprocess as preprocess
    from vitp.data.shards import RECORDS

    data = dict(storage_size=40, image_size=32, synth_classes=10, synth_images_per_class=24,
                val_fraction=0.2, shard_mb=0.02)
    full = run_preprocess(Run.of(make_cfg(tmp_path, shards=str(tmp_path / "full"), **data)), log=lambda s: None)
    out = tmp_path / "cut"
    cfg = make_cfg(tmp_path, shards=str(out), **data)

    def driver_dies(*args, **kwargs):
        raise KeyboardInterrupt("the driver died before the manifest")

    monkeypatch.setattr(preprocess, "_finish", driver_dies)
    with pytest.raises(KeyboardInterrupt):
        run_preprocess(Run.of(cfg), log=lambda s: None)
    monkeypatch.undo()
    records = sorted((out / RECORDS).glob("*.json"))
    assert len(records) == full["shards"] >= 6 and not (out / "manifest.json").exists(), records
    for n, record in enumerate(records[::2]):  # half never committed; of those, every other one's file
        shard = json.loads(record.read_text())["file"]  # was not written either
        record.unlink()
        if n % 2 and shard:
            (out / shard).unlink()
    committed = [json.loads(r.read_text())["file"] for r in records[1::2]]
    kept = len(list((out / RECORDS).glob("*.json")))
    before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.glob("*/part-*.parquet")}

    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        read_manifest(str(out))
    with pytest.raises(FileExistsError, match="--resume"):
        run_preprocess(Run.of(cfg), log=lambda s: None)
    with pytest.raises(ValueError, match="storage_format|size"):
        run_preprocess(Run.of(make_cfg(tmp_path, shards=str(out), **{**data, "storage_size": 36})), resume=True,
                       log=lambda s: None)
    lines = []
    res = run_preprocess(Run.of(cfg), resume=True, log=lines.append)
    assert any(f"resuming: {kept} shards already committed" in s for s in lines), "\n".join(lines)
    assert res["written"] == full["written"] and res["shards"] == full["shards"]
    m_full, m_res = read_manifest(str(tmp_path / "full")), read_manifest(str(out))
    for m in (m_full, m_res):
        m.pop("created"), m.pop("timings"), m.pop("config")
    assert m_res == m_full  # the same shards (checksums), counts, per-class counts
    after = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.glob("*/part-*.parquet")}
    assert all(after[f] == before[f] for f in committed if f), "a committed shard was written again"


@pytest.mark.long(reason="a SIGKILLed preprocessing process (its own local Ray); CI resumes one whose "
                         "driver died before the manifest (the test above)")
def test_killed_preprocess_resumes_to_the_same_shards(ray_session, tmp_path):
    data = dict(storage_size=96, image_size=32, synth_classes=10, synth_images_per_class=60,
                val_fraction=0.1, shard_mb=0.2)
    full = run_preprocess(Run.of(make_cfg(tmp_path, shards=str(tmp_path / "full"), **data)), log=lambda s: None)
    total = full["shards"]
    assert total >= 10

    # the same run as a CLI process (its own local Ray), SIGKILLed once about half its shards
    # are committed
    out = tmp_path / "killed"
    sets = [f"--set=data.{k}={v}" for k, v in data.items()] + [f"--set=work_dir={tmp_path}",
                                                              f"--set=data.shards={out}"]
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "vitp.cli", "preprocess", "debug", *sets],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    committed = lambda: len(list((out / "_records").glob("*.json"))) if (out / "_records").is_dir() else 0  # noqa: E731
    try:
        deadline = time.time() + 300
        while committed() < total // 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray it started
        log = proc.communicate()[0].decode(errors="replace")
    # a shard task already running when its driver died may still commit: wait until none does
    seen, still = committed(), time.time()
    while time.time() - still < 3:
        time.sleep(0.2)
        if committed() != seen:
            seen, still = committed(), time.time()
    before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.glob("*/part-*.parquet")}
    kept = committed()
    assert 0 < kept < total and not (out / "manifest.json").exists(), (kept, total, log[-3000:])

    # an unfinished run is neither read nor silently redone
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        read_manifest(str(out))
    cfg = make_cfg(tmp_path, shards=str(out), **data)
    with pytest.raises(FileExistsError, match="--resume"):
        run_preprocess(Run.of(cfg), log=lambda s: None)
    other = make_cfg(tmp_path, shards=str(out), **{**data, "storage_size": 64})
    with pytest.raises(ValueError, match="storage_format|size"):
        run_preprocess(Run.of(other), resume=True, log=lambda s: None)

    lines = []
    res = run_preprocess(Run.of(cfg), resume=True, log=lines.append)
    assert any(f"resuming: {kept} shards already committed" in s for s in lines), "\n".join(lines)
    assert res["written"] == full["written"] and res["quarantined"] == full["quarantined"] == 0
    m_full, m_res = read_manifest(str(tmp_path / "full")), read_manifest(str(out))
    for m in (m_full, m_res):
        m.pop("created"), m.pop("timings"), m.pop("config")
    assert m_res == m_full  # same shards (checksums), counts, per-class counts
    # committed shards were kept as they were: only the missing ones were written
    after = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.glob("*/part-*.parquet")}
    assert sum(after.get(name) == t for name, t in before.items()) >= kept
    assert json.loads((out / "classes.json").read_text()) == \
        json.loads((tmp_path / "full" / "classes.json").read_text())
