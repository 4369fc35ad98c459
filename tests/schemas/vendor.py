"""Vendor the schemas the offline manifest checks use (tests/cluster/test_manifest_schemas.py):

    python tests/schemas/vendor.py KUBERAY_CHECKOUT KUBERNETES_VALIDATE_WHEEL

- KubeRay's CRDs, for each release in k8s_schema.KUBERAY_RELEASES: the `v1` version's
  openAPIV3Schema of ray-operator/config/crd/bases/ray.io_<plural>.yaml at that tag, as upstream
  ships it -> tests/schemas/kuberay-<tag>/<plural>.json.gz;
- the Kubernetes API's object definitions (from its OpenAPI document) as strict JSON Schema, for
  k8s_schema.KUBERNETES: the kubernetes-validate wheel's `<version>-local-strict/_definitions.json`
  -> tests/schemas/kubernetes-<version>.json.gz.
Each source (tag and commit, wheel and version) and sha256 goes into tests/schemas/SOURCES.md.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cluster"))
from k8s_schema import KUBERAY_RELEASES, KUBERNETES, PLURAL  # noqa: E402


def _write(path: Path, obj) -> None:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data, 9, mtime=0))  # mtime=0: the same input, the same bytes


def kuberay(checkout: str) -> list[str]:
    rows = []
    for tag in KUBERAY_RELEASES:
        commit = subprocess.run(["git", "-C", checkout, "rev-parse", f"{tag}^{{commit}}"], check=True,
                                capture_output=True, text=True).stdout.strip()
        out_dir = HERE / f"kuberay-{tag}"
        out_dir.mkdir(exist_ok=True)
        for plural in sorted(PLURAL.values()):
            path = f"ray-operator/config/crd/bases/ray.io_{plural}.yaml"
            raw = subprocess.run(["git", "-C", checkout, "show", f"{commit}:{path}"], check=True,
                                 capture_output=True).stdout
            (v1,) = [v for v in yaml.safe_load(raw)["spec"]["versions"] if v["name"] == "v1"]
            _write(out_dir / f"{plural}.json.gz", v1["schema"]["openAPIV3Schema"])
            rows.append(f"| KubeRay {tag} (github.com/ray-project/kuberay, commit `{commit}`) | `{path}` | "
                        f"`{hashlib.sha256(raw).hexdigest()}` |")
    return rows


def kubernetes(wheel: str) -> list[str]:
    path = f"kubernetes_validate/kubernetes-json-schema/{KUBERNETES}-local-strict/_definitions.json"
    with zipfile.ZipFile(wheel) as z:
        raw = z.read(path)
    _write(HERE / f"kubernetes-{KUBERNETES}.json.gz", json.loads(raw))
    return [f"| Kubernetes {KUBERNETES} API definitions, strict ({Path(wheel).name}, PyPI, Apache-2.0) | "
            f"`{path}` | `{hashlib.sha256(raw).hexdigest()}` |"]


def main(argv: list[str]) -> None:
    rows = kuberay(argv[0]) + kubernetes(argv[1])
    (HERE / "SOURCES.md").write_text(
        "# Vendored schemas\n\nWritten by `tests/schemas/vendor.py`; read by `tests/cluster/k8s_schema.py`. "
        "KubeRay is\nApache-2.0 (github.com/ray-project/kuberay); kubernetes-validate (github.com/willthames/"
        "kubernetes-validate)\nis Apache-2.0 and generates its files from the Kubernetes OpenAPI document.\n\n"
        "| source | file | sha256 of the file |\n|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
