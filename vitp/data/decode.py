"""Decode, validate and normalise one image with Pillow; resize + crop helpers shared by ingest.

Owns the rules for turning bytes into an RGB uint8 array (EXIF orientation, mode conversion,
16-bit scaling, alpha compositing), the pixel limit checked before decode, and the
quarantine reasons. Must not know about Ray, shards or models: every function is per image.
"""
from __future__ import annotations

import io
import threading
import warnings
from typing import Optional

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

# Reasons a file is quarantined (the keys of the summary line's counts).
REASONS = (
    "empty",          # zero-byte file
    "unreadable",     # the path could not be opened / read
    "not_an_image",   # Pillow cannot identify the format (e.g. text named .jpg)
    "too_large",      # width x height above the pixel limit (from the header), or the file's bytes above max_file_bytes
    "truncated",      # the file ends before the image data does
    "corrupt",        # decodes with another error
    "bad_mode",       # a pixel mode we cannot convert to RGB
    "bad_label",      # the source gave no usable label
    "outside_root",   # a symlink or list row that leads outside the corpus root (data/bounds.py)
)

# 89.5 Mpx is Pillow's own default; ours is explicit so a corpus of huge scans fails loudly.
DEFAULT_MAX_PIXELS = 89_478_485

# The formats Pillow may decode, a corpus's images (preprocess) and an image handed to `vitp predict`,
# `attention` or `analyze --image` alike: those of the file types a corpus is listed by (sources.py
# IMAGE_EXTS: .jpg/.jpeg, .png, .bmp, .gif, .tif/.tiff, .webp, .ppm/.pgm). None of Pillow's other
# decoders (some 40, EPS among them, which runs Ghostscript on load) sees bytes from anyone; whatever a
# file is named, its header decides, and anything else is `not_an_image`. (formats=None: any, unused.)
IMAGE_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP", "PPM")


def max_file_bytes(max_pixels: int) -> int:
    """The most bytes an image file may hold, checked before it is read: no image within the
    pixel limit needs more than 8 a pixel (16-bit RGBA stored raw) plus 16 MiB of metadata
    (ICC profiles, EXIF, XMP, thumbnails)."""
    return 8 * max_pixels + (16 << 20)


# Truncated files must raise, never be silently padded with grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False


