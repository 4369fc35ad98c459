"""What `vitp submit` would upload with a job spec: a local working_dir or py_modules directory
measured as Ray packages it, refused over Ray's upload limit with the biggest entries named.

Must not submit or import torch (ray is imported lazily, only to read its limit and excludes).
"""
from __future__ import annotations

import os
from pathlib import Path

from vitp.errors import ConfigError
from vitp.storage import is_uri

from .jobspec import JobSpec


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def upload_limit() -> int:
    """Ray's limit on a working_dir / py_modules package (the GCS gRPC message size)."""
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE  # lazy: ray

    return int(GCS_STORAGE_MAX_SIZE)


def measure_upload(directory: str, excludes: list[str] | None = None) -> tuple[int, dict[str, int]]:
    """Bytes Ray would package from `directory` (same excludes as Ray: .gitignore, .rayignore,
    runtime_env.excludes, Ray's defaults), and the size per top-level entry. Uncompressed."""
    from ray._private import ray_constants  # lazy: ray
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    root = Path(directory).resolve()
    all_excludes = ray_constants.get_runtime_env_default_excludes() + list(excludes or [])
    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    per_entry: dict[str, int] = {}
    total = 0

    def handler(p: Path) -> None:
        nonlocal total
        if p.is_file() and not p.is_symlink():
            size = p.stat().st_size
            total += size
            top = p.relative_to(root).parts[0]
            per_entry[top] = per_entry.get(top, 0) + size

    _dir_travel(root, [_get_excludes(root, all_excludes)], handler, include_gitignore=include_gitignore)
    return total, per_entry


def check_upload_size(spec: JobSpec, limit: int | None = None) -> list[str]:
    """Raise ConfigError naming the biggest entries and the fix when a local working_dir or
    py_modules directory is over Ray's upload limit; return notes on what will be uploaded."""
    runtime_env = spec.kwargs.get("runtime_env") or {}
    limit = upload_limit() if limit is None else limit
    dirs = []
    if isinstance(runtime_env.get("working_dir"), str):
        dirs.append(("runtime_env.working_dir", runtime_env["working_dir"]))
    for mod in runtime_env.get("py_modules") or []:
        if isinstance(mod, str):
            dirs.append(("runtime_env.py_modules", mod))
    notes = []
    for field_name, d in dirs:
        if is_uri(d) or not os.path.isdir(d):
            continue  # a URI or a package file: Ray uploads nothing / checks it itself
        total, per_entry = measure_upload(d, runtime_env.get("excludes"))
        if total >= limit:
            biggest = sorted(per_entry.items(), key=lambda kv: -kv[1])[:5]
            raise ConfigError(
                f"{spec.path}: {field_name}={d!r} would upload {_mib(total)} (before compression), over "
                f"Ray's {_mib(limit)} upload limit; biggest: "
                + ", ".join(f"{k} {_mib(v)}" for k, v in biggest)
                + ". Fix: list them under runtime_env.excludes or in a .rayignore file, keep data and "
                "checkpoints on shared storage (s3://, gs://, NFS) and pass the path with "
                "--set data.path=..., or bake the code into the cluster image and drop working_dir"
            )
        notes.append(f"{field_name}: {d} ({_mib(total)} to upload, limit {_mib(limit)})")
    return notes
