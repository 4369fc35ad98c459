"""RandAugment (Cubuk et al. 2020) as the AugReg code runs it: `layers` ops drawn uniformly from 16, each
applied at magnitude M on the 0..10 scale (no clipping: AugReg's 15 and 20 extrapolate). Per image,
uint8 in and out, with the caller's RNG (one per (seed, epoch, key): the same image wherever it runs).
Where our ops differ from that code (docs/augreg.md): translate and cutout scale with the image side,
and solarize's threshold above 255 leaves the image alone. Must not know Ray, shards or models.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

MAX_LEVEL = 10.0
FILL = (128, 128, 128)  # what rotate, shear, translate and cutout leave behind (the official value)
# The official constants are pixels of a 224 px crop; here they are fractions of the image side.
TRANSLATE_FRACTION = 100 / 224
CUTOUT_FRACTION = 40 / 224


def _signed(rng: np.random.Generator, value: float) -> float:
    return -value if rng.random() < 0.5 else value


def _affine(img: Image.Image, matrix: tuple) -> Image.Image:
    return img.transform(img.size, Image.AFFINE, matrix, resample=Image.NEAREST, fillcolor=FILL)


def _posterize(img: Image.Image, m: float, rng) -> Image.Image:
    bits = int(m / MAX_LEVEL * 4)  # 0 bits keeps nothing (a black image), 8 or more keeps all
    if bits >= 8:
        return img
    a = np.asarray(img)
    return Image.fromarray(a & np.uint8((0xFF << (8 - bits)) & 0xFF))


def _solarize(img: Image.Image, m: float, rng) -> Image.Image:
    threshold = int(m / MAX_LEVEL * 256)
    a = np.asarray(img)
    return Image.fromarray(np.where(a < threshold, a, 255 - a).astype(np.uint8))


def _solarize_add(img: Image.Image, m: float, rng) -> Image.Image:
    a = np.asarray(img).astype(np.int16)
    added = np.clip(a + int(m / MAX_LEVEL * 110), 0, 255)
    return Image.fromarray(np.where(a < 128, added, a).astype(np.uint8))


def _enhance(kind) -> Callable:
    def op(img: Image.Image, m: float, rng) -> Image.Image:
        return kind(img).enhance(m / MAX_LEVEL * 1.8 + 0.1)  # 0.1 at M=0, 1.9 at 10: no random sign
    return op


def _rotate(img: Image.Image, m: float, rng) -> Image.Image:
    return img.rotate(_signed(rng, m / MAX_LEVEL * 30.0), resample=Image.NEAREST, fillcolor=FILL)


def _shear(axis: int) -> Callable:
    def op(img: Image.Image, m: float, rng) -> Image.Image:
        s = _signed(rng, m / MAX_LEVEL * 0.3)
        return _affine(img, (1, s, 0, 0, 1, 0) if axis == 0 else (1, 0, 0, s, 1, 0))
    return op


def _translate(axis: int) -> Callable:
    def op(img: Image.Image, m: float, rng) -> Image.Image:
        t = _signed(rng, m / MAX_LEVEL * TRANSLATE_FRACTION * img.size[axis])
        return _affine(img, (1, 0, t, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, t))
    return op


def _cutout(img: Image.Image, m: float, rng) -> Image.Image:
    w, h = img.size
    pad = int(m / MAX_LEVEL * CUTOUT_FRACTION * min(w, h))
    cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))  # drawn at M=0 too, like the rest
    if pad <= 0:
        return img
    a = np.array(img)
    a[max(0, cy - pad):cy + pad, max(0, cx - pad):cx + pad] = FILL
    return Image.fromarray(a)


# The 16 ops in the official order: an op's index is what the RNG draws.
OPS: dict[str, Callable[[Image.Image, float, np.random.Generator], Image.Image]] = {
    "AutoContrast": lambda img, m, rng: ImageOps.autocontrast(img),
    "Equalize": lambda img, m, rng: ImageOps.equalize(img),
    "Invert": lambda img, m, rng: ImageOps.invert(img),
    "Rotate": _rotate,
    "Posterize": _posterize,
    "Solarize": _solarize,
    "Color": _enhance(ImageEnhance.Color),
    "Contrast": _enhance(ImageEnhance.Contrast),
    "Brightness": _enhance(ImageEnhance.Brightness),
    "Sharpness": _enhance(ImageEnhance.Sharpness),
    "ShearX": _shear(0),
    "ShearY": _shear(1),
    "TranslateX": _translate(0),
    "TranslateY": _translate(1),
    "Cutout": _cutout,
    "SolarizeAdd": _solarize_add,
}
_OP_LIST = list(OPS.values())


def rand_augment(img: np.ndarray, layers: int, magnitude: float, rng: np.random.Generator,
                 out: np.ndarray | None = None) -> np.ndarray:
    """(H, W, 3) uint8 -> the same shape after `layers` ops drawn with replacement (each applied,
    no per-op probability), written into `out` when given (it may be `img`)."""
    pil = Image.fromarray(img)
    for _ in range(layers):
        pil = _OP_LIST[int(rng.integers(len(_OP_LIST)))](pil, magnitude, rng)
    res = np.asarray(pil)
    if out is None:
        return res.copy()
    np.copyto(out, res)
    return out
