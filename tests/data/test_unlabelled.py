"""data.source=unlabelled on real files with real Ray: every image at any depth is an input of
class 0 (non-images are not inputs, a corrupt image is quarantined), the manifest says the shards
are unlabelled and a classification run on them is refused; the same from an S3 corpus."""
import dataclasses
import io
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vitp import cli, storage
from vitp.config import ConfigError, Run, apply_overrides, validate
from vitp.data.catalog import list_source, plan_source
from vitp.data.commands import ensure_shards, run_preprocess
from vitp.data.rows import assign_split
from vitp.data.shards import read_manifest, verify_checksums
from vitp.errors import InputError
from vitp.recipes import debug

from .conftest import make_cfg, read_shards, save, smooth_image

S = 24
VAL = 0.3
# the images of the corpus below (relative path = key) and the one that cannot be decoded
GOOD = ["top.png", "a/001.jpg", "a/002.png", "a/deep/004.JPEG", "a/deep/er/003.png",
        "b/005.png", "b/006.webp", "b/007.bmp", "c/x/y/z/008.png"]
BROKEN = "a/broken.jpg"


def write_corpus(root, rng):
    """Nested folders with no class structure, a file at the top, non-image files, a hidden
    folder, and a truncated JPEG."""
    fmts = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".bmp": "BMP"}
    for i, rel in enumerate(GOOD):
        h, w = (S, S) if rel.endswith(".png") else (S + 4 * i, S + 8)
        save(Image.fromarray(smooth_image(rng, h, w)), root / rel, fmts[os.path.splitext(rel)[1].lower()])
    full = root / "a" / "full.jpg"
    save(Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)), full, "JPEG")
    (root / BROKEN).write_bytes(full.read_bytes()[:600])
    full.unlink()
    (root / "notes.txt").write_text("scraped 2026-11-25\n")
    (root / "a" / "meta.json").write_text("{}")
    save(Image.fromarray(smooth_image(rng, S, S)), root / ".hidden" / "skip.png", "PNG")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("unlabelled") / "corpus"
    write_corpus(root, np.random.default_rng(0))
    return root


@pytest.fixture(scope="module")
def preprocessed(ray_session, corpus, tmp_path_factory):
    """The corpus preprocessed once: (config, summary, shard dir)."""
    work = tmp_path_factory.mktemp("work")
    cfg = make_cfg(work, source="unlabelled", path=str(corpus), storage_size=S, image_size=S,
                   val_fraction=VAL)
    assert cfg.data.num_classes != 1  # the manifest's 1 comes from the source, not the config
    res = run_preprocess(Run.of(cfg), log=lambda _: None)
    return cfg, res, str(work / "shards" / "unlabelled")


def test_listing_is_every_image_at_any_depth_planned_from_directories(corpus):
    plan = plan_source("unlabelled", str(corpus))
    # the driver listed only the top directory: a unit for its files and one per child folder
    assert plan.items == [] and sorted((u["kind"], u.get("dir", "")) for u in plan.units) == [
        ("dir", "a"), ("dir", "b"), ("dir", "c"), ("top", "")]
    assert plan.classes == ["unlabelled"] and plan.info == {"labelled": False}
    lst = list_source("unlabelled", str(corpus))
    assert sorted(it["key"] for it in lst.items) == sorted(GOOD + [BROKEN])
    assert {it["label"] for it in lst.items} == {0} and not any(it["error"] for it in lst.items)
    assert all(it["path"] == os.path.join(str(corpus), it["key"]) and not it["data"] for it in lst.items)


