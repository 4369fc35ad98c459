"""Every source layout, made small on disk with real formats, listed and preprocessed."""
import io
import pickle
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vitp.data import catalog, files
from vitp.data.commands import run_preprocess, run_synth
from vitp.config import Run

from .conftest import make_cfg, read_shards, save


def jpeg_bytes(color, size=(12, 10)):
    b = io.BytesIO()
    Image.new("RGB", size, color).save(b, "JPEG", quality=95)
    return b.getvalue()


def test_cifar10_and_100_batches_keep_official_split(tmp_path):
    rng = np.random.default_rng(0)
    c10 = tmp_path / "c10"
    c10.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 255, (3, 3072), dtype=np.uint8)
        pickle.dump({b"data": data, b"labels": [0, 1, 9]}, open(c10 / name, "wb"))
    pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, open(c10 / "batches.meta", "wb"))
    lst = catalog.list_source("cifar10", str(c10))
    assert len(lst.items) == 18 and lst.classes[9] == "c9" and lst.official_split
    first = pickle.load(open(c10 / "data_batch_1", "rb"))[b"data"][0]
    img = np.frombuffer(lst.items[0]["data"], np.uint8).reshape(32, 32, 3)
    assert np.array_equal(img[..., 1], first[1024:2048].reshape(32, 32))  # CHW planes -> HWC
    assert sorted({it["split"] for it in lst.items}) == ["train", "val"]
    assert sum(it["split"] == "val" for it in lst.items) == 3

    c100 = tmp_path / "c100"
    c100.mkdir()
    for name in ("train", "test"):
        pickle.dump({b"data": rng.integers(0, 255, (2, 3072), dtype=np.uint8), b"fine_labels": [5, 99]},
                    open(c100 / name, "wb"))
    pickle.dump({b"fine_label_names": [f"f{i}".encode() for i in range(100)]}, open(c100 / "meta", "wb"))
    lst = catalog.list_source("cifar100", str(c100))
    assert len(lst.classes) == 100 and [it["label"] for it in lst.items] == [5, 99, 5, 99]


def test_webdataset_parquet_pets_flowers_imagenet_listings(tmp_path):
    # WebDataset: key.jpg + key.cls; one sample without .cls is kept as bad_label
    tar_path = tmp_path / "wds" / "shard-000.tar"
    tar_path.parent.mkdir()
    with tarfile.open(tar_path, "w") as tf:
        for key, cls in (("a", "0"), ("b", "2"), ("c", None)):
            for ext, payload in (("jpg", jpeg_bytes((200, 0, 0))), ("cls", cls.encode() if cls else None)):
                if payload is None:
                    continue
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
    lst = catalog.list_source("webdataset", str(tmp_path / "wds"))
    assert [it["label"] for it in lst.items] == [0, 2, -1] and lst.items[2]["error"].startswith("bad_label")
    it = lst.items[0]
    assert files.read_bytes(it["path"], it["offset"], it["length"]) == jpeg_bytes((200, 0, 0))

    # existing Parquet with image bytes + label
    pq.write_table(pa.table({"image": [jpeg_bytes((0, 0, 200)), b"junk"], "label": [3, 1]}),
                   tmp_path / "in.parquet")
    lst = catalog.list_source("parquet", str(tmp_path / "in.parquet"))
    assert lst.classes == ["1", "3"] and [it["label"] for it in lst.items] == [1, 0]

    # Oxford-IIIT Pets
    pets = tmp_path / "pets"
    for n in ("Abyssinian_1", "great_pyrenees_2", "Abyssinian_3"):
        save(Image.new("RGB", (16, 16)), pets / "images" / f"{n}.jpg")
    (pets / "annotations").mkdir()
    (pets / "annotations" / "trainval.txt").write_text("Abyssinian_1 1 1 1\ngreat_pyrenees_2 2 2 1\n")
    (pets / "annotations" / "test.txt").write_text("Abyssinian_3 1 1 1\n")
    lst = catalog.list_source("pets", str(pets))
    assert lst.classes == ["Abyssinian", "great_pyrenees"]
    assert [(it["label"], it["split"]) for it in lst.items] == [(0, "train"), (1, "train"), (0, "val")]

    # Flowers-102: .mat files via scipy
    from scipy.io import savemat
    fl = tmp_path / "flowers"
    for i in range(1, 5):
        save(Image.new("RGB", (16, 16)), fl / "jpg" / f"image_{i:05d}.jpg")
    savemat(fl / "imagelabels.mat", {"labels": np.array([[1, 2, 102, 1]])})
    savemat(fl / "setid.mat", {"trnid": np.array([[1]]), "valid": np.array([[2]]), "tstid": np.array([[3, 4]])})
    lst = catalog.list_source("flowers", str(fl))
    assert len(lst.classes) == 102
    assert [(it["key"], it["label"], it["split"]) for it in lst.items] == [
        ("jpg/image_00001.jpg", 0, "train"), ("jpg/image_00002.jpg", 1, "train"),
        ("jpg/image_00003.jpg", 101, "val"), ("jpg/image_00004.jpg", 0, "val")]

    # ImageNet: train/<wnid>, val/<wnid>, class map from train
    inet = tmp_path / "imagenet"
    for split in ("train", "val"):
        for wnid in ("n01", "n02"):
            save(Image.new("RGB", (16, 16)), inet / split / wnid / f"x_{split}.JPEG", "JPEG")
    lst = catalog.list_source("imagenet", str(inet))
    assert lst.classes == ["n01", "n02"]
    assert [(it["key"], it["split"]) for it in lst.items][:2] == [
        ("train/n01/x_train.JPEG", "train"), ("train/n02/x_train.JPEG", "train")]

    # URIs go through pyarrow file systems: a file:// URI lists like the local path
    uri = catalog.list_source("imagenet", "file://" + str(inet))
    assert [it["key"] for it in uri.items] == [it["key"] for it in lst.items]
    assert files.read_bytes(uri.items[0]["path"]) == (inet / "train" / "n01" / "x_train.JPEG").read_bytes()


