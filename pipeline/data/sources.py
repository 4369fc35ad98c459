"""Input corpora -> a flat list of items (key, label, where the bytes are) plus the class names.

Owns the layout of every source (ImageFolder, CSV, Parquet, WebDataset, CIFAR-10/100, digits,
Pets, Flowers-102, ImageNet, synthetic), read through pipeline.storage (local, s3://, gs://).
Listing runs on the driver and reads no pixels except in-memory sources; must not decode images.
"""
from __future__ import annotations

import csv
import io
import os
import pickle
import tarfile
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import InputError
from ..storage import filesystem, is_uri, join, open_input
from .synth import class_name

# An item is one input: a dict with exactly these keys (the columns of the preprocess dataset).
#   key    file identity, stable across runs (relative path, "data_batch_1/123", ...)
#   label  class index, -1 when the source gave none (quarantined as bad_label)
#   split  "train" / "val" for sources with an official split, "" = split by hash of key
#   path   URI or local path to read; "" for in-memory items
#   offset, length   byte range inside `path` (tar members); -1 = whole file
#   data   inline bytes: an encoded image, or raw uint8 pixels when `shape` is set
#   shape  "HxWxC" for raw pixels, else ""
#   synth  image index for the synthetic source (rendered by the worker), else -1
#   error  a quarantine reason found while listing ("bad_label: ..."), else ""
ITEM_FIELDS = ("key", "label", "split", "path", "offset", "length", "data", "shape", "synth", "error")

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


def item(key: str, label: int, split: str = "", path: str = "", offset: int = -1, length: int = -1,
         data: bytes = b"", shape: str = "", synth: int = -1, error: str = "") -> dict:
    return {"key": key, "label": int(label), "split": split, "path": path, "offset": int(offset),
            "length": int(length), "data": data, "shape": shape, "synth": int(synth), "error": error}


@dataclass
class Listing:
    """What a source yields: the items, the class names (index = label) and provenance."""

    items: list[dict]
    classes: list[str]
    official_split: bool = False
    info: dict = field(default_factory=dict)


# ------------------------------------------------------------------------ file systems


def read_bytes(path: str, offset: int = -1, length: int = -1) -> bytes:
    """The bytes of `path` (or of [offset, offset+length)); OSError if it cannot be read."""
    with open_input(path) as f:
        if offset >= 0:
            f.seek(offset)
            return f.read(length)
        return f.read()


def _uri_of(base: str, fs_path: str, base_fs_path: str) -> str:
    """Turn a path inside `base`'s file system back into something read_bytes accepts."""
    return join(base, os.path.relpath(fs_path, base_fs_path).replace(os.sep, "/"))


def list_files(root: str) -> list[tuple[str, str]]:
    """All non-hidden files under root, sorted: (relative path, readable path/URI)."""
    fs, base = filesystem(root)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{root}: does not exist; set data.path to the corpus directory")
    out = []
    for fi in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if fi.type != pafs.FileType.File:
            continue
        rel = os.path.relpath(fi.path, base).replace(os.sep, "/")
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        out.append((rel, _uri_of(root, fi.path, base) if is_uri(root) else os.path.join(base, rel)))
    out.sort()
    return out


def _child_dirs(root: str) -> list[str]:
    fs, base = filesystem(root)
    names = [os.path.basename(fi.path) for fi in fs.get_file_info(pafs.FileSelector(base))
             if fi.type == pafs.FileType.Directory]
    return sorted(n for n in names if not n.startswith("."))


# ----------------------------------------------------------------------------- sources


def imagefolder(root: str, split: str = "", classes: Optional[list[str]] = None,
                key_prefix: str = "") -> Listing:
    """root/<class>/<file...>: every non-hidden file is an input (non-images get quarantined)."""
    classes = classes if classes is not None else _child_dirs(root)
    if not classes:
        raise FileNotFoundError(f"{root}: no class directories; expected root/<class>/<image>")
    index = {c: i for i, c in enumerate(classes)}
    items = []
    for rel, path in list_files(root):
        parts = rel.split("/")
        if len(parts) < 2:
            items.append(item(key_prefix + rel, -1, split, path,
                              error="bad_label: file at the top level, not inside a class directory"))
            continue
        label = index.get(parts[0], -1)
        err = "" if label >= 0 else f"bad_label: class directory {parts[0]!r} is not in the class map"
        items.append(item(key_prefix + rel, label, split, path, error=err))
    return Listing(items, list(classes), official_split=bool(split))


def _natural(names: set[str]) -> list[str]:
    try:
        return [str(n) for n in sorted(names, key=int)]
    except ValueError:
        return sorted(names)


