"""Local path or URI (s3://, gs://, file://): the one module that decides, reads and writes either.

Object storage has no rename: a write is one PUT; local writes go through a temporary name. The S3
endpoint and credentials come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).
A sink: imports nothing from `vitp` and never torch or ray; pyarrow is imported lazily.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import pyarrow.fs as pafs


def is_uri(path: str) -> bool:
    """True for `scheme://...` (s3, gs, file, ...), False for a local path."""
    return "://" in path


_FS_CACHE: dict[tuple, pafs.FileSystem] = {}


# scheme://user@... or scheme://user:password@...: the password runs at least to the next "@" (cloud
# secret keys hold "/", often not percent-encoded); any userinfo at all is refused, so where a
# password holding "@" ends does not matter here (redaction masks it up to the last "@")
_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/@\s]*@|[^/@\s:]*:[^@\s]*@)")


def has_credentials(path: str) -> bool:
    """True for a URI with credentials before its host or bucket (s3://KEY:SECRET@bucket/...)."""
    return bool(_USERINFO.match(path or ""))


# Seconds an S3 request may go without progress before the client takes it for failed. The AWS
# SDK's 3 s failed every part upload whose last bytes took longer than that to leave the node's
# socket buffer (a 1 MB part at 100 KB/s: 10 s), on every try; boto3 and the AWS CLI wait 60 s.
S3_STALL_S = 30.0


def _s3(bucket_uri: str) -> pafs.FileSystem:
    """An S3 filesystem for `s3://bucket`, with the endpoint of AWS_ENDPOINT_URL(_S3) if set
    (MinIO, moto, Ceph...; http:// endpoints are spoken to without TLS), else in the bucket's own
    region (as pyarrow's from_uri finds it)."""
    import pyarrow.fs as pafs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return pafs.S3FileSystem(region=pafs.resolve_s3_region(bucket_uri.split("://", 1)[1]),
                                 request_timeout=S3_STALL_S)
    scheme, _, host = endpoint.partition("://")
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
    return pafs.S3FileSystem(endpoint_override=host.rstrip("/"), scheme=scheme or "https",
                             region=region, request_timeout=S3_STALL_S)


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow FileSystem, path inside it) for a local path or an s3:// gs:// file:// URI.

    One client per (scheme, bucket, endpoint) and process: S3/GCS clients are costly to make.
    """
    import pyarrow.fs as pafs  # lazy: keeps vitp --help fast

    if not is_uri(path):
        return pafs.LocalFileSystem(), os.path.abspath(path)
    scheme, rest = path.split("://", 1)
    if scheme == "file":
        return pafs.LocalFileSystem(), "/" + rest.lstrip("/")
    bucket = rest.split("/", 1)[0]
    key = (scheme, bucket, os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if key not in _FS_CACHE:
        _FS_CACHE[key] = _s3(f"s3://{bucket}") if scheme == "s3" else \
            pafs.FileSystem.from_uri(f"{scheme}://{bucket}")[0]
    return _FS_CACHE[key], rest.rstrip("/")


def join(base: str, *parts: str) -> str:
    """Join path parts for local paths and URIs alike ('/'-separated)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}" if p else out
    return out


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def dirname(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


def open_input(path: str):
    """A seekable binary file for a local path or URI."""
    if not is_uri(path):
        return open(path, "rb")
    fs, inner = filesystem(path)
    return fs.open_input_file(inner)


def open_output(path: str):
    """A binary output stream at `path` (parents created). On object storage the object appears
    when the stream is closed; for whole-file writes prefer write_bytes (atomic on local disk).
    The bytes go as given: pyarrow would otherwise compress a name ending .gz/.bz2/.zst once more."""
    fs, inner = filesystem(path)
    fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
    return fs.open_output_stream(inner, compression=None)


def _info(path: str):
    fs, inner = filesystem(path)
    return fs.get_file_info(inner)


def exists(path: str) -> bool:
    """Whether a file or directory is at `path` (a local path or a URI)."""
    if not is_uri(path):
        return os.path.exists(path)
    import pyarrow.fs as pafs

    return _info(path).type != pafs.FileType.NotFound


def isdir(path: str) -> bool:
    """A directory (or, on object storage, a prefix with objects under it)."""
    if not is_uri(path):
        return os.path.isdir(path)
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.Directory


def isfile(path: str) -> bool:
    if not is_uri(path):
        return os.path.isfile(path)
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.File


def size(path: str) -> int | None:
    """Bytes of the file at `path`, None when there is none."""
    if not is_uri(path):
        return os.path.getsize(path) if os.path.isfile(path) else None
    import pyarrow.fs as pafs

    info = _info(path)
    return info.size if info.type == pafs.FileType.File else None


def read_bytes(path: str) -> bytes:
    with open_input(path) as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """All or nothing: local files through a temporary name and rename, objects in one PUT."""
    if not is_uri(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return
    with open_output(path) as f:
        f.write(data)


def read_json(path: str) -> Any:
    return json.loads(read_bytes(path))


def write_json(path: str, obj: Any) -> None:
    write_bytes(path, json.dumps(obj, indent=1).encode())


def listdir(path: str) -> list[str]:
    """Names of the entries directly under `path`, sorted; [] when there is no such directory."""
    if not is_uri(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    import pyarrow.fs as pafs

    fs, inner = filesystem(path)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted(i.base_name for i in infos)


def file_sizes(root: str, skip_dirs: tuple[str, ...] = ()) -> dict[str, int]:
    """Relative '/'-path -> size of every file under `root` (top-level `skip_dirs` left out).

    Local files that vanish between listing and stat (a writer's temporary name) are left out.
    """
    out: dict[str, int] = {}
    if not is_uri(root):
        for dirpath, dirnames, files in os.walk(root):
            if dirpath == root:
                dirnames[:] = [d for d in dirnames if d not in skip_dirs]
            for f in files:
                path = os.path.join(dirpath, f)
                try:
                    out[os.path.relpath(path, root).replace(os.sep, "/")] = os.path.getsize(path)
                except FileNotFoundError:
                    continue
        return out
    import pyarrow.fs as pafs

    fs, inner = filesystem(root)
    for info in fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(inner):].lstrip("/")
        if rel.split("/", 1)[0] not in skip_dirs or "/" not in rel:
            out[rel] = info.size
    return out


def makedirs(path: str) -> None:
    fs, inner = filesystem(path)
    fs.create_dir(inner, recursive=True)


def within(path: str, root: str) -> bool:
    """True when `path` is `root` or lies under it: local paths compared after resolving
    symlinks and `..` (a link inside `root` that points outside is outside), URIs by scheme,
    bucket and normalised key."""
    import posixpath

    if is_uri(path) != is_uri(root):
        return False
    if not is_uri(path):
        p, r = os.path.realpath(path), os.path.realpath(root)
    else:
        (ps, pk), (rs, rk) = (u.split("://", 1) for u in (path, root))
        if ps != rs:
            return False
        p, r = (posixpath.normpath("/" + k) for k in (pk, rk))
    return p == r or p.startswith(r.rstrip("/") + "/")


def rmtree(path: str, root: str) -> None:
    """Remove a directory tree (or prefix, or one file) if it exists. Every recursive delete goes through here
    and names the root its caller owns (the directory it made, the output the user named):
    ValueError, deleting nothing, when `path` is not `root` or under it."""
    if not within(path, root):
        raise ValueError(f"refusing to delete {path}: it is not inside {root}")
    if not is_uri(path):
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        return
    if isdir(path):
        fs, inner = filesystem(path)
        fs.delete_dir(inner)
    elif isfile(path):
        fs, inner = filesystem(path)
        fs.delete_file(inner)


class IncompleteCopy(OSError):
    """A copy that reported success while files did not arrive whole: pyarrow's `copy_files` drops
    the error of an S3 part upload that failed (a broken connection, a stall past S3_STALL_S): it
    is only logged as the stream is destroyed. Transient: `through_outages` tries it again."""


def copy_dir(src: str, dest: str) -> int:
    """Copy the files under `src` to `dest` (each a path or URI, the two may differ); returns bytes
    copied. Both sides are listed afterwards and every file of `src` must be at `dest` with its
    size, else IncompleteCopy names what is missing: a caller that writes a completion marker next
    (a checkpoint) writes it only over files that are there."""
    import pyarrow.fs as pafs

    src_fs, src_inner = filesystem(src)
    dest_fs, dest_inner = filesystem(dest)
    dest_fs.create_dir(dest_inner, recursive=True)
    pafs.copy_files(src_inner, dest_inner, source_filesystem=src_fs, destination_filesystem=dest_fs)
    sent, arrived = file_sizes(src), file_sizes(dest)
    wrong = sorted(rel for rel, size in sent.items() if arrived.get(rel) != size)
    if wrong:
        raise IncompleteCopy(f"copying {src} to {dest}: {len(wrong)} of {len(sent)} file(s) did not arrive whole "
                             f"({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}): the store dropped a write")
    return sum(sent.values())


def upload_dir(local_dir: str, dest: str) -> int:
    """Copy the files under `local_dir` to `dest` (a path or URI); returns bytes copied."""
    return copy_dir(local_dir, dest)


def download_dir(src: str, local_dir: str) -> int:
    """Copy the files under `src` (a path or URI) into `local_dir`; returns bytes copied."""
    return copy_dir(src, local_dir)


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local path with the contents of `path`: the path itself when local, else a temporary
    copy of the file or directory (deleted on exit). For readers that need os-level files
    (torch.load, safetensors, DeepSpeed)."""
    if not is_uri(path):
        yield path
        return
    import pyarrow.fs as pafs

    fs, inner = filesystem(path)
    if isinstance(fs, pafs.LocalFileSystem):  # file:// is already on this disk
        yield inner
        return
    with tempfile.TemporaryDirectory(prefix="vitp-copy-") as tmp:
        target = os.path.join(tmp, basename(path) or "data")
        if fs.get_file_info(inner).type == pafs.FileType.File:
            pafs.copy_files(inner, target, source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
        else:
            download_dir(path, target)
        yield target


def abspath(path: str) -> str:
    """A local path made absolute; URIs, "" (unset) and "scratch" come back unchanged."""
    if not path or path == "scratch" or is_uri(path):
        return path
    return os.path.abspath(path)


NOT_TRANSIENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
OUTAGE_S = 180.0  # how long `through_outages` keeps trying a store that cannot be reached


def through_outages(fn, what: str, warn, limit_s: float = OUTAGE_S, first_pause_s: float = 2.0):
    """fn() again while the store cannot be reached (an OSError other than a missing or refused
    path: a connection reset, a timeout), up to `limit_s` with doubling pauses; `warn(line)` says so
    each time. The last error is raised once the time is up."""
    import time

    deadline, pause = time.monotonic() + limit_s, first_pause_s
    while True:
        try:
            return fn()
        except OSError as e:
            if isinstance(e, NOT_TRANSIENT) or time.monotonic() + pause > deadline:
                raise
            warn(f"{what}: storage unreachable ({str(e).splitlines()[0][:200]}); trying again in {pause:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 30.0)
