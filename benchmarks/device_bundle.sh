#!/bin/bash
# Packs what a GPU machine with its own python3 + torch lacks for the GPU benchmarks into .gpu/
# (in .gitignore): DeepSpeed and its pure-Python dependencies copied from .venv, and pydantic_core
# as the CPython 3.12 manylinux wheel (it is compiled). Run here, where pip can reach the index:
#
#   benchmarks/device_bundle.sh [PYTHON_VERSION]        # default 3.12, the device's python3
#
# then on the device, from the repository root (with .gpu carried along):
#
#   PYTHONPATH=$PWD/.gpu/site:$PWD python3 benchmarks/gpu_suite.py
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf .gpu/site && mkdir -p .gpu/site
for pkg in deepspeed hjson pydantic annotated_types typing_inspection; do
  cp -r "$SP/$pkg" "$SP"/"$pkg"-*.dist-info .gpu/site/
done
find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
core=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("pydantic_core"))')
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels "pydantic-core==$core"
(cd .gpu/site && unzip -q -o ../wheels/pydantic_core-"$core"-*.whl)
echo "packed $(du -sh .gpu | cut -f1) into .gpu/ (carry it; PYTHONPATH=\$PWD/.gpu/site:\$PWD on the device)"
