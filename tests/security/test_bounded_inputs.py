"""Files handed to vitp are read within bounds: an image given to predict, attention or analyze is
read no larger than the data pipeline reads one (its size first), and every image, a corpus's too,
is decoded only by the decoders of the pipeline's file types; an .npz to import is refused from its
zip directory and .npy headers before any array is read (a zip bomb). The CLI lines are in
tests/cli/test_bad_inputs.py."""
import io
import math
import struct
import zipfile

import numpy as np
import pytest
from PIL import Image, UnidentifiedImageError

from vitp.cli.evaluate import _check_image, _read_image
from vitp.data.decode import (DEFAULT_MAX_PIXELS, IMAGE_FORMATS, DecodeError, decode_image, decode_stored,
                              encode_jpeg, max_file_bytes, open_header)
from vitp.data.sources import IMAGE_EXTS
from vitp.errors import InputError
from vitp.model.convert_npz import NPZ_MEMBER_BYTES, NPZ_TOTAL_BYTES, check_npz_sizes, load_npz


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)).save(buf, format=fmt)
    return buf.getvalue()


def test_the_formats_read_are_those_of_the_pipelines_file_types():
    """One list: every extension a corpus is listed by is a format of IMAGE_FORMATS, and each of
    them decodes through it."""
    by_ext = Image.registered_extensions()
    assert {by_ext[e] for e in IMAGE_EXTS} == set(IMAGE_FORMATS)
    for fmt in IMAGE_FORMATS:
        assert decode_image(_encoded(fmt), formats=IMAGE_FORMATS).shape == (8, 8, 3), fmt


