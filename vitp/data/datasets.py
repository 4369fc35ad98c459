"""Sources listed whole on the driver as items: a labels CSV and the named downstream datasets in
their official layouts (CIFAR-10/100 python batches, scikit-learn's digits, Oxford-IIIT Pets,
Oxford Flowers-102). CIFAR and digits carry their pixels inline. Must not decode images.
"""
from __future__ import annotations

import csv
import io
import os

import numpy as np

from ..errors import InputError
from ..safe_load import load_data_pickle
from ..storage import is_uri, join
from .bounds import Fence, label_text_problem, outside_error, parse_index
from .files import read_bytes
from .sources import Listing, item, natural_order


def csv_list(csv_path: str, allow_outside_root: bool = False) -> Listing:
    """A labels CSV with columns path,label; relative paths are relative to the CSV's folder, and
    a row that names a file outside that folder (an absolute path, `..`, a link out, another
    bucket) is quarantined (outside_root) unless `allow_outside_root`."""
    try:
        reader = csv.DictReader(io.StringIO(read_bytes(csv_path).decode("utf-8-sig")))
        rows = [(reader.line_num, r) for r in reader]
    except (UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"{csv_path}: not a UTF-8 CSV with columns path,label ({e}); fix the file") from None
    if rows and not {"path", "label"} <= set(rows[0][1]):
        raise InputError(f"{csv_path}: needs columns path,label; found {', '.join(map(str, rows[0][1]))}")
    base = csv_path.rsplit("/", 1)[0] if "/" in csv_path else "."
    labels = [(r["label"] or "").strip() for _, r in rows]
    bad = [label_text_problem(lab, f"line {ln} of {csv_path}") for (ln, _), lab in zip(rows, labels)]
    classes = natural_order({lab for lab, b in zip(labels, bad) if lab and not b})
    index = {c: i for i, c in enumerate(classes)}
    fence, items = Fence(base), []
    for (ln, r), lab, err in zip(rows, labels, bad):
        p = (r["path"] or "").strip()
        full = p if (is_uri(p) or os.path.isabs(p)) else join(base, p)
        err = err or ("" if lab else f"bad_label: empty label for {p!r} in {csv_path}")
        if not allow_outside_root and full not in fence:
            err = outside_error(f"line {ln} of {csv_path} names {p!r},", base)
        items.append(item(p, index.get(lab, -1), "", full, error=err))
    return Listing(items, classes)


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


def pets(root: str, allow_outside_root: bool = False) -> Listing:
    """Oxford-IIIT Pets: images/<Breed_Name>_<n>.jpg; annotations/trainval.txt -> train,
    annotations/test.txt -> val (lines 'Abyssinian_100 1 1 1', class id 1-based)."""
    rows = []  # (name, class index or -1, split, quarantine reason)
    for fname, split in (("trainval.txt", "train"), ("test.txt", "val")):
        path = join(root, "annotations", fname)
        for n, line in enumerate(read_bytes(path).decode("utf-8", "replace").splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            name, cid = (line.split() + [""])[:2]
            cid, err = parse_index(cid.encode(), f"line {n} of {path}")
            err = err or ("" if cid > 0 else f"bad_label: line {n} of {path} has class id 0 (ids start at 1)")
            rows.append((name, cid - 1 if not err else -1, split, err))
    names: dict[int, str] = {}
    for name, cid, _, err in rows:
        if not err:
            names.setdefault(cid, name.rsplit("_", 1)[0])
    classes = [names[i] for i in sorted(names)]
    fence, items = Fence(root), []
    for n, cid, split, err in rows:  # a name with `../` in it must not lead out of root
        full = join(root, "images", f"{n}.jpg")
        err = err if allow_outside_root or full in fence else outside_error(f"{n!r} in {root}/annotations names {full},", root)
        items.append(item(f"images/{n}.jpg", cid, split, full, error=err))
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
