"""decode.py without Ray: every mode converted to RGB with the expected pixels, every bad
input rejected with its reason, and the crop boxes inside their bounds."""
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from vitp.data.decode import (TORCH_CROP_MIN_SIZE, DecodeError, crop_resize, decode_image,
                              inception_crop_box, random_crop_box, resize_center_crop)


def enc(im, fmt, **kw):
    b = io.BytesIO()
    im.save(b, format=fmt, **kw)
    return b.getvalue()


def fake_png_header(w, h):
    """A PNG whose IHDR claims w x h: only the header exists (a decompression bomb's shape)."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_modes_convert_to_expected_rgb():
    grey = Image.fromarray(np.full((4, 4), 77, np.uint8), "L")
    assert (decode_image(enc(grey, "PNG")) == 77).all()
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # pure red in CMYK
    assert (decode_image(enc(cmyk, "TIFF")) == [255, 0, 0]).all()
    i16 = Image.fromarray(np.array([[0, 65535], [32896, 257]], np.uint16))  # 16-bit grey
    out = decode_image(enc(i16, "PNG"))
    assert out[..., 0].tolist() == [[0, 255], [128, 1]] and (out[..., 0] == out[..., 2]).all()
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 0)      # fully transparent red -> white
    rgba[0, 1] = (0, 0, 255, 255)    # opaque blue stays blue
    rgba[1, 0] = (0, 0, 0, 128)      # half-transparent black on white -> ~127 grey
    rgba[1, 1] = (0, 255, 0, 255)
    out = decode_image(enc(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert out[0, 0].tolist() == [255, 255, 255] and out[0, 1].tolist() == [0, 0, 255]
    assert out[1, 0].tolist() == [127, 127, 127] and out[1, 1].tolist() == [0, 255, 0]
    pal = Image.fromarray(np.array([[0, 1], [1, 0]], np.uint8), "P")
    pal.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    out = decode_image(enc(pal, "PNG", transparency=0))  # index 0 transparent -> white
    assert out[0, 0].tolist() == [255, 255, 255] and out[0, 1].tolist() == [200, 100, 50]


def test_exif_orientation_applied():
    a = np.zeros((32, 64, 3), np.uint8)  # (H, W): left half red, right half blue
    a[:, :32] = (255, 0, 0)
    a[:, 32:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": left edge goes to the top
    out = decode_image(enc(Image.fromarray(a), "JPEG", quality=98, exif=exif.tobytes()))
    assert out.shape == (64, 32, 3)
    assert out[8, 16, 0] > 200 and out[8, 16, 2] < 50   # top: red
    assert out[56, 16, 2] > 200 and out[56, 16, 0] < 50  # bottom: blue


@pytest.mark.parametrize("data,reason", [
    (b"", "empty"),
    (b"this is not an image, it only has a .jpg name", "not_an_image"),
    (fake_png_header(100_000, 100_000), "too_large"),
])
def test_bad_inputs_have_reasons(data, reason):
    with pytest.raises(DecodeError) as e:
        decode_image(data)
    assert e.value.reason == reason


def test_truncated_jpeg_and_pixel_limit_before_decode():
    full = enc(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)), "JPEG")
    with pytest.raises(DecodeError) as e:
        decode_image(full[: len(full) // 2])
    assert e.value.reason == "truncated"
    big = enc(Image.new("RGB", (300, 300)), "PNG")
    with pytest.raises(DecodeError) as e:
        decode_image(big, max_pixels=300 * 300 - 1)
    assert e.value.reason == "too_large" and "300x300" in str(e.value)


def test_pillow_limit_lifted_only_above_it_and_restored_across_threads():
    """Our limit, not Pillow's process-wide one, decides; lifting Pillow's (for a max_pixels above
    it) is undone exactly, even with many decode threads in one process; a thread opening an image
    never sees the setting mid-swap (lifting it to None made Pillow's own check raise TypeError)."""
    import sys
    import threading

    from PIL import Image

    pil = Image.MAX_IMAGE_PIXELS
    huge = fake_png_header(20_000, 10_000)  # 2e8 pixels: above 2x Pillow's default limit
    with pytest.raises(DecodeError) as e:
        decode_image(huge)
    assert e.value.reason == "too_large"
    with pytest.raises(DecodeError) as e:  # allowed by our limit: gets past the header, then the
        decode_image(huge, max_pixels=10**9)  # 16-byte IDAT cannot fill 20000x10000
    assert e.value.reason in ("truncated", "corrupt")
    assert Image.MAX_IMAGE_PIXELS == pil

    small = enc(Image.new("RGB", (8, 8)), "PNG")
    errors = []

    def work(i):
        try:
            for j in range(600):
                decode_image(small, max_pixels=10**12 if (i + j) % 2 else 10**4)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so unguarded save/restore would interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and Image.MAX_IMAGE_PIXELS == pil


def test_resize_center_crop_and_boxes():
    img = np.arange(8 * 12 * 3, dtype=np.uint8).reshape(8, 12, 3)
    assert resize_center_crop(img, 8).shape == (8, 8, 3)
    assert (resize_center_crop(img[:, 2:10], 8) == img[:, 2:10]).all()  # already square: unchanged
    assert resize_center_crop(np.zeros((8, 8, 3), np.uint8), 40).shape == (40, 40, 3)  # upscale
    rng = np.random.default_rng(1)
    for _ in range(200):
        x0, y0, x1, y1 = inception_crop_box(rng, 30, 50, 0.08)
        assert 0 <= x0 < x1 <= 50 and 0 <= y0 < y1 <= 30
        area = (x1 - x0) * (y1 - y0) / (30 * 50)
        assert 0.05 <= area <= 1.0
        x0, y0, x1, y1 = random_crop_box(rng, 40, 40, 32)
        assert 0 <= x0 and x1 <= 40 + 1e-9 and abs((x1 - x0) - 32) < 1e-9
    box = random_crop_box(rng, 8, 8, 16)  # smaller than the crop: upscaled, whole image
    assert box == (0.0, 0.0, 8.0, 8.0)
    assert crop_resize(img, (0, 0, 12, 8), 16, flip=True).shape == (16, 16, 3)


def test_crop_resize_matches_pillow_and_flips():
    """The torch uint8 antialiased path (whole-pixel boxes) computes Pillow's bilinear resize:
    on a smooth image every pixel agrees within 1 level, for down- and upscaling crops, and
    flip is the mirror image; `out` receives the result in place."""
    assert 64 >= TORCH_CROP_MIN_SIZE  # the size below takes the torch path
    y, x = np.mgrid[0:96, 0:120].astype(np.float64)
    img = np.stack([x * 2.1, y * 2.6, (x + y) * 1.1], -1).clip(0, 255).astype(np.uint8)
    for box in [(0, 0, 120, 96), (10, 4, 90, 80), (30, 20, 50, 44), (5, 9, 101, 57)]:
        ref = np.asarray(Image.fromarray(img).resize((64, 64), Image.BILINEAR, box=box)).astype(int)
        got = crop_resize(img, box, 64, flip=False)
        assert got.shape == (64, 64, 3) and got.dtype == np.uint8 and got.flags["C_CONTIGUOUS"]
        assert np.abs(got.astype(int) - ref).max() <= 1, box
        out = np.zeros((64, 64, 3), np.uint8)
        assert crop_resize(img, box, 64, flip=True, out=out) is out
        assert (out == got[:, ::-1]).all()
    # a crop already at the output size is copied as is
    assert (crop_resize(img, (7, 3, 71, 67), 64, flip=False) == img[3:67, 7:71]).all()
    # fractional boxes go through Pillow unchanged
    box = (0.5, 1.25, 60.5, 61.25)
    ref = np.asarray(Image.fromarray(img).resize((32, 32), Image.BILINEAR, box=box))
    assert (crop_resize(img, box, 32, flip=False) == ref).all()


def test_small_crops_take_pillow_and_load_no_torch():
    """Below TORCH_CROP_MIN_SIZE a whole-pixel crop is Pillow's resize, bit for bit (flip and `out`
    included), and a process that only makes such crops (a Ray Data reader of small images)
    never imports torch."""
    import subprocess
    import sys

    size = TORCH_CROP_MIN_SIZE // 2
    img = np.random.default_rng(3).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    for box in [(0, 0, 50, 40), (3, 5, 40, 31), (20, 10, 30, 18)]:
        ref = np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR, box=box))
        out = np.zeros((size, size, 3), np.uint8)
        assert crop_resize(img, box, size, flip=True, out=out) is out
        assert (out == ref[:, ::-1]).all(), box
    code = ("import sys, numpy as np\n"
            "from vitp.data.decode import TORCH_CROP_MIN_SIZE, crop_resize\n"
            "img = np.zeros((40, 50, 3), np.uint8)\n"
            "crop_resize(img, (3, 5, 40, 31), TORCH_CROP_MIN_SIZE - 1, flip=True)\n"
            "assert 'torch' not in sys.modules, 'a small crop imported torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_alpha_and_16_bit_conversions_equal_the_float64_formula_in_blocks_of_rows():
    """to_rgb converts a block of rows at a time in integers (bounded memory,
    benchmarks/decode_memory.py): the same bytes as the float64 formula for every (colour, alpha)
    and every 16-bit value, across block boundaries (600 rows > decode._ROWS)."""
    from vitp.data import decode

    c, a = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")  # every pair
    rgba = np.stack([c, 255 - c, c, a], axis=-1).astype(np.uint8)
    rgba = np.concatenate([rgba, rgba, rgba[:88]])  # 600 rows
    assert rgba.shape[0] > decode._ROWS
    want = np.rint((rgba[..., :3].astype(np.float64) * rgba[..., 3:4] + 255.0 * (255 - rgba[..., 3:4])) / 255.0)
    assert np.array_equal(decode.to_rgb(Image.fromarray(rgba, "RGBA")), want.astype(np.uint8))
    v = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    v = np.concatenate([v, v, v[:88]])
    want = np.rint(v.astype(np.float64) / 257.0).astype(np.uint8)
    got = decode.to_rgb(Image.fromarray(v))
    assert np.array_equal(got[..., 0], want) and np.array_equal(got[..., 2], want)