def csv_list(csv_path: str) -> Listing:
    """A labels CSV with columns path,label; relative paths are relative to the CSV's folder."""
    text = read_bytes(csv_path).decode("utf-8-sig")
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and not {"path", "label"} <= set(rows[0]):
        raise InputError(f"{csv_path}: needs columns path,label; found {', '.join(rows[0])}")
    base = csv_path.rsplit("/", 1)[0] if "/" in csv_path else "."
    classes = _natural({r["label"].strip() for r in rows if (r["label"] or "").strip()})
    index = {c: i for i, c in enumerate(classes)}
    items = []
    for r in rows:
        p = (r["path"] or "").strip()
        full = p if (is_uri(p) or os.path.isabs(p)) else join(base, p)
        lab = (r["label"] or "").strip()
        err = "" if lab else f"bad_label: empty label for {p!r} in {csv_path}"
        items.append(item(p, index.get(lab, -1), "", full, error=err))
    return Listing(items, classes)


def parquet(root: str) -> Listing:
    """Existing Parquet files (columns: image bytes, label; optional key/path). Rows are read
    on the driver: fine up to a few million small images; shard beyond that."""
    files = [(rel, p) for rel, p in list_files(root) if rel.endswith(".parquet")] \
        if not root.endswith(".parquet") else [(os.path.basename(root), root)]
    raw: list[tuple[str, object, bytes]] = []
    for rel, path in files:
        fs, inner = filesystem(path)
        t = pq.read_table(inner, filesystem=fs)
        names = t.column_names
        img_col = "image" if "image" in names else ("bytes" if "bytes" in names else None)
        if img_col is None or "label" not in names:
            raise InputError(f"{path}: Parquet source needs columns image (bytes) and label; "
                             f"found {', '.join(names)}")
        keys = t.column("key").to_pylist() if "key" in names else (
            t.column("path").to_pylist() if "path" in names else [f"{rel}/{i}" for i in range(t.num_rows)])
        for k, lab, img in zip(keys, t.column("label").to_pylist(), t.column(img_col).to_pylist()):
            if isinstance(img, dict):  # HF-style struct {"bytes": ..., "path": ...}
                img = img.get("bytes")
            raw.append((str(k), lab, img or b""))
    classes = _natural({str(lab) for _, lab, _ in raw if lab is not None})
    index = {c: i for i, c in enumerate(classes)}
    items = [item(k, index.get(str(lab), -1), data=img,
                  error="" if lab is not None else "bad_label: null label")
             for k, lab, img in raw]
    return Listing(items, classes)


def webdataset(root: str) -> Listing:
    """WebDataset .tar shards: members key.jpg / key.png (image) + key.cls (class index text).
    Only tar headers and .cls members are read here; workers read images by byte range."""
    tars = [(rel, p) for rel, p in list_files(root) if rel.endswith(".tar")] \
        if not root.endswith(".tar") else [(os.path.basename(root), root)]
    samples: dict[str, dict] = {}
    for rel, path in tars:
        fs, inner = filesystem(path)
        with fs.open_input_file(inner) as f, tarfile.open(fileobj=f, mode="r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                stem, _, ext = m.name.partition(".")
                s = samples.setdefault(f"{rel}/{stem}", {})
                if ext.lower() in ("jpg", "jpeg", "png", "webp", "bmp"):
                    s["image"] = (path, m.offset_data, m.size)
                elif ext.lower() == "cls":
                    s["cls"] = tf.extractfile(m).read().decode().strip()
    labels = sorted({int(s["cls"]) for s in samples.values() if s.get("cls", "").lstrip("-").isdigit()})
    n = (max(labels) + 1) if labels else 0
    items = []
    for key, s in sorted(samples.items()):
        cls = s.get("cls", "")
        ok = cls.lstrip("-").isdigit() and int(cls) >= 0
        path, off, size = s.get("image", ("", -1, -1))
        err = "" if ok else f"bad_label: no usable {key}.cls"
        if not path:
            err = "not_an_image: no image member for this sample"
        items.append(item(key, int(cls) if ok else -1, "", path, off, size, error=err))
    return Listing(items, [str(i) for i in range(n)])


def _unpickle(path: str) -> dict:
    return pickle.loads(read_bytes(path), encoding="bytes")


def cifar(root: str, which: str) -> Listing:
    """CIFAR-10 (data_batch_1..5, test_batch, batches.meta) or CIFAR-100 (train, test, meta)
    python batches; the official train/test split is kept (test -> val)."""
    if which == "cifar10":
        files = [(f"data_batch_{i}", "train") for i in range(1, 6)] + [("test_batch", "val")]
        meta, lab_key, names_key = "batches.meta", b"labels", b"label_names"
    else:
        files = [("train", "train"), ("test", "val")]
        meta, lab_key, names_key = "meta", b"fine_labels", b"fine_label_names"
    classes = [n.decode() for n in _unpickle(join(root, meta))[names_key]]
    items = []
    for name, split in files:
        d = _unpickle(join(root, name))
        x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        for i, (img, lab) in enumerate(zip(x, d[lab_key])):  # img: (32, 32, 3)
            items.append(item(f"{name}/{i:05d}", lab, split, data=np.ascontiguousarray(img).tobytes(),
                              shape="32x32x3"))
    return Listing(items, classes, official_split=True)


def digits() -> Listing:
    """scikit-learn's bundled digits: 1,797 8x8 greyscale images, 0..16 scaled to 0..255."""
    from sklearn.datasets import load_digits  # lazy: scikit-learn, only this source needs it

    d = load_digits()
    imgs = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)  # (N, 8, 8)
    items = [item(f"digits/{i:04d}", lab, data=np.repeat(im[..., None], 3, axis=2).tobytes(),
                  shape="8x8x3") for i, (im, lab) in enumerate(zip(imgs, d.target))]
    return Listing(items, [str(i) for i in range(10)])


