"""What a dataset file from anyone may make the listing do: labels parsed as bounded ASCII
integers, every read checked against a byte limit before it is made, and every listed path kept
inside the corpus root (symlinks and list rows that lead out are quarantined as `outside_root`).
Used by sources.py on the driver and in its Ray listing tasks; decodes nothing.
"""
from __future__ import annotations

import os
import re
import stat
import tarfile
from typing import Iterator, Optional

from ..storage import filesystem, is_uri, within
from .decode import DecodeError

# ImageNet-21k has 21,843 classes and JFT 18k: a million is far above any real class map, and low
# enough that the driver can build that many names. A label at or above it is quarantined.
MAX_CLASSES = 1_000_000
CLS_BYTES = 64  # a WebDataset .cls member: a class index and some whitespace, never more
LABEL_CHARS = 256  # a label written as text (CSV, Parquet): a class name, not a document
METADATA_BYTES = 256 << 20  # labels CSV, annotation files, .mat, a CIFAR batch (CIFAR-100's is 155 MB)
TAR_HEADER_BYTES = 64 << 10  # a tar's long-name or pax header, read whole by tarfile
# A Parquet row group's image column, decompressed whole by the task that decodes its rows: a
# Hugging Face image dataset writes some tens of MB a group
PARQUET_GROUP_BYTES = 2 << 30

_INDEX = re.compile(rb"\s*([0-9]+)\s*")  # [0-9] is ASCII only, where str.isdigit() takes "²"


def parse_index(raw: bytes, where: str, size: Optional[int] = None) -> tuple[int, str]:
    """A class index written as text -> (index, "") or (-1, "bad_label: why"). `size`: the
    bytes the source holds, when the caller has not read them (they are more than CLS_BYTES)."""
    size = len(raw) if size is None else size
    if size > CLS_BYTES:
        return -1, f"bad_label: {where} holds {size} bytes, more than a class index takes ({CLS_BYTES}); fix the label"
    m = _INDEX.fullmatch(raw)
    if not m:
        return -1, (f"bad_label: {where} holds {raw.decode('utf-8', 'replace')!r}, not a class index "
                    f"(ASCII digits 0..{MAX_CLASSES - 1}); fix the label")
    value = int(m.group(1))  # at most CLS_BYTES digits: far inside int()'s digit limit
    if value >= MAX_CLASSES:
        return -1, (f"bad_label: {where} holds label {value}, above the largest class index allowed "
                    f"({MAX_CLASSES - 1}); fix the label")
    return value, ""


def label_text_problem(text: str, where: str) -> str:
    """"" for a usable text label (a class name), else the bad_label reason."""
    if len(text) > LABEL_CHARS:
        return f"bad_label: {where} has a label of {len(text)} characters, more than {LABEL_CHARS}; fix the label"
    return ""


def _size(f) -> int:
    if callable(getattr(f, "size", None)):  # pyarrow's files: from the object's metadata
        return f.size()
    return os.fstat(f.fileno()).st_size


def _open(path: str):
    """A local file opened without blocking (a FIFO would hang a plain open) and only when it
    is a regular file; a URI through pyarrow."""
    if is_uri(path):
        fs, inner = filesystem(path)
        return fs.open_input_file(inner)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded(path: str, offset: int, length: int, limit: int) -> bytes:
    """The bytes of `path` (or of [offset, offset+length)), refused with DecodeError("too_large")
    before reading when there are more than `limit`; OSError when it cannot be read."""
    with _open(path) as f:
        size = length if offset >= 0 else _size(f)
        if size > limit:
            raise DecodeError("too_large", f"{size} bytes, more than the {limit} allowed")
        if offset >= 0:
            f.seek(offset)
        return f.read(size)  # never more than was checked, even if the file grew since


