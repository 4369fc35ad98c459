"""Preprocess end to end on real files with real Ray: round trip, the bad-input zoo,
determinism, overwrite and unfinished-run protection."""
import csv
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vitp.data.commands import run_preprocess
from vitp.data.preprocess import ShardSpec, preprocess
from vitp.data.shards import read_manifest, verify_checksums
from vitp.data.catalog import plan_source
from vitp.config import Run

from .conftest import make_cfg, read_shards, save, smooth_image

pytestmark = pytest.mark.ray
S = 32


def reference(path, size=S):
    """Independent Pillow: decode -> RGB -> resize the centred square box to size x size."""
    im = Image.open(path).convert("RGB")
    w, h = im.size
    if (w, h) == (size, size):
        return np.asarray(im)
    s = min(w, h)
    box = ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)
    return np.asarray(im.resize((size, size), Image.BICUBIC, box=box))


@pytest.fixture
def corpus(tmp_path, rng):
    """A 3-class ImageFolder of PNG/JPEG/BMP/TIFF/GIF/WEBP files, several sizes."""
    root = tmp_path / "corpus"
    files = []
    sizes = [(S, S), (48, 64), (100, 40), (S, S), (20, 20), (33, 47)]
    fmts = [("png", "PNG"), ("jpg", "JPEG"), ("bmp", "BMP"), ("tif", "TIFF"), ("gif", "GIF"),
            ("webp", "WEBP")]
    for c in ("cat", "dog", "eel"):
        for i, ((ext, fmt), (w, h)) in enumerate(zip(fmts, sizes)):
            arr = smooth_image(rng, h, w)
            im = Image.fromarray(arr)
            if fmt == "GIF":
                im = im.convert("P")
            files.append(save(im, root / c / f"{i:03d}.{ext}", fmt))
    return root, files


def test_round_trip_uint8_exact_and_jpeg_psnr(ray_session, tmp_path, corpus):
    root, files = corpus
    cfg = make_cfg(tmp_path, source="imagefolder", path=str(root), storage_size=S, image_size=S,
                   num_classes=3, val_fraction=0.3)
    res = run_preprocess(Run.of(cfg))
    assert res["input"] == res["written"] == 18 and res["quarantined"] == 0
    shards = str(tmp_path / "shards" / "imagefolder")
    classes = json.load(open(os.path.join(shards, "classes.json")))
    assert classes == {"cat": 0, "dog": 1, "eel": 2}
    back = read_shards(shards)
    assert len(back) == 18
    for f in files:
        key = f"{f.parent.name}/{f.name}"
        label, img, _ = back[key]
        assert label == classes[f.parent.name]
        assert np.array_equal(img, reference(f)), key  # uint8 path: exact
        if Image.open(f).size == (S, S) and f.suffix in (".png", ".bmp", ".tif"):
            assert np.array_equal(img, np.asarray(Image.open(f).convert("RGB")))  # lossless in = out
    assert {s for _, _, s in back.values()} == {"train", "val"}
    assert verify_checksums(shards) == []

    # the same corpus stored as JPEG q95: within 30 dB PSNR of the exact uint8 pixels
    cfg_j = make_cfg(tmp_path, source="imagefolder", path=str(root), storage_size=S, image_size=S,
                     num_classes=3, val_fraction=0.3, storage_format="jpeg", jpeg_quality=95,
                     shards=str(tmp_path / "jpeg"))
    run_preprocess(Run.of(cfg_j))
    jback = read_shards(str(tmp_path / "jpeg"))
    for key, (label, img, split) in back.items():
        j = jback[key][1].astype(np.float64)
        mse = np.mean((j - img.astype(np.float64)) ** 2)
        psnr = 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))
        assert jback[key][0] == label and jback[key][2] == split
        assert psnr > 30.0, (key, psnr)

    # ingest's eval path reads the same pixels back (image_size == storage_size: no resampling)
    from vitp.data.ingest import build_eval_dataset
    rows = {}
    for split in ("train", "val"):
        for b in build_eval_dataset(Run.of(cfg), split).iter_batches(batch_size=None):
            rows.update({k: (im, lab) for k, im, lab in zip(b["key"], b["image"], b["label"])})
    assert set(rows) == set(back)
    for k, (im, lab) in rows.items():
        assert np.array_equal(im, back[k][1]) and lab == back[k][0]


