"""RandAugment's ops at AugReg's magnitudes: each op does what the official level mapping says, uint8 in
and out, and an image's result depends only on its RNG."""
import numpy as np
import pytest

from vitp.data.augment import augment_image, row_rng
from vitp.data.randaug import FILL, OPS, rand_augment


def _image(side=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


@pytest.mark.parametrize("magnitude", [0.0, 10.0, 15.0, 20.0])
@pytest.mark.parametrize("name", list(OPS))
def test_every_op_keeps_the_shape_and_dtype_at_augregs_magnitudes(name, magnitude):
    from PIL import Image

    out = np.asarray(OPS[name](Image.fromarray(_image()), magnitude, np.random.default_rng(1)))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8


def test_the_level_mapping_of_the_pixel_ops():
    from PIL import Image

    img = _image()
    run = lambda name, m: np.asarray(OPS[name](Image.fromarray(img), m, np.random.default_rng(0))).astype(int)
    assert np.array_equal(run("Invert", 3.0), 255 - img)
    assert np.array_equal(run("Posterize", 10.0), img & 0xF0)  # 4 bits kept at M=10
    assert np.array_equal(run("Posterize", 0.0), np.zeros_like(img))  # none kept at M=0
    assert np.array_equal(run("Posterize", 20.0), img)  # all 8 at M=20
    assert np.array_equal(run("Solarize", 5.0), np.where(img < 128, img, 255 - img))
    assert np.array_equal(run("Solarize", 15.0), img)  # a threshold above 255 leaves the image alone
    assert np.array_equal(run("SolarizeAdd", 10.0), np.where(img < 128, np.minimum(img.astype(int) + 110, 255), img))
    assert np.array_equal(run("Brightness", 10.0 * (1 - 0.1) / 1.8), img)  # factor 1 at M=5: the identity


def test_geometry_fills_with_grey_and_cutout_scales_with_the_side():
    from PIL import Image

    img = np.zeros((224, 224, 3), dtype=np.uint8)
    moved = np.asarray(OPS["TranslateX"](Image.fromarray(img), 10.0, np.random.default_rng(0)))
    grey = (moved == FILL[0]).all(-1)
    assert grey.sum() == 100 * 224  # 100 of 224 columns shifted in at M=10, as the official pixels
    for seed in range(20):
        rng = np.random.default_rng(seed)
        cut = np.asarray(OPS["Cutout"](Image.fromarray(img), 10.0, rng))
        rows, cols = np.nonzero((cut == FILL[0]).all(-1))
        assert rows.max() - rows.min() + 1 <= 80 and cols.max() - cols.min() + 1 <= 80
    inside = np.asarray(OPS["Cutout"](Image.fromarray(np.zeros((448, 448, 3), np.uint8)), 10.0, np.random.default_rng(3)))
    assert (inside == FILL[0]).all(-1).sum() <= 160 * 160  # twice the side, twice the box


def test_rand_augment_is_a_function_of_its_rng():
    img = _image(seed=4)
    a = rand_augment(img, 2, 15.0, row_rng(0, 1, "k"))
    b = rand_augment(img, 2, 15.0, row_rng(0, 1, "k"))
    c = rand_augment(img, 2, 15.0, row_rng(0, 2, "k"))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(rand_augment(img, 0, 15.0, row_rng(0, 1, "k")), img)


def test_randaug_draws_after_the_crop_and_flip_so_they_stay_the_same():
    img = _image(48, seed=5)
    plain = augment_image(img, 32, "inception_crop", row_rng(0, 0, "x"), 0.35, True)
    with_ra = augment_image(img, 32, "inception_crop", row_rng(0, 0, "x"), 0.35, True, randaug=(2, 10.0))
    rng = row_rng(0, 0, "x")
    crop = augment_image(img, 32, "inception_crop", rng, 0.35, True)
    assert np.array_equal(crop, plain)
    assert np.array_equal(rand_augment(crop, 2, 10.0, rng), with_ra)