class DecodeError(Exception):
    """An input cannot be used; `reason` is one of REASONS, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# Pillow warns above Image.MAX_IMAGE_PIXELS and raises above twice that. Our own limit is checked
# from the header in open_checked, so the warning only repeats it: importing this module silences it.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
_LIFT_LOCK = threading.Lock()


def _open(fp, max_pixels: int, formats: Optional[tuple[str, ...]]) -> Image.Image:
    """Image.open(fp, formats), with Pillow's own limit raised only when ours is above it.

    Pillow's limit is a process-wide setting read by every thread's Image.open, so it is only ever
    raised to another number (never None: Pillow's own check would then fail with a TypeError in a
    thread that read it mid-swap), under a lock (lifting threads never restore each other's value),
    and only for a caller whose max_pixels is above 2x Image.MAX_IMAGE_PIXELS; with the default
    limit Pillow's check never fires before ours and the setting is not touched.
    """
    pil_limit = Image.MAX_IMAGE_PIXELS
    if pil_limit is None or max_pixels <= 2 * pil_limit:
        return Image.open(fp, formats=formats)
    with _LIFT_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = max(max_pixels, saved or 0)  # Pillow raises above 2x this
        try:
            return Image.open(fp, formats=formats)
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def open_header(fp, max_pixels: int = DEFAULT_MAX_PIXELS,
                formats: Optional[tuple[str, ...]] = IMAGE_FORMATS) -> Image.Image:
    """The image in binary file `fp`, its header read and checked (a format in `formats`; at most
    `max_pixels`), nothing decoded yet; DecodeError with a reason otherwise."""
    try:
        im = _open(fp, max_pixels, formats)
    except UnidentifiedImageError:
        if formats:
            raise DecodeError("not_an_image", f"not an image of the formats read here "
                                              f"({', '.join(formats)})") from None
        raise DecodeError("not_an_image", "not an image Pillow can identify") from None
    except Image.DecompressionBombError as e:  # above 2x Pillow's limit, which is above ours
        raise DecodeError("too_large", f"{e} (limit {max_pixels}; raise max_pixels if genuine)") from None
    except Exception as e:  # noqa: BLE001 - any other header failure is a corrupt file
        if "truncated" in str(e).lower():  # the file ends inside the header
            raise DecodeError("truncated", f"truncated header ({e})") from None
        raise DecodeError("corrupt", f"header unreadable: {e}") from None
    w, h = im.size
    if w * h > max_pixels:
        raise DecodeError("too_large", f"{w}x{h} = {w * h} pixels > limit {max_pixels} "
                                       "(decompression bomb guard; raise max_pixels if genuine)")
    if w <= 0 or h <= 0:
        raise DecodeError("corrupt", f"image has size {w}x{h}")
    return im


def open_checked(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS,
                 draft_size: Optional[int] = None,
                 formats: Optional[tuple[str, ...]] = IMAGE_FORMATS) -> Image.Image:
    """Open `data`, check the header's format (one of `formats`) and pixel count BEFORE decoding,
    then decode.

    draft_size: for JPEG, let libjpeg decode at 1/2, 1/4, 1/8 scale as long as both sides
    stay >= draft_size (a 4000px photo stored at 256px decodes ~8x faster).
    """
    if len(data) == 0:
        raise DecodeError("empty", "zero-byte file")
    im = open_header(io.BytesIO(data), max_pixels, formats)
    if draft_size and im.format == "JPEG":
        # Keep EXIF-rotated sizes right: draft scales both sides by the same factor.
        im.draft(None, (draft_size, draft_size))
    try:
        im.load()
    except Image.DecompressionBombError as e:  # some formats (GIF frames) check again on load
        raise DecodeError("too_large", f"{e} (limit {max_pixels})") from None
    except OSError as e:
        msg = str(e)
        if any(t in msg.lower() for t in ("truncated", "broken data stream", "ended prematurely")):
            raise DecodeError("truncated", f"truncated {im.format or 'image'} ({msg})") from None
        raise DecodeError("corrupt", f"{im.format or 'image'} decode failed ({msg})") from None
    except Exception as e:  # noqa: BLE001
        raise DecodeError("corrupt", f"{im.format or 'image'} decode failed ({e})") from None
    return im


# Rows converted at a time by to_rgb: its wider-typed temporaries are this many rows, not the whole
# image (a 16 Mpx RGBA PNG of a few KB took 0.85 GB as one float32 pass; benchmarks/decode_memory.py)
_ROWS = 256


def to_rgb(im: Image.Image) -> np.ndarray:
    """Any Pillow image -> (H, W, 3) uint8 RGB, EXIF orientation applied.

    - 16-bit ("I;16*", or "I" holding 0..65535) is scaled to 8 bits by /257 (65535 -> 255).
    - "F" (float) is taken as 0..1 if its max <= 1, else clipped to 0..255.
    - Alpha (RGBA, LA, PA, P with a transparent colour) is composited on WHITE: a transparent
      pixel becomes (255, 255, 255), so logos and cut-outs keep their look on paper.
    - CMYK, YCbCr, greyscale ("L", "1") and palette go through Pillow's convert("RGB").
    """
    try:
        im = ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not lose the image
        pass
    mode = im.mode
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(im)
        scale = 1 if mode == "I" and a.max(initial=0) <= 255 else 257
        out = np.empty(a.shape + (3,), np.uint8)
        for r in range(0, a.shape[0], _ROWS):  # a block of rows at a time: no full-size int64 copy
            v = np.clip(a[r:r + _ROWS].astype(np.int64), 0, 255 * scale)
            # round(v / scale), exact in integers (no ties: 257 is odd, scale 1 divides)
            out[r:r + _ROWS] = ((2 * v + scale) // (2 * scale))[..., None]
        return out
    if mode == "F":
        a = np.asarray(im).astype(np.float64)
        a = a * 255.0 if a.max(initial=0) <= 1.0 else a
        return np.repeat(np.rint(np.clip(a, 0, 255)).astype(np.uint8)[..., None], 3, axis=2)
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        mode == "P" and "transparency" in im.info) or (mode in ("L", "RGB") and "transparency" in im.info)
    if has_alpha:
        rgba = np.asarray(im if im.mode == "RGBA" else im.convert("RGBA"))  # (convert copies)
        out = np.empty(rgba.shape[:2] + (3,), np.uint8)
        for r in range(0, rgba.shape[0], _ROWS):  # a block of rows at a time (see _ROWS)
            block = rgba[r:r + _ROWS].astype(np.uint32)
            c, a = block[..., :3], block[..., 3:4]
            # composite on white, round(c a / 255 + 255 (1 - a / 255)) in integers: exact, and
            # no ties (the numerator would be an odd multiple of 255 / 2)
            out[r:r + _ROWS] = (2 * (c * a + 255 * (255 - a)) + 255) // 510
        return out
    try:
        rgb = im.convert("RGB")
    except Exception as e:  # noqa: BLE001
        raise DecodeError("bad_mode", f"cannot convert mode {mode} to RGB ({e})") from None
    return np.asarray(rgb, dtype=np.uint8)


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS,
                 draft_size: Optional[int] = None,
                 formats: Optional[tuple[str, ...]] = IMAGE_FORMATS) -> np.ndarray:
    """Bytes of an image file of one of `formats` -> (H, W, 3) uint8; DecodeError with a reason
    otherwise."""
    im = open_checked(data, max_pixels=max_pixels, draft_size=draft_size, formats=formats)
    try:
        return to_rgb(im)
    except DecodeError:
        raise
    except OSError as e:  # lazy formats can still fail during convert
        raise DecodeError("truncated" if "truncated" in str(e) else "corrupt", str(e)) from None


# --------------------------------------------------------------------------- geometry


def resize_center_crop(img: np.ndarray, size: int, resample=Image.BICUBIC) -> np.ndarray:
    """(H, W, 3) -> (size, size, 3): resize the shorter side to `size`, crop the centre.

    Done as one Pillow resize of the centred square box, which is what "resize shorter side,
    then centre crop" computes; small images (8x8 digits) are upscaled.
    """
    h, w = img.shape[:2]
    if h == size and w == size:
        return img
    s = min(h, w)
    box = ((w - s) / 2.0, (h - s) / 2.0, (w + s) / 2.0, (h + s) / 2.0)
    return np.asarray(Image.fromarray(img).resize((size, size), resample=resample, box=box))


# The smallest output (px) that crop_resize sends through torch's kernel: below it Pillow is as
# fast or faster (torch pays ~0.1 ms a call: Pillow 52 vs 77 us at 32 px, about even at 64, 891
# vs 288 us at 224 px, one core: benchmarks/crop_kernels.py), and a Ray Data reader process that
# never takes the torch path never imports torch (2 CPU-s each, 218 MB resident after it).
TORCH_CROP_MIN_SIZE = 64


def crop_resize(img: np.ndarray, box: tuple[float, float, float, float], size: int,
                flip: bool, resample=Image.BILINEAR, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Crop `box` (x0, y0, x1, y1) out of (H, W, 3) and resize to (size, size, 3) in one pass;
    written into `out` (a contiguous (size, size, 3) uint8 array) when given.

    Whole-pixel boxes with bilinear resampling (every inception crop, and random crops of
    images already >= `size`) take torch's uint8 antialiased bilinear kernel from
    TORCH_CROP_MIN_SIZE up: the same triangle filter as Pillow's, about 3x faster on one core
    at 224 px, channels-last in and out, and the flip rides on the copy out. It crops first and
    then resizes (as torchvision does), where Pillow's box resize also reads pixels just
    outside the box: on smooth content they agree within a level; on noisy content the
    border rows differ, most for small crops scaled up a lot (8 px -> 224 px). Fractional
    boxes (upscaled random crops), other filters and smaller outputs go through Pillow.
    """
    if out is None:
        out = np.empty((size, size, 3), dtype=np.uint8)
    if (resample == Image.BILINEAR and size >= TORCH_CROP_MIN_SIZE
            and all(float(v).is_integer() for v in box)):
        import torch  # lazy: torch (only this fast path needs it; preprocess workers never do)

        if min(img.strides) < 0:  # torch takes no negative strides (e.g. a flipped view)
            img = np.ascontiguousarray(img)
        x0, y0, x1, y1 = (int(v) for v in box)
        with warnings.catch_warnings():  # read-only Arrow page buffers: only ever read here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(img[y0:y1, x0:x1])  # (h, w, 3) strided view, no copy
        if src.shape[0] != size or src.shape[1] != size:
            src = _resize_bilinear_chw(src.permute(2, 0, 1), size).permute(1, 2, 0)
        torch.from_numpy(out).copy_(src.flip(1) if flip else src)
        return out
    im = Image.fromarray(img).resize((size, size), resample=resample, box=box)
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    np.copyto(out, np.asarray(im))
    return out


def _resize_bilinear_chw(img_chw, size: int):
    """(3, h, w) uint8 tensor -> (3, size, size) uint8, antialiased bilinear, half-pixel centres."""
    import torch  # lazy: torch (see crop_resize)
    import torch.nn.functional as F

    # channels-last with an unambiguous batch stride: the kernel then writes channels-last
    # too, and the caller's (S, S, 3) view of the result is a plain copy, not a transpose
    x = img_chw.unsqueeze(0).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                             align_corners=False)[0]