@pytest.mark.parametrize("fmt", ["ICO", "TGA", "PCX", "SGI", "EPS"])
def test_another_format_pillow_reads_is_refused_before_any_decoder_runs(fmt):
    """Pillow identifies each of these (EPS: its decoder runs Ghostscript on load); every decode
    here, a corpus's (preprocess: rows.py calls decode_image as is) and a stored shard's too, refuses
    it from its header."""
    data = _encoded(fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # what Pillow alone would go on to decode
    with pytest.raises(DecodeError, match=r"not an image of the formats read here \(JPEG, PNG") as e:
        decode_image(data)
    assert e.value.reason == "not_an_image"
    with pytest.raises(DecodeError, match="not an image of the formats"):
        open_header(io.BytesIO(data), formats=IMAGE_FORMATS)
    with pytest.raises(UnidentifiedImageError):  # a shard's image cell, stored as JPEG by us
        decode_stored(data, 8, 8, "jpeg")
    assert decode_stored(encode_jpeg(np.zeros((8, 8, 3), np.uint8), 90), 8, 8, "jpeg").shape == (8, 8, 3)


def test_an_image_for_predict_is_refused_by_its_size_before_it_is_read(tmp_path):
    """A real PNG that goes on past the bound (a sparse tail): refused by its size, both where the
    command checks every image before the model loads and where it reads one."""
    path = tmp_path / "big.png"
    path.write_bytes(_encoded("PNG"))
    limit = max_file_bytes(DEFAULT_MAX_PIXELS)
    with open(path, "r+b") as f:
        f.truncate(limit + 1)
    with pytest.raises(InputError, match=rf"big.png: {limit + 1} bytes, more than an image within the "
                                         rf"{DEFAULT_MAX_PIXELS}-pixel limit takes \({limit}\)"):
        _check_image(str(path))
    with pytest.raises(InputError, match=rf"big.png: not a usable image \(too_large: {limit + 1} bytes, more "
                                         rf"than the {limit} allowed\)"):
        _read_image(str(path), 32)
    with open(path, "r+b") as f:  # the PNG alone again: read and decoded
        f.truncate(len(_encoded("PNG")))
    assert _read_image(str(path), 32)[1].shape == (32, 32, 3)


def test_an_icon_for_predict_is_refused_by_its_header(tmp_path):
    path = tmp_path / "x.png"  # named as a PNG: the header says what it is
    path.write_bytes(_encoded("ICO"))
    for check in (lambda: _check_image(str(path)), lambda: _read_image(str(path), 32)):
        with pytest.raises(InputError, match=r"x.png: not a usable image \(not_an_image: not an image of the "
                                             r"formats read here"):
            check()


# --------------------------------------------------------------------------- .npz


def _npy(shape: tuple, data: bytes = b"\0" * 16) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return out.getvalue() + data


def _npz(members: dict[str, bytes], declared: dict[str, int] | None = None) -> bytes:
    """An .npz of these members, the zip's directory (and local headers) declaring `declared`
    uncompressed sizes where given: what a zip bomb claims, without the gigabytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    raw = bytearray(out.getvalue())
    at = raw.find(b"PK\x01\x02")
    while at >= 0:  # each central directory entry: size at +24, name length +28, local header offset +42
        name = bytes(raw[at + 46:at + 46 + struct.unpack_from("<H", raw, at + 28)[0]]).decode()
        if declared and name in declared:
            struct.pack_into("<I", raw, at + 24, declared[name])
            struct.pack_into("<I", raw, struct.unpack_from("<I", raw, at + 42)[0] + 22, declared[name])
        at = raw.find(b"PK\x01\x02", at + 4)
    return bytes(raw)


def _write(tmp_path, data: bytes) -> str:
    path = tmp_path / "w.npz"
    path.write_bytes(data)
    return str(path)


def test_an_npz_within_the_bounds_loads(tmp_path):
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.ones(4))
    path = _write(tmp_path, buf.getvalue())
    check_npz_sizes(path, path)
    w = load_npz(path)
    assert w["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and w["b"].tolist() == [1, 1, 1, 1]


def test_a_member_declared_beyond_the_bound_is_refused_before_any_is_read(tmp_path):
    shape = (NPZ_MEMBER_BYTES // 4,)  # one float32 more than the bound holds, with the header
    path = _write(tmp_path, _npz({"w.npy": _npy(shape)}, {"w.npy": 128 + 4 * shape[0]}))
    with pytest.raises(InputError, match=rf"w.npz: its member 'w.npy' declares {128 + 4 * shape[0]} bytes "
                                         rf"uncompressed, more than the {NPZ_MEMBER_BYTES}"):
        load_npz(path)
    path = _write(tmp_path, _npz({"notes.txt": b"x"}, {"notes.txt": NPZ_MEMBER_BYTES + 1}))  # not an .npy too
    with pytest.raises(InputError, match="its member 'notes.txt' declares"):
        load_npz(path)


def test_members_declared_beyond_the_total_are_refused(tmp_path):
    n = NPZ_TOTAL_BYTES // NPZ_MEMBER_BYTES + 1
    shape = ((NPZ_MEMBER_BYTES - 128) // 4,)  # each member exactly at the bound
    names = [f"w{i}.npy" for i in range(n)]
    path = _write(tmp_path, _npz({m: _npy(shape) for m in names}, {m: NPZ_MEMBER_BYTES for m in names}))
    with pytest.raises(InputError, match=rf"its members declare {n * NPZ_MEMBER_BYTES} bytes uncompressed in all, "
                                         rf"more than the {NPZ_TOTAL_BYTES}"):
        load_npz(path)


def test_an_npy_header_declaring_more_than_its_member_holds_is_refused(tmp_path):
    """numpy allocates what the header says before it reads: 2**40 floats in a 144-byte member."""
    path = _write(tmp_path, _npz({"w.npy": _npy((2**40,))}))
    with pytest.raises(InputError, match=rf"its member 'w.npy' has an .npy header declaring {128 + 4 * 2**40} "
                                         r"bytes, more than the 144 the member holds"):
        load_npz(path)
    assert math.prod((2**40,)) * 4 > NPZ_TOTAL_BYTES  # (the header alone would have passed a size check)