def parquet_group_problem(group, column: str, where: str) -> str:
    """"" when the row group `group` (pyarrow RowGroupMetaData) holds at most PARQUET_GROUP_BYTES of
    `column` once decompressed (every leaf of a struct column such as {bytes, path} counted), from
    the file's footer alone; else the too_large reason its rows are quarantined with."""
    size = sum(group.column(i).total_uncompressed_size for i in range(group.num_columns)
               if group.column(i).path_in_schema.split(".")[0] == column)
    if size <= PARQUET_GROUP_BYTES:
        return ""
    return (f"too_large: {where}: its row group's {column} column is {size} bytes decompressed, more than "
            f"the {PARQUET_GROUP_BYTES} a task reads at once; rewrite it with smaller row groups")


# ------------------------------------------------------------------------------- roots


def _local(path: str) -> str:
    """file:// URIs as local paths, so they compare with local roots."""
    if is_uri(path) and path.startswith("file://"):
        return filesystem(path)[1]
    return path


def inside(path: str, root: str) -> bool:
    """`path` is `root` or under it, after resolving symlinks and `..` (storage.within)."""
    return within(_local(path), _local(root))


class Fence:
    """`path in Fence(root)`: inside() for many paths, each directory resolved once (a labels
    CSV names a million files in a few thousand directories)."""

    def __init__(self, root: str):
        self.root = _local(root)
        self.real = "" if is_uri(self.root) else os.path.realpath(self.root)
        self._dirs: dict[str, str] = {}

    def __contains__(self, path: str) -> bool:
        path = _local(path)
        if not self.real or is_uri(path):
            return within(path, self.root)
        d, name = os.path.split(path)  # not normalised first: `link/..` is where the link leads
        if name in ("", ".", "..") or os.path.islink(path):
            real = os.path.realpath(path)
        else:
            if d not in self._dirs:
                self._dirs[d] = os.path.realpath(d or ".")
            real = os.path.join(self._dirs[d], name)
        return real == self.real or real.startswith(self.real.rstrip("/") + "/")


def outside_error(what: str, root: str) -> str:
    return (f"outside_root: {what} outside {root}; move it under {root}, or set "
            "data.allow_outside_root=true if you trust every path the corpus names")


def local_entries(d: str, fence: str, allow_outside: bool) -> list[tuple[str, bool, str]]:
    """(name, is a directory, error) of the non-hidden entries of local directory `d`, sorted.
    A symlink whose target is outside `fence` has an outside_root error; its target is only
    stat'ed, never opened or listed. Entries that are neither files nor directories are left out."""
    out = []
    with os.scandir(d) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            is_dir, is_file = e.is_dir(), e.is_file()  # through a symlink: its target's type
            err = ""
            if e.is_symlink() and not allow_outside and not inside(e.path, fence):
                err = outside_error(f"{e.path} is a symlink to a {'directory' if is_dir else 'file'}", fence)
            elif not (is_dir or is_file):
                continue  # sockets, FIFOs, devices, dangling links inside the root: not inputs
            out.append((e.name, is_dir, err))
    return sorted(out)


def local_walk(top: str, fence: str, allow_outside: bool) -> Iterator[tuple[str, str, str]]:
    """(relative path, path, error) of every non-hidden file under local directory `top`.
    Symlinks inside `fence` are followed; one that leads out is one entry with its error, and a
    directory link back to a directory being walked is one `unreadable` entry (no loop)."""
    stack = [("", top, frozenset({os.path.realpath(top)}))]
    while stack:
        rel, d, above = stack.pop()
        for name, is_dir, err in local_entries(d, fence, allow_outside):
            path, r = os.path.join(d, name), rel + name
            real = os.path.realpath(path) if is_dir and not err else ""
            if real in above:
                yield r, path, f"unreadable: {path} is a symlink back to {real} (a loop); remove the link"
            elif is_dir and not err:
                stack.append((r + "/", path, above | {real}))
            else:
                yield r, path, err


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a long-name or pax header whole: one larger than TAR_HEADER_BYTES ends the
    tar's listing (tarfile.ReadError) before it is read."""

    def _proc_member(self, tf):
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                         tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) and self.size > TAR_HEADER_BYTES:
            raise tarfile.ReadError(f"a {self.size}-byte member header at offset {self.offset}, "
                                    f"more than {TAR_HEADER_BYTES}")
        return super()._proc_member(tf)