def test_missing_root_and_file_root_are_refused(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        plan_source("unlabelled", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        plan_source("unlabelled", str(corpus / "top.png"))
    with pytest.raises(InputError, match="data.path"):
        plan_source("unlabelled", "")
    # and at the edge, before Ray starts: the config names the field and the fix
    with pytest.raises(ConfigError, match=r"data.path='.*top.png' is a file: .*point data.path at the folder"):
        validate(apply_overrides(debug(), ["data.source=unlabelled", f"data.path={corpus / 'top.png'}"]))
    assert validate(apply_overrides(debug(), ["data.source=unlabelled", f"data.path={corpus}"])).data.path == str(corpus)


@pytest.mark.ray
def test_preprocess_labels_all_zero_splits_by_hash_corrupt_quarantined(preprocessed, corpus):
    cfg, res, shards = preprocessed
    assert (res["input"], res["written"], res["quarantined"]) == (len(GOOD) + 1, len(GOOD), 1)
    assert res["reasons"] == {"truncated": 1}
    m = read_manifest(shards)
    assert m["labelled"] is False and m["num_classes"] == 1 and m["source"] == "unlabelled"
    assert json.load(open(os.path.join(shards, "classes.json"))) == {"unlabelled": 0}
    back = read_shards(shards)
    assert sorted(back) == sorted(GOOD)
    assert {label for label, _, _ in back.values()} == {0}
    splits = {k: split for k, (_, _, split) in back.items()}
    assert splits == {k: assign_split(k, "", VAL) for k in GOOD}
    assert set(splits.values()) == {"train", "val"}
    assert m["per_class"] == {s: {"unlabelled": list(splits.values()).count(s)} for s in ("train", "val")}
    for k in ("top.png", "c/x/y/z/008.png"):  # lossless S x S in: the same pixels out
        assert np.array_equal(back[k][1], np.asarray(Image.open(corpus / k).convert("RGB")))
    q = pq.read_table(os.path.join(shards, "quarantine.parquet")).to_pylist()
    assert [(r["key"], r["reason"]) for r in q] == [(BROKEN, "truncated")] and q[0]["detail"]
    assert verify_checksums(shards, m) == []


@pytest.mark.ray
def test_classification_on_unlabelled_shards_is_refused_in_one_line(preprocessed, capsys):
    cfg, _, shards = preprocessed
    with pytest.raises(InputError, match=r"unlabelled shards .*--set train\.objective=mpp"):
        ensure_shards(Run.of(cfg), log=lambda _: None)
    # the same through `vitp pretrain`: one line on stderr, exit code 2, nothing trained
    code = cli.main(["pretrain", "debug", "--no-tracking", "--set", "data.source=unlabelled",
                     "--set", f"data.path={cfg.data.path}", "--set", f"work_dir={cfg.work_dir}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("vitp pretrain: ") and "--set train.objective=mpp" in err[0]
    # and from Python (a Tune trainable, a notebook): run_training checks before anything starts
    from vitp.train.trainer import run_training

    with pytest.raises(InputError, match=r"unlabelled shards .*train\.objective=mpp"):
        run_training(Run.of(cfg), tracking=False)


@pytest.mark.ray
def test_self_supervised_objective_reads_unlabelled_shards(preprocessed):
    cfg, _, shards = preprocessed
    mpp = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="mpp"))
    assert ensure_shards(Run.of(mpp), log=lambda _: None) == shards


@pytest.mark.ray
def test_imagefolder_on_the_same_tree_is_unchanged(ray_session, corpus, tmp_path):
    """A labelled source keeps its rules: top-level files and unknown classes are bad_label,
    non-images are inputs (quarantined), no `labelled` key, classification allowed."""
    cfg = make_cfg(tmp_path, source="imagefolder", path=str(corpus), storage_size=S, image_size=S,
                   val_fraction=VAL, num_classes=3)
    res = run_preprocess(Run.of(cfg), log=lambda _: None)
    # inputs: every non-hidden file; top.png and notes.txt have no class directory
    assert res["input"] == len(GOOD) + 3  # + broken.jpg, notes.txt, a/meta.json
    assert res["reasons"] == {"bad_label": 2, "not_an_image": 1, "truncated": 1}
    m = read_manifest(ensure_shards(Run.of(cfg), log=lambda _: None))
    assert "labelled" not in m and m["num_classes"] == 3


@pytest.mark.ray
def test_unlabelled_corpus_on_s3_gives_the_same_shards(preprocessed, corpus, s3, tmp_path):
    _, local, local_shards = preprocessed
    uri = storage.join(s3.bucket(), "photos")
    storage.upload_dir(str(corpus), uri)
    assert storage.isfile(storage.join(uri, ".hidden", "skip.png"))  # uploaded, and still skipped
    cfg = make_cfg(tmp_path, source="unlabelled", path=uri, storage_size=S, image_size=S,
                   val_fraction=VAL, shards=storage.join(uri.rsplit("/", 1)[0], "shards"))
    res = run_preprocess(Run.of(cfg), log=lambda _: None)
    assert {k: res[k] for k in ("input", "written", "quarantined", "reasons", "train", "val")} == \
        {k: local[k] for k in ("input", "written", "quarantined", "reasons", "train", "val")}
    m, ml = read_manifest(cfg.data.shards), read_manifest(local_shards)
    assert m["labelled"] is False and m["num_classes"] == 1
    # same keys, labels, splits and pixels: the shard files are byte-identical
    assert {s: [x["sha256"] for x in m["shards"][s]] for s in m["shards"]} == \
        {s: [x["sha256"] for x in ml["shards"][s]] for s in ml["shards"]}
    q = storage.read_bytes(storage.join(cfg.data.shards, "quarantine.parquet"))
    rows = pq.read_table(io.BytesIO(q)).to_pylist()
    assert [(r["key"], r["reason"], r["path"]) for r in rows] == [(BROKEN, "truncated", storage.join(uri, BROKEN))]
