"""Helpers for the data tests: configs pointing at tmp dirs, reading shards back."""
import dataclasses
import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vitp.recipes import debug


def make_cfg(work_dir, **data):
    """The debug recipe with its work_dir in tmp and data fields replaced."""
    cfg = debug()
    return dataclasses.replace(cfg, work_dir=str(work_dir),
                               data=dataclasses.replace(cfg.data, **data))


def read_shards(root, split=None):
    """{key: (label, image (H, W, 3) uint8 or JPEG bytes, height, width)} over the manifest's shards."""
    import json
    import os

    m = json.load(open(os.path.join(root, "manifest.json")))
    out = {}
    for s in (split,) if split else ("train", "val"):
        for sh in m["shards"][s]:
            t = pq.read_table(os.path.join(root, sh["file"]))
            for row in t.to_pylist():
                img = row["image"]
                if m["storage"]["format"] == "uint8":
                    img = np.frombuffer(img, np.uint8).reshape(row["height"], row["width"], 3)
                else:
                    img = np.asarray(Image.open(io.BytesIO(img)).convert("RGB"))
                out[row["key"]] = (row["label"], img, s)
    return out


def save(img, path, fmt=None, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt, **kw)
    return path


def smooth_image(rng, h, w):
    """A smooth RGB test image (gradients + a rectangle): compresses like a photo."""
    y, x = np.mgrid[0:h, 0:w]
    a = rng.uniform(0.2, 1.0, 3)
    img = np.stack([(x * a[0] * 255 / max(w - 1, 1)), (y * a[1] * 255 / max(h - 1, 1)),
                    ((x + y) * a[2] * 127 / max(w + h - 2, 1))], axis=-1)
    y0, x0 = rng.integers(0, h // 2), rng.integers(0, w // 2)
    img[y0:y0 + h // 3, x0:x0 + w // 3] = rng.uniform(0, 255, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
