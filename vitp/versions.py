"""The Ray, DeepSpeed and MLflow versions vitp supports, checked when a command starts: the code uses
their internals (pyproject.toml says which). The bounds are this package's own requirements, read from
its installed metadata; outside them a command is one line naming the library, its bounds and the pip
fix. VITP_SKIP_VERSION_CHECK=1 runs anyway. A sink: imports nothing of vitp but errors.
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import re

from .errors import ConfigError

DIST = "vit-pipeline"  # this package's distribution name (pyproject.toml [project] name)
CHECKED = ("ray", "deepspeed", "mlflow")  # the libraries whose internals the code uses
SKIP_ENV = "VITP_SKIP_VERSION_CHECK"


# name, [extras], version specifiers, ;marker: the requirement strings pip writes into the metadata
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")


def _bounds(requires: list[str]) -> dict[str, object]:
    """{library: its SpecifierSet} for CHECKED, from requirement strings like 'ray[data]<2.61,>=2.52'
    (packaging's specifiers; its full Requirement parser would double the check's start-up cost)."""
    from packaging.specifiers import SpecifierSet

    out = {}
    for line in requires:
        m = REQUIREMENT.match(line)
        if m and m[1].lower() in CHECKED and not m[3]:  # extras' requirements carry a marker
            out[m[1].lower()] = SpecifierSet(m[2])
    return out


def unsupported(installed: dict[str, str], requires: list[str]) -> list[tuple[str, str, str]]:
    """(library, installed version, requirement) for each CHECKED library whose installed version is
    outside its bounds; a library not installed is not this check's business."""
    out = []
    for name, spec in _bounds(requires).items():
        version = installed.get(name)
        if version is not None and not spec.contains(version, prereleases=True):
            lower_first = sorted(spec, key=lambda s: (s.operator.startswith("<"), str(s)))
            out.append((name, version, name + ",".join(map(str, lower_first))))
    return out


def check_versions() -> None:
    """Raise ConfigError (exit 2) when an installed CHECKED library is outside its bounds. Nothing to
    check when vitp runs from a source tree that was never installed (no metadata)."""
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return
    try:
        requires = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return
    installed = {}
    for name in CHECKED:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    bad = unsupported(installed, requires)
    if bad:
        found = "; ".join(f"{name} {version} is installed, this vitp supports {req}" for name, version, req in bad)
        pins = " ".join(f"'{req}'" for _, _, req in bad)
        raise ConfigError(f"{found}: pip install {pins} (or {SKIP_ENV}=1 to run anyway)")
