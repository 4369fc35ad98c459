"""The named downstream datasets in their official layouts (CIFAR-10/100 python batches,
scikit-learn's digits, Oxford-IIIT Pets, Oxford Flowers-102): small enough to be listed on the
driver as items. CIFAR and digits carry their pixels inline. Must not decode images.
"""
from __future__ import annotations

import io

import numpy as np

from ..errors import InputError
from ..safe_load import load_data_pickle
from ..storage import join
from .sources import Listing, item, read_bytes


def _unpickle(path: str) -> dict:
    """A CIFAR python batch: numbers, bytes and arrays only (never code a pickle could name)."""
    d = load_data_pickle(read_bytes(path), path)
    if not isinstance(d, dict):
        raise InputError(f"{path}: a CIFAR batch is a dict, this pickle holds a {type(d).__name__}")
    return d


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
