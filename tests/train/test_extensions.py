"""DeepSpeed's JIT-built CPU ops are built once, at `make install`, and reused by every process of
the venv: the same folder (.venv/torch-extensions) and the same ninja whatever PATH a process got
(a system ninja of another version rebuilds what the venv's built, and the other way round).
DeepSpeed itself is imported without the MLflow import of its autotuner."""
import os
import subprocess
import sys

import pytest

PROBE = "import shutil, os, vitp.train.engine; print(shutil.which('ninja')); print(os.environ['TORCH_EXTENSIONS_DIR'])"


def test_every_process_builds_ops_where_and_with_what_make_install_did():
    venv_bin = os.path.join(sys.prefix, "bin")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # as a process started outside the venv gets it
    env.pop("TORCH_EXTENSIONS_DIR", None)
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    ninja, extensions = p.stdout.split()
    assert ninja == os.path.join(venv_bin, "ninja")  # pip's ninja, which deepspeed's install brings
    assert extensions == os.path.join(sys.prefix, "torch-extensions")


IMPORT = """
import sys
from vitp.train.engine import import_deepspeed
if sys.argv[1] == "first":
    import mlflow
ds = import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
before = "mlflow" in sys.modules
import mlflow  # what rank 0 does next (vitp.tracking)
print(ds.__name__, before, autotuner.has_mlflow, mlflow.MlflowClient.__name__)
"""


@pytest.mark.long(reason="checks the synthetic data or import costs, whose subjects change rarely")
@pytest.mark.slow  # two interpreters importing DeepSpeed and MLflow: ~10 s
def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """A Train rank imports DeepSpeed without the MLflow its autotuner would import (seconds per
    rank; only rank 0 logs), and MLflow imports normally afterwards; where MLflow was imported
    first, DeepSpeed sees it as usual."""
    runs = {}
    for order in ("deepspeed", "first"):
        p = subprocess.run([sys.executable, "-c", IMPORT, order], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[order] = p.stdout.splitlines()[-1].split()  # (DeepSpeed prints its accelerator first)
    assert runs["deepspeed"] == ["deepspeed", "False", "False", "MlflowClient"]
    assert runs["first"] == ["deepspeed", "True", "True", "MlflowClient"]


LOAD = "from vitp.train.engine import load_ops; load_ops('ShareMemCommBuilder'); print('loaded')"


def test_a_lock_left_by_a_killed_loader_does_not_hang_the_next_one():
    """torch's loader leaves `<op>/lock` behind when killed inside it (a worker killed while it
    starts); the next load must not wait for it forever. The lock is planted under our flock, as
    no live loader could be inside then."""
    import fcntl

    root = os.path.join(sys.prefix, "torch-extensions")
    if not os.path.isdir(os.path.join(root, "deepspeed_shm_comm")):
        subprocess.run([sys.executable, "-c", LOAD], check=True, timeout=600)  # built once, as make install does
    with open(os.path.join(root, ".vitp-load-lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        open(os.path.join(root, "deepspeed_shm_comm", "lock"), "w").close()
        fcntl.flock(f, fcntl.LOCK_UN)
    p = subprocess.run([sys.executable, "-c", LOAD], env={**os.environ, "TORCH_EXTENSIONS_DIR": root},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "loaded" in p.stdout, p.stderr[-2000:]
    assert not os.path.exists(os.path.join(root, "deepspeed_shm_comm", "lock"))