def pets(root: str) -> Listing:
    """Oxford-IIIT Pets: images/<Breed_Name>_<n>.jpg; annotations/trainval.txt -> train,
    annotations/test.txt -> val (lines 'Abyssinian_100 1 1 1', class id 1-based)."""
    rows = []
    for fname, split in (("trainval.txt", "train"), ("test.txt", "val")):
        for line in read_bytes(join(root, "annotations", fname)).decode().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            name, cid = line.split()[:2]
            rows.append((name, int(cid) - 1, split))
    names: dict[int, str] = {}
    for name, cid, _ in rows:
        names.setdefault(cid, name.rsplit("_", 1)[0])
    classes = [names[i] for i in sorted(names)]
    items = [item(f"images/{n}.jpg", cid, split, join(root, "images", f"{n}.jpg")) for n, cid, split in rows]
    return Listing(items, classes, official_split=True)


def flowers(root: str) -> Listing:
    """Oxford Flowers-102: jpg/image_XXXXX.jpg, imagelabels.mat (labels 1..102), setid.mat.
    trnid + valid -> train (2,040 images, as the paper fine-tunes), tstid -> val."""
    from scipy.io import loadmat  # lazy: scipy, only this source needs it

    labels = loadmat(io.BytesIO(read_bytes(join(root, "imagelabels.mat"))))["labels"].ravel()
    setid = loadmat(io.BytesIO(read_bytes(join(root, "setid.mat"))))
    items = []
    for key, split in (("trnid", "train"), ("valid", "train"), ("tstid", "val")):
        for i in sorted(int(v) for v in setid[key].ravel()):
            rel = f"jpg/image_{i:05d}.jpg"
            items.append(item(rel, int(labels[i - 1]) - 1, split, join(root, rel)))
    return Listing(items, [str(i) for i in range(1, 103)], official_split=True)


def imagenet(root: str) -> Listing:
    """ImageNet as ImageFolder: train/<wnid>/*.JPEG -> train, val/<wnid>/*.JPEG -> val; the
    class map comes from train's wnids (sorted)."""
    classes = _child_dirs(join(root, "train"))
    tr = imagefolder(join(root, "train"), "train", classes, key_prefix="train/")
    va = imagefolder(join(root, "val"), "val", classes, key_prefix="val/")
    return Listing(tr.items + va.items, classes, official_split=True)


def synthetic(num_classes: int, images_per_class: int, seed: int) -> Listing:
    """The fractal corpus, rendered by the preprocess workers (no files in between)."""
    items = [item(f"{class_name(c)}/{i:06d}", c, synth=i)
             for c in range(num_classes) for i in range(images_per_class)]
    return Listing(items, [class_name(c) for c in range(num_classes)],
                   info={"synth_seed": seed, "synth_classes": num_classes,
                         "synth_images_per_class": images_per_class})


def list_source(source: str, path: str = "", *, synth_classes: int = 10,
                synth_images_per_class: int = 64, seed: int = 0) -> Listing:
    """Dispatch on `data.source`. A `synthetic` source with a path reads that ImageFolder
    corpus (written by `vitp synth`); without one it renders in the workers."""
    if source == "synthetic":
        if path:
            return imagefolder(path)
        return synthetic(synth_classes, synth_images_per_class, seed)
    if source == "digits":
        return digits()
    if not path:
        raise InputError(f"data.source={source!r} reads files: set --set data.path=/path/to/{source}")
    readers = {"imagefolder": imagefolder, "csv": csv_list, "parquet": parquet,
               "webdataset": webdataset, "cifar10": lambda p: cifar(p, "cifar10"),
               "cifar100": lambda p: cifar(p, "cifar100"), "pets": pets, "flowers": flowers,
               "imagenet": imagenet}
    if source in readers:
        return readers[source](path)
    raise InputError(f"data.source={source!r} is not a source; use one of synthetic, imagefolder, "
                     "csv, parquet, webdataset, cifar10, cifar100, digits, pets, flowers, imagenet")
