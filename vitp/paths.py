"""RunPaths: the one owner of the work_dir layout (rendered corpus, shards, runs and their checkpoints,
sweeps, the demo's export, the default MLflow database) and of the node-local folders beside it
(checkpoint staging, the metrics spool: private to the user, private_dir). Every module asks here
instead of joining names onto work_dir. A sink: imports only storage and errors (no config, torch or ray).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import storage
from .errors import ConfigError, InputError


@dataclass(frozen=True)
class RunPaths:
    """Where things live under one work_dir (a local path, made absolute, or a URI):

    <work_dir>/synth              the rendered synthetic corpus (vitp synth)
    <work_dir>/shards/<name>      a dataset's Parquet shards (name: source[-seedN][-trainF])
    <work_dir>/runs/<run>         a run's checkpoints (Ray Train's storage path is <work_dir>/runs)
    <work_dir>/sweeps/<sweep>     a sweep's Tune state
    <work_dir>/export             the demo's pre-trained export
    <work_dir>/mlflow.db          the default MLflow store (local work_dir only)
    <work_dir>/.vitp-demo         the mark of a work dir `vitp demo` made (what --fresh may empty)
    """

    work_dir: str  # absolute (a Run's), or a URI

    @property
    def synth(self) -> str:
        return storage.join(self.work_dir, "synth")

    def shards(self, name: str) -> str:
        return storage.join(self.work_dir, "shards", name)

    @property
    def runs(self) -> str:
        return storage.join(self.work_dir, "runs")

    def run(self, name: str) -> str:
        return storage.join(self.runs, name)

    @property
    def sweeps(self) -> str:
        return storage.join(self.work_dir, "sweeps")

    def sweep(self, name: str) -> str:
        return storage.join(self.sweeps, name)

    @property
    def export(self) -> str:
        return storage.join(self.work_dir, "export")

    # The file `vitp demo` writes first into a work dir it makes (vitp/cli/demo.py): `--fresh` empties
    # only a folder that holds it, since a work dir of the user's holds the same names as a demo's.
    DEMO_MARKER = ".vitp-demo"
    # What vitp writes directly under a work_dir: the folders above, the SQLite store with its
    # lock and journal files, its artifacts, and the demo's marker, result and plots (vitp/cli/demo.py).
    OWN_ENTRIES = ("synth", "shards", "runs", "sweeps", "export", "mlartifacts", DEMO_MARKER, "demo-result.json",
                   "compare.png", "low_data.png")
    OWN_DB_ENTRIES = ("mlflow.db", "mlflow.db.lock", "mlflow.db-journal", "mlflow.db-wal", "mlflow.db-shm")

    def foreign_entries(self) -> list[str]:
        """The entries directly under work_dir that vitp does not write (a work_dir that holds any
        is not vitp's to delete whole: `vitp demo --fresh`)."""
        own = set(self.OWN_ENTRIES + self.OWN_DB_ENTRIES)
        return [name for name in storage.listdir(self.work_dir) if name not in own]

    @property
    def demo_marker(self) -> str:
        return storage.join(self.work_dir, self.DEMO_MARKER)

    def mlflow_db(self) -> Path:
        """The default SQLite store's file; a ConfigError where work_dir is object storage."""
        if storage.is_uri(self.work_dir) and not self.work_dir.startswith("file://"):
            raise ConfigError(
                f"work_dir={self.work_dir!r} is not a local directory, so the default SQLite MLflow "
                "store cannot live there: set --set tracking.uri=http://<mlflow-server>:5000 "
                "(or a database URI)")
        return Path(self.work_dir.removeprefix("file://")).expanduser().resolve() / "mlflow.db"


# MLflow store URIs have forms of their own ("databricks", "file:"), hence a regex of our own here.
_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def store_uri(uri: str) -> str:
    """An MLflow store URI as MLflow wants it, absolute (a relative sqlite:///rel.db would be relative to
    whichever process opens it): a plain path becomes sqlite (".db", ".sqlite", ".sqlite3") or a file
    store (a directory, for existing ./mlruns trees). Nothing is made (tracking.store.normalise_uri)."""
    if _URI_SCHEME.match(uri) or uri.startswith(("file:", "databricks")):
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            return f"sqlite:///{Path(uri[len('sqlite:///'):]).expanduser().resolve()}"
        return uri
    path = Path(uri).expanduser().resolve()
    return f"sqlite:///{path}" if path.suffix in (".db", ".sqlite", ".sqlite3") else path.as_uri()


# Node-local folders (never shared between nodes, never in work_dir): under this user's own
# folder in the temp dir. The temp dir is shared with every user of the machine, so the folder is
# made 0700 and checked on every use: another user must not plant spool files or stage links
# there. Ray's workers on a node run as the user who started Ray, so one folder per user is right.
def user_tmp() -> str:
    """<tmp>/vitp-<uid>: this user's node-local folder (made 0700, checked: private_dir)."""
    name = f"vitp-{os.geteuid()}" if hasattr(os, "geteuid") else "vitp"  # Windows: a per-user temp dir
    return private_dir(os.path.join(tempfile.gettempdir(), name))


def staging_root() -> str:
    """Where Train workers stage a checkpoint before Ray copies it to the run's storage (made, private)."""
    return private_dir(os.path.join(user_tmp(), "ckpt-staging"))


def spool_root() -> str:
    """Where rank 0 spools MLflow metrics it could not send yet (the default of tracking.spool_dir;
    made, private)."""
    return private_dir(os.path.join(user_tmp(), "mlflow-spool"))


def private_dir(path: str) -> str:
    """`path`, a directory only this user can use: made 0700 when missing; an existing one must be
    a real directory (a symlink is not followed) owned by this user, and any group or other
    permission on it is taken away. Anything else: InputError naming the path and the fix."""
    if not hasattr(os, "geteuid"):  # Windows: per-user temp dirs, no POSIX modes to check
        os.makedirs(path, exist_ok=True)
        return path
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    # The checks and the fix act on the opened directory itself, never on a name that could be
    # swapped for a link in between.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        kind = "a symlink" if os.path.islink(path) else "not a directory" if e.errno == errno.ENOTDIR \
            else f"unusable ({e.strerror})"
        raise _not_private(path, f"is {kind}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _not_private(path, f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours: made private (an older vitp, a umask, a chmod)
    finally:
        os.close(fd)
    return path


def _not_private(path: str, problem: str) -> InputError:
    return InputError(
        f"{path} {problem}: vitp keeps checkpoint staging and metric spools there and needs it to be "
        "a directory of yours only; remove it (or have it removed: another user may have made it), "
        "or set TMPDIR to a directory of your own")
