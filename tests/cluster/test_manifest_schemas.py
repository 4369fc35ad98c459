"""Every Kubernetes manifest we ship, checked offline against the real schemas (vendored with their
source and version: tests/schemas/SOURCES.md), strictly, as `kubectl apply --validate=strict`
would: KubeRay's RayCluster and RayJob against the CRDs of the oldest supported and the newest
KubeRay release, the core objects (Deployment, Service, NetworkPolicy, ...) against the Kubernetes
API's definitions. A misspelt or misplaced field fails here instead of being dropped by the API
server."""
import copy
from pathlib import Path

import pytest
import yaml

from .k8s_schema import KUBERAY_RELEASES, PLURAL, core_validator, crd_validator, errors

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "cluster" / "kuberay").glob("*.yaml")) + [ROOT / "cluster" / "mlflow" / "mlflow.yaml"]


def _docs():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


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
    assert {"Deployment", "Service", "NetworkPolicy", "PersistentVolumeClaim"} <= kinds, kinds
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
