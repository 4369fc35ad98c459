"""DeepSpeed's JIT-built CPU ops are built once, at `make install`, and reused by every process of
the venv: the same folder (.venv/torch-extensions) and the same ninja whatever PATH a process got
(a system ninja of another version rebuilds what the venv's built, and the other way round)."""
import os
import subprocess
import sys

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
