"""Local path or URI (s3://, gs://, file://): the one module that decides, and opens either.

Owns is_uri / filesystem / join / open_input / exists / abspath. A sink: imports nothing from
`pipeline` and never torch or ray; pyarrow is imported inside the functions that need it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow.fs as pafs


def is_uri(path: str) -> bool:
    """True for `scheme://...` (s3, gs, file, ...), False for a local path."""
    return "://" in path


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow FileSystem, path inside it) for a local path or an s3:// gs:// file:// URI."""
    import pyarrow.fs as pafs  # lazy: keeps vitp --help fast

    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    """Join path parts for local paths and URIs alike ('/'-separated)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}" if p else out
    return out


_FS_CACHE: dict[str, tuple[pafs.FileSystem, str]] = {}


def open_input(path: str):
    """A seekable binary file for a local path or URI (one FS client cached per process)."""
    if not is_uri(path):
        return open(path, "rb")
    import pyarrow.fs as pafs  # lazy: keeps vitp --help fast

    scheme = path.split("://", 1)[0]
    cache_key = "/".join(path.split("/", 3)[:3])  # scheme://bucket
    if cache_key not in _FS_CACHE:  # one S3/GCS client per worker process, not per file
        _FS_CACHE[cache_key] = pafs.FileSystem.from_uri(path)
    fs = _FS_CACHE[cache_key][0]
    inner = path.split("://", 1)[1]  # s3://bucket/key -> bucket/key; file:///a -> /a
    if scheme == "file" and not inner.startswith("/"):
        inner = "/" + inner
    return fs.open_input_file(inner)


def exists(path: str) -> bool:
    """Whether a file or directory is at `path` (a local path or a URI)."""
    if not is_uri(path):
        return os.path.exists(path)
    import pyarrow.fs as pafs  # lazy: keeps vitp --help fast

    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def abspath(path: str) -> str:
    """A local path made absolute; URIs, "" (unset) and "scratch" come back unchanged."""
    if not path or path == "scratch" or is_uri(path):
        return path
    return os.path.abspath(path)
