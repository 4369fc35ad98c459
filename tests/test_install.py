"""`make install` (the Makefile's stamp): installing again is a no-op only for the same torch build; another
TORCH_VERSION or TORCH_INDEX_URL (a CUDA wheel index) installs torch again. Dry runs (`make -n`) against
a venv folder of the test's own."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _installs(venv: Path, *settings: str) -> bool:
    """Whether `make install` with these settings would install (`make -n` prints its pip lines)."""
    out = subprocess.run(["make", "-n", "install", f"VENV={venv}", *settings], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return "pip install" in out


def test_the_install_stamp_names_the_torch_build(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    version = next(line.split("=")[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
                   if line.startswith("TORCH_VERSION"))
    assert _installs(venv)
    (venv / f".installed-{version}").touch()  # what a CPU install left
    newer = max(os.path.getmtime(ROOT / f) for f in ("Makefile", "pyproject.toml")) + 10
    os.utime(venv / f".installed-{version}", (newer, newer))
    assert not _installs(venv)  # the same build: nothing to do
    cuda = "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126"
    assert _installs(venv, cuda)  # a CUDA build is not the CPU one installed
    assert _installs(venv, "TORCH_VERSION=9.9.9")
    line = next(x for x in subprocess.run(["make", "-n", "install", f"VENV={venv}", cuda], cwd=ROOT, capture_output=True,
                                          text=True, timeout=60).stdout.splitlines() if "torch==" in x and "pip" in x)
    assert "--index-url https://download.pytorch.org/whl/cu126" in line