@pytest.mark.ray
def test_digits_and_webdataset_preprocess(ray_session, tmp_path):
    cfg = make_cfg(tmp_path, source="digits", storage_size=16, image_size=16, val_fraction=0.2)
    res = run_preprocess(Run.of(cfg))
    assert res["input"] == res["written"] == 1797
    assert 0.15 < res["val"] / 1797 < 0.25  # the hash split honours val_fraction
    from sklearn.datasets import load_digits
    d = load_digits()
    back = read_shards(str(tmp_path / "shards" / "digits"))
    label, img, _ = back["digits/0000"]
    assert label == d.target[0] and img.shape == (16, 16, 3)
    # 8x8 upscaled 2x: a bright input pixel stays bright, a dark one dark
    src = np.rint(d.images[0] * 255 / 16)
    assert abs(img[::2, ::2, 0].astype(int) - src).mean() < 40


@pytest.mark.ray
def test_synth_corpus_files_then_preprocess(ray_session, tmp_path):
    cfg = make_cfg(tmp_path, synth_classes=3, synth_images_per_class=5, storage_size=24)
    res = run_synth(Run.of(cfg), out_dir=str(tmp_path / "synth"))
    assert res["images"] == 15
    files = sorted((tmp_path / "synth").rglob("*.png"))
    assert len(files) == 15 and not list((tmp_path / "synth").rglob("*.tmp*"))
    from vitp.data.synth import render
    assert np.array_equal(np.asarray(Image.open(files[0])), render(0, 0, 0, 24))
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_synth(Run.of(cfg), out_dir=str(tmp_path / "synth"))
    # the same corpus read back from files equals rendering straight into shards
    a = make_cfg(tmp_path, synth_classes=3, synth_images_per_class=5, storage_size=24,
                 path=str(tmp_path / "synth"), shards=str(tmp_path / "a"), num_classes=3)
    b = make_cfg(tmp_path, synth_classes=3, synth_images_per_class=5, storage_size=24,
                 shards=str(tmp_path / "b"), num_classes=3)
    run_preprocess(Run.of(a))
    run_preprocess(Run.of(b))
    sa, sb = read_shards(str(tmp_path / "a")), read_shards(str(tmp_path / "b"))
    for k, (lab, img, _) in sb.items():
        assert sa[k + ".png"][0] == lab and np.array_equal(sa[k + ".png"][1], img)
