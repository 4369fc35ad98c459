"""Every Kubernetes manifest we ship, checked offline against the real schemas (vendored with their
source and version: tests/schemas/SOURCES.md), strictly, as `kubectl apply --validate=strict`
would: KubeRay's RayCluster and RayJob against the CRDs of the oldest supported and the newest
KubeRay release, the core objects (Deployment, Service, NetworkPolicy, ...) against the Kubernetes
API's definitions, and each cloud overlay (cluster/overlays/) as kustomize renders it. A misspelt or
misplaced field fails here instead of being dropped by the API server."""
import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .k8s_schema import KUBERAY_RELEASES, PLURAL, core_validator, crd_validator, errors

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "cluster" / "kuberay").glob("*.yaml")) + [ROOT / "cluster" / "mlflow" / "mlflow.yaml"]


OVERLAYS = sorted(p.parent for p in (ROOT / "cluster" / "overlays").glob("*/kustomization.yaml"))


def _docs():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] != "Kustomization":
                yield path, doc


def _render(overlay: Path) -> list[dict]:
    """`kubectl kustomize OVERLAY`: what `kubectl apply -k` would send."""
    kubectl = shutil.which("kubectl")
    assert kubectl, ("kubectl is needed to render cluster/overlays/ (its built-in kustomize): install it, "
                     "e.g. `apt-get install kubectl` from Kubernetes' apt repository")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# overlay -> (the GPU group's node selector key, the shared volume's class, the identity annotation)
CLOUD = {"gke": ("cloud.google.com/gke-accelerator", "standard-rwx", "iam.gke.io/gcp-service-account"),
         "eks": ("node.kubernetes.io/instance-type", "efs-sc", "eks.amazonaws.com/role-arn"),
         "gfd": ("nvidia.com/gpu.product", "nfs-client", None)}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_overlay_renders_to_valid_objects_with_its_clouds_names(overlay):
    """Each cloud overlay over cluster/kuberay/, rendered by kustomize, validates strictly (CRDs of
    both KubeRay releases, the Kubernetes API) and names its cloud's GPU label, RWX class and
    identity; the base names none of them (GPU pods go to any node with 8 free GPUs)."""
    docs = _render(overlay)
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ServiceAccount", "PersistentVolumeClaim", "NetworkPolicy", "RayCluster"}, set(by_kind)
    found = [f"{overlay.name} {d['kind']}: {line}" for d in docs for line in errors(
        crd_validator(KUBERAY_RELEASES[0], d["kind"]) if d["kind"] in PLURAL
        else core_validator(d["apiVersion"], d["kind"]), d)]
    found += [f"{overlay.name} RayCluster ({r}): {line}" for r in KUBERAY_RELEASES[1:]
              for line in errors(crd_validator(r, "RayCluster"), by_kind["RayCluster"])]
    assert not found, "\n".join(found)
    label, storage_class, identity = CLOUD[overlay.name]
    groups = {g["groupName"]: g["template"]["spec"] for g in by_kind["RayCluster"]["spec"]["workerGroupSpecs"]}
    assert list(groups["gpu"]["nodeSelector"]) == [label]
    assert "nodeSelector" not in groups["cpu-data"]
    assert by_kind["PersistentVolumeClaim"]["spec"]["storageClassName"] == storage_class
    annotations = by_kind["ServiceAccount"]["metadata"].get("annotations", {})
    assert list(annotations) == ([identity] if identity else [])


@pytest.mark.parametrize("release", KUBERAY_RELEASES)
def test_every_kuberay_manifest_validates_against_the_crd(release):
    docs = [(p, d) for p, d in _docs() if d["kind"] in PLURAL]
    assert {d["kind"] for _, d in docs} == {"RayCluster", "RayJob"}, [p.name for p, _ in docs]
    found = [f"{path.name}: {line}" for path, doc in docs
             for line in errors(crd_validator(release, doc["kind"]), doc)]
    assert not found, "\n".join(found)


def test_every_core_object_validates_against_the_kubernetes_api():
    docs = [(p, d) for p, d in _docs() if d["kind"] not in PLURAL]
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "NetworkPolicy", "PersistentVolumeClaim", "ServiceAccount"} <= kinds, kinds
    found = [f"{path.name} {doc['kind']}: {line}" for path, doc in docs
             for line in errors(core_validator(doc["apiVersion"], doc["kind"]), doc)]
    assert not found, "\n".join(found)


def _one(kind: str) -> dict:
    return copy.deepcopy(next(d for _, d in _docs() if d["kind"] == kind))


@pytest.mark.parametrize("release", KUBERAY_RELEASES)
@pytest.mark.parametrize("where", ["a misspelt spec key", "a container key at the pod level",
                                   "a string where the CRD wants an integer"])
def test_a_wrong_field_fails_the_crd_check(release, where):
    doc = _one("RayCluster")
    group = doc["spec"]["workerGroupSpecs"][0]
    if where == "a misspelt spec key":
        doc["spec"]["headGroupSpec"]["rayStartParam"] = {}
    elif where == "a container key at the pod level":
        group["template"]["spec"]["image"] = group["template"]["spec"]["containers"][0]["image"]
    else:
        group["replicas"] = "two"
    assert errors(crd_validator(release, "RayCluster"), doc)


@pytest.mark.parametrize("where", ["a misspelt container key", "a list where a map belongs"])
def test_a_wrong_field_fails_the_core_check(where):
    doc = _one("Deployment")
    container = doc["spec"]["template"]["spec"]["containers"][0]
    if where == "a misspelt container key":
        container["imagePullPolicies"] = "Always"
    else:
        doc["metadata"]["labels"] = [doc["metadata"].get("labels")]
    assert errors(core_validator(doc["apiVersion"], "Deployment"), doc)
