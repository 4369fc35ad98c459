"""A source's files, read through vitp.storage: metadata and image bytes within the limits of
bounds.py, and the listings of a folder, which on a local disk never follow a link out of the
source's root (its fence) unless the user allows it. sources.py plans from these.
"""
from __future__ import annotations

import os

import pyarrow.fs as pafs

from ..errors import InputError
from ..storage import filesystem, is_uri, join
from .bounds import METADATA_BYTES, local_entries, local_walk, read_bounded
from .decode import DecodeError, max_file_bytes


def read_bytes(path: str, offset: int = -1, length: int = -1) -> bytes:
    """The bytes of a metadata file (labels CSV, annotations, a CIFAR batch), or of
    [offset, offset+length); OSError if it cannot be read, InputError above METADATA_BYTES."""
    try:
        return read_bounded(path, offset, length, METADATA_BYTES)
    except DecodeError as e:
        raise InputError(f"{path}: {e} for a dataset's metadata file; check that data.path "
                         "names the dataset's own files") from None


def read_image(path: str, offset: int, length: int, max_pixels: int) -> bytes:
    """An image file's bytes, DecodeError("too_large") before reading more than an image within
    `max_pixels` can hold (decode.max_file_bytes)."""
    try:
        return read_bounded(path, offset, length, max_file_bytes(max_pixels))
    except DecodeError as e:
        raise DecodeError(e.reason, f"{e} for an image within the pixel limit {max_pixels} "
                                    "(raise max_pixels if genuine)") from None


def list_files(root: str, fence: str = "", allow_outside: bool = False) -> list[tuple[str, str, str]]:
    """All non-hidden files under root, sorted: (relative path, readable path/URI, error). On a
    local disk a symlink out of `fence` (default: root) is one entry with its outside_root error
    and is not followed (bounds.local_walk); object stores have no links."""
    fs, base = filesystem(root)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{root}: does not exist; set data.path to the corpus directory")
    if isinstance(fs, pafs.LocalFileSystem):
        fence_in = filesystem(fence or root)[1]
        out = [(rel, join(root, rel) if is_uri(root) else path, err)
               for rel, path, err in local_walk(base, fence_in, allow_outside)]
        return sorted(out)
    out = []
    for fi in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        rel = os.path.relpath(fi.path, base).replace(os.sep, "/")
        if fi.type == pafs.FileType.File and not any(part.startswith(".") for part in rel.split("/")):
            out.append((rel, join(root, rel), ""))
    return sorted(out)


def file_type(path: str) -> pafs.FileType:
    fs, base = filesystem(path)
    return fs.get_file_info(base).type


def entries(root: str, fence: str, allow_outside: bool) -> list[tuple[str, bool, str]]:
    """(name, is a directory, error) of root's non-hidden entries (bounds.local_entries)."""
    fs, base = filesystem(root)
    if isinstance(fs, pafs.LocalFileSystem):
        return local_entries(base, filesystem(fence or root)[1], allow_outside)
    return sorted((fi.base_name, fi.type == pafs.FileType.Directory, "")
                  for fi in fs.get_file_info(pafs.FileSelector(base)) if not fi.base_name.startswith(".")
                  and fi.type in (pafs.FileType.File, pafs.FileType.Directory))


def child_dirs(root: str, fence: str = "", allow_outside: bool = False) -> list[str]:
    """The class directories: a directory link out of `fence` is none (the top unit lists it)."""
    return [n for n, is_dir, err in entries(root, fence, allow_outside) if is_dir and not err]


def files_with(root: str, ext: str, allow_outside: bool = False) -> list[tuple[str, str, str]]:
    """(rel, path, error) of the `ext` files under root, and of every link out of it."""
    if root.endswith(ext):
        return [(os.path.basename(root), root, "")]
    return [(rel, p, err) for rel, p, err in list_files(root, root, allow_outside) if rel.endswith(ext) or err]