def inception_crop_box(rng: np.random.Generator, h: int, w: int, scale_min: float,
                       scale_max: float = 1.0, ratio=(3 / 4, 4 / 3)) -> tuple[float, float, float, float]:
    """Random-resized-crop box (Szegedy et al. / torchvision's RandomResizedCrop rule).

    Area fraction ~ U(scale_min, scale_max), log aspect ratio ~ U(log 3/4, log 4/3); ten tries,
    then the centre crop of the whole image clipped to the ratio range.
    """
    area = h * w
    log_r = (np.log(ratio[0]), np.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale_min, scale_max)
        ar = float(np.exp(rng.uniform(*log_r)))
        cw = int(round(np.sqrt(target * ar)))
        ch = int(round(np.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            y0 = int(rng.integers(0, h - ch + 1))
            x0 = int(rng.integers(0, w - cw + 1))
            return (x0, y0, x0 + cw, y0 + ch)
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return (x0, y0, x0 + cw, y0 + ch)


def random_crop_box(rng: np.random.Generator, h: int, w: int, size: int) -> tuple[float, float, float, float]:
    """Pad-free random crop: the shorter side is resized to max(size, shorter side) (stored
    images are only upscaled when smaller than `size`), then a size x size window is drawn
    uniformly on that grid; returned in source coordinates for `crop_resize`."""
    scale = max(size, min(h, w)) / min(h, w)
    rh, rw = int(round(h * scale)), int(round(w * scale))  # resized image, (rh, rw) >= size
    y0 = int(rng.integers(0, rh - size + 1))
    x0 = int(rng.integers(0, rw - size + 1))
    return (x0 / scale, y0 / scale, (x0 + size) / scale, (y0 + size) / scale)


def encode_jpeg(img: np.ndarray, quality: int) -> bytes:
    """(H, W, 3) uint8 -> JPEG bytes. At quality >= 90 chroma is kept at full resolution
    (4:4:4): 4:2:0 costs ~8 dB PSNR on small, colourful images for ~25% fewer bytes."""
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=int(quality),
                              subsampling=0 if quality >= 90 else 2)
    return buf.getvalue()


def decode_stored(image, height: int, width: int, storage_format: str) -> np.ndarray:
    """A shard row's `image` cell -> (height, width, 3) uint8. A uint8 cell may be bytes or
    already an array (ingest's view of the page buffer); either way no pixel is copied."""
    if storage_format == "jpeg":  # written by encode_jpeg; a shard from elsewhere gets no other decoder
        return np.asarray(Image.open(io.BytesIO(image), formats=("JPEG",)).convert("RGB"))
    return np.frombuffer(image, dtype=np.uint8).reshape(height, width, 3)
