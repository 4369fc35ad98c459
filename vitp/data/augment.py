"""Per-image training augmentation on the Ray Data workers: the crop (inception or random), the flip and
RandAugment, all drawn from one RNG per (seed, epoch, key), so an image is augmented the same wherever
and whenever it is read (exact resume, another world size). Also the seeded row order inside a unit.
Must not know Ray, shards or models.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from .decode import crop_resize, decode_stored, inception_crop_box, random_crop_box, resize_center_crop
from .randaug import rand_augment


def _key_int(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)


def row_rng(seed: int, epoch: int, key: str) -> np.random.Generator:
    """The augmentation RNG of one row: the same crop/flip whatever block or worker it is on."""
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, _key_int(key)])


def augment_image(img: np.ndarray, size: int, mode: str, rng: Optional[np.random.Generator],
                  scale_min: float = 0.08, hflip: bool = True,
                  out: Optional[np.ndarray] = None, randaug: tuple[int, float] = (0, 0.0)) -> np.ndarray:
    """(H, W, 3) uint8 -> (size, size, 3) uint8 by `mode`: inception_crop, random_crop, none; then
    RandAugment's (layers, magnitude) when layers > 0 (and an RNG is given), drawn after the crop and
    flip so those stay what they were without it. Written into `out` (contiguous) when given."""
    res = _crop(img, size, mode, rng, scale_min, hflip, out)
    if randaug[0] and rng is not None:
        return rand_augment(res, randaug[0], randaug[1], rng, out=res)
    return res


def _crop(img: np.ndarray, size: int, mode: str, rng: Optional[np.random.Generator], scale_min: float,
          hflip: bool, out: Optional[np.ndarray]) -> np.ndarray:
    h, w = img.shape[:2]
    if mode == "none" or rng is None:
        res = resize_center_crop(img, size)
        if out is None:
            return res
        np.copyto(out, res)
        return out
    if mode == "inception_crop":
        box = inception_crop_box(rng, h, w, scale_min)
    elif mode == "random_crop":
        box = random_crop_box(rng, h, w, size)
    else:
        raise ValueError(f"data.augment={mode!r}: use inception_crop, random_crop or none")
    flip = bool(hflip and rng.random() < 0.5)
    return crop_resize(img, box, size, flip, out=out)


def row_order(keys, seed: int, epoch: int) -> np.ndarray:
    """The order a training stream yields one read unit's rows (`keys`, in shard order) in `epoch`."""
    if len(keys) < 2:
        return np.arange(len(keys))
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, _key_int(str(keys[0])), 7]).permutation(len(keys))


def augment_rows(rows: dict, *, size: int, mode: str, scale_min: float, hflip: bool, seed: int,
                 epoch: int, storage_format: str, shuffle_rows: bool,
                 randaug: tuple[int, float] = (0, 0.0)) -> dict:
    """Stored rows -> {"image" (B, S, S, 3) uint8, "label" (B,) int64, "epoch" (B,) int64,
    "key" (B,) str}; rows permuted by an RNG from (seed, epoch, first key) if shuffle_rows."""
    keys = rows["key"]
    n = len(keys)
    order = row_order(keys, seed, epoch) if shuffle_rows else np.arange(n)
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    for j, i in enumerate(order):
        img = decode_stored(rows["image"][i], int(rows["height"][i]), int(rows["width"][i]),
                            storage_format)
        rng = row_rng(seed, epoch, str(keys[i])) if mode != "none" or randaug[0] else None
        augment_image(img, size, mode, rng, scale_min, hflip, out=out[j], randaug=randaug)
    return {"image": out, "label": np.asarray(rows["label"], dtype=np.int64)[order],
            "epoch": np.full(n, epoch, dtype=np.int64), "key": np.asarray(keys, dtype=object)[order]}
