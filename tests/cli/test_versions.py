"""The start-up check of Ray, DeepSpeed and MLflow against the caps in the package's requirements
(vitp/versions.py): a library outside them is one line naming it, the bounds and the fix."""
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys

import pytest

from vitp.versions import CHECKED, DIST, unsupported

VITP = [shutil.which("vitp")] if shutil.which("vitp") else [sys.executable, "-m", "vitp.cli"]


def test_bounds_come_from_the_installed_requirements():
    requires = metadata.requires(DIST)
    installed = {name: metadata.version(name) for name in CHECKED}
    assert unsupported(installed, requires) == []  # what the suites run on is supported
    ray_req = next(r for r in requires if r.startswith("ray"))
    cap = ray_req.split("<")[1].split(",")[0]  # the first release past the cap, from pyproject
    bad = unsupported({**installed, "ray": cap, "mlflow": "2.0.0"}, requires)
    assert [(name, version) for name, version, _ in bad] == [("ray", cap), ("mlflow", "2.0.0")]
    assert bad[0][2].startswith("ray>=") and f"<{cap}" in bad[0][2]
    assert unsupported({"deepspeed": installed["deepspeed"]}, requires) == []  # not installed: not checked


def _fake_dist(root, name: str, version: str) -> str:
    """A directory that, first on PYTHONPATH, makes importlib.metadata report `name` at `version`."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(root)


@pytest.mark.parametrize("skip", ["", "1"])
def test_a_command_under_an_unsupported_ray_is_one_line_unless_skipped(tmp_path, skip):
    env = {**os.environ, "PYTHONPATH": _fake_dist(tmp_path, "ray", "9.0.0"), "VITP_SKIP_VERSION_CHECK": skip}
    r = subprocess.run([*VITP, "config", "debug"], capture_output=True, text=True, env=env, timeout=120)
    if skip:
        assert r.returncode == 0 and '"recipe": "debug"' in r.stdout, r.stderr
        return
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()
    assert line.startswith("vitp config: ray 9.0.0 is installed, this vitp supports ray>=2.")
    assert "pip install 'ray>=2." in line and "VITP_SKIP_VERSION_CHECK=1" in line, line