def make_zoo(tmp_path):
    """Every case of issue item 4 in one CSV-listed corpus; returns (csv path, expectations)."""
    z = tmp_path / "zoo"
    z.mkdir()
    good = np.zeros((S, S, 3), np.uint8)
    good[:, :, 1] = np.arange(S, dtype=np.uint8)[None, :] * 7
    save(Image.fromarray(good), z / "good.png")
    save(Image.fromarray(np.full((S, S), 90, np.uint8), "L"), z / "grey.png")
    save(Image.new("CMYK", (S, S), (0, 255, 255, 0)), z / "cmyk.tif")
    save(Image.new("CMYK", (S, S), (0, 255, 255, 0)), z / "cmyk.jpg", "JPEG", quality=98)
    rgba = np.zeros((S, S, 4), np.uint8)
    rgba[:, : S // 2] = (0, 0, 255, 255)  # left opaque blue, right transparent -> white
    save(Image.fromarray(rgba, "RGBA"), z / "rgba.png")
    pal = Image.fromarray(np.tile(np.array([[0, 1]], np.uint8), (S, S // 2)), "P")
    pal.putpalette([0, 0, 0, 250, 10, 10] + [0] * 762)
    save(pal, z / "palette.png", transparency=0)
    save(Image.fromarray(np.full((S, S), 65535, np.uint16)), z / "sixteen.png")
    rot = np.zeros((S, 2 * S, 3), np.uint8)  # (H, W) = (32, 64): left red, right blue
    rot[:, :S] = (255, 0, 0)
    rot[:, S:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    save(Image.fromarray(rot), z / "rotated.jpg", "JPEG", quality=98, exif=exif.tobytes())
    full = z / "full.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(full)
    (z / "truncated.jpg").write_bytes(full.read_bytes()[:600])
    full.unlink()
    (z / "zero.jpg").write_bytes(b"")
    (z / "text.jpg").write_text("not an image at all")
    save(Image.new("RGB", (400, 400)), z / "bomb.png")  # over the test's 100k-pixel limit
    rows = [("good.png", "a"), ("grey.png", "a"), ("cmyk.tif", "b"), ("cmyk.jpg", "b"),
            ("rgba.png", "a"), ("palette.png", "b"), ("sixteen.png", "a"), ("rotated.jpg", "b"),
            ("truncated.jpg", "a"), ("zero.jpg", "b"), ("text.jpg", "a"), ("bomb.png", "b"),
            ("missing/nowhere.png", "a"), ("good.png", "")]
    with open(z / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        w.writerows(rows)
    expect_q = {"truncated.jpg": "truncated", "zero.jpg": "empty", "text.jpg": "not_an_image",
                "bomb.png": "too_large", "missing/nowhere.png": "unreadable"}
    return z / "labels.csv", rows, expect_q


def test_bad_input_zoo_nothing_lost(ray_session, tmp_path, capsys):
    csv_path, rows, expect_q = make_zoo(tmp_path)
    plan = plan_source("csv", str(csv_path))
    out = tmp_path / "zoo_shards"
    res = preprocess(plan, str(out), ShardSpec(size=S, val_fraction=0.0, max_pixels=100_000),
                     rows_per_task=2)  # many small tasks: bad rows share blocks with good ones
    assert res["input"] == len(rows) == res["written"] + res["quarantined"]
    assert res["written"] == 8 and res["quarantined"] == 6
    q = pq.read_table(out / "quarantine.parquet").to_pylist()
    reasons = {os.path.relpath(r["path"], csv_path.parent) if os.path.isabs(r["path"]) else r["path"]: r["reason"]
               for r in q if r["reason"] != "bad_label"}
    assert reasons == expect_q
    assert [r["reason"] for r in q].count("bad_label") == 1
    assert all(r["detail"] for r in q)  # every quarantined row says why
    assert res["reasons"] == {"truncated": 1, "empty": 1, "not_an_image": 1, "too_large": 1,
                              "unreadable": 1, "bad_label": 1}
    from vitp.console import TEXT_LOG_PREFIX

    logged = capsys.readouterr().out.strip().splitlines()[-1]  # a log line: time, level, rank
    summary = TEXT_LOG_PREFIX.sub("", logged)
    assert summary != logged and " INFO [driver] " in logged
    assert summary.startswith("wrote 8 images in 1 shards") and "quarantined 6:" in summary
    assert "truncated=1" in summary and "images/s" in summary

    m = read_manifest(str(out))
    assert m["counts"] == {"input": 14, "written": 8, "quarantined": 6, "train": 8, "val": 0}
    got = {k: img for k, (lab, img, _) in read_shards(str(out)).items()}
    assert np.array_equal(got["good.png"], np.asarray(Image.open(csv_path.parent / "good.png")))
    assert (got["grey.png"] == 90).all()
    assert (got["cmyk.tif"] == [255, 0, 0]).all()
    assert np.abs(got["cmyk.jpg"].astype(int) - [255, 0, 0]).max() <= 12
    assert (got["rgba.png"][:, : S // 2] == [0, 0, 255]).all()
    assert (got["rgba.png"][:, S // 2 + 1:] == 255).all()
    assert (got["palette.png"][:, 0::2] == 255).all() and (got["palette.png"][:, 1::2] == [250, 10, 10]).all()
    assert (got["sixteen.png"] == 255).all()
    r = got["rotated.jpg"].astype(int)  # rotated to (64, 32), centre-cropped: top red, bottom blue
    assert r[4, 16, 0] > 200 and r[4, 16, 2] < 60 and r[28, 16, 2] > 200 and r[28, 16, 0] < 60


def test_same_seed_same_shards_overwrite_and_unfinished(ray_session, tmp_path):
    def run(name, seed, overwrite=False):
        cfg = make_cfg(tmp_path, shards=str(tmp_path / name), synth_images_per_class=12,
                       storage_size=24, shard_mb=0.05, val_fraction=0.25)
        cfg = cfg.replace(data=__import__("dataclasses").replace(cfg.data, synth_seed=seed))
        run_preprocess(Run.of(cfg), overwrite=overwrite)
        m = read_manifest(str(tmp_path / name))
        return m, read_shards(str(tmp_path / name))

    m1, s1 = run("a", 0)
    m2, s2 = run("b", 0)
    assert len(m1["shards"]["train"]) > 1  # several shards at 0.05 MB
    assert [x["sha256"] for x in m1["shards"]["train"] + m1["shards"]["val"]] == \
        [x["sha256"] for x in m2["shards"]["train"] + m2["shards"]["val"]]
    assert {k: v[2] for k, v in s1.items()} == {k: v[2] for k, v in s2.items()}  # same split
    m3, s3 = run("c", 1)
    assert {k: v[2] for k, v in s1.items()} == {k: v[2] for k, v in s3.items()}  # split by key only
    assert all(not np.array_equal(s1[k][1], s3[k][1]) for k in s1)  # new seed, new images

    with pytest.raises(FileExistsError, match="--overwrite"):
        run("a", 0)
    m4, _ = run("a", 0, overwrite=True)
    assert m4["shards"] == m1["shards"]

    # a killed run: shards written, no manifest -> readers refuse; temp files never match *.parquet
    os.remove(tmp_path / "a" / "manifest.json")
    (tmp_path / "a" / "train" / "part-00099.parquet.tmp").write_bytes(b"partial")
    from vitp.data.ingest import build_train_dataset
    cfg = make_cfg(tmp_path, shards=str(tmp_path / "a"))
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        build_train_dataset(Run.of(cfg))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not shards"):
        run("x", 0, overwrite=True)
    assert (tmp_path / "x" / "notes.txt").exists()
