"""Every Kubernetes manifest we ship, checked offline against the real schemas (vendored with their
source and version: tests/schemas/SOURCES.md), strictly, as `kubectl apply --validate=strict`
would: KubeRay's RayCluster and RayJob against the CRDs of the oldest supported and the newest
KubeRay release, the core objects (Deployment, Service, NetworkPolicy, ...) against the Kubernetes
API's definitions, and each cloud overlay (cluster/overlays/) as kustomize renders it. A misspelt or
misplaced field fails here instead of being dropped by the API server."""
import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .k8s_schema import KUBERAY_RELEASES, PLURAL, core_validator, crd_validator, errors

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = (sorted((ROOT / "cluster" / "kuberay").glob("*.yaml")) + sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml"))
             + sorted((ROOT / "cluster" / "accounts").glob("*.yaml"))
             + [ROOT / "cluster" / "mlflow" / "mlflow.yaml"])


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


# overlay -> (the GPU group's node selector key, the identity annotation, extra GPU pod resources, the bucket's scheme)
CLOUD = {"gke": ("cloud.google.com/gke-accelerator", "iam.gke.io/gcp-service-account", {}, "gs://"),
         "eks": ("node.kubernetes.io/instance-type", "eks.amazonaws.com/role-arn", {"vpc.amazonaws.com/efa": "32"}, "s3://"),
         "gfd": ("nvidia.com/gpu.product", None, {}, "s3://")}
# where each service account lives: the Ray pods' and the tracking server's
ACCOUNTS = {("vit", "vit-ray"), ("mlflow", "mlflow")}


def _accounts(docs: list[dict], identity, scheme: str) -> None:
    """Both service accounts, each in its namespace, each with the cloud's identity (or none); the
    bucket once, in the cloud's scheme: ConfigMap vit-store for the Ray pods (VITP_STORE and
    PRETRAINED under it), mlflow-store for the tracking server's artifacts."""
    sas = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(sas) == ACCOUNTS, set(sas)
    for key, sa in sas.items():
        assert list(sa["metadata"].get("annotations", {})) == ([identity] if identity else []), key
    maps = {(d["metadata"]["namespace"], d["metadata"]["name"]): d["data"] for d in docs if d["kind"] == "ConfigMap"}
    assert set(maps) == {("vit", "vit-store"), ("mlflow", "mlflow-store")}, set(maps)
    store = maps[("vit", "vit-store")]
    assert set(store) == {"VITP_STORE", "PRETRAINED", "VITP_MIN_BUSBW"} and store["VITP_STORE"].startswith(scheme), store
    assert float(store["VITP_MIN_BUSBW"]) >= 0, store
    assert store["PRETRAINED"].startswith(store["VITP_STORE"] + "/"), store
    assert maps[("mlflow", "mlflow-store")]["MLFLOW_ARTIFACTS_DESTINATION"].startswith(scheme), maps


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_overlay_renders_to_valid_objects_with_its_clouds_names(overlay):
    """Each cloud overlay over cluster/kuberay/, rendered by kustomize, validates strictly (CRDs of
    both KubeRay releases, the Kubernetes API) and names its cloud's GPU label and identity, on both
    service accounts; the base names none of them (GPU pods go to any node with 8 free GPUs). Its
    accounts/ path alone (what a RayJob and the MLflow server need) renders the same two accounts."""
    docs = _render(overlay)
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Namespace", "ServiceAccount", "ConfigMap", "NetworkPolicy", "RayCluster"}, set(by_kind)
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] in ("NetworkPolicy", "RayCluster")} == {"vit"}
    found = [f"{overlay.name} {d['kind']}: {line}" for d in docs for line in errors(
        crd_validator(KUBERAY_RELEASES[0], d["kind"]) if d["kind"] in PLURAL
        else core_validator(d["apiVersion"], d["kind"]), d)]
    found += [f"{overlay.name} RayCluster ({r}): {line}" for r in KUBERAY_RELEASES[1:]
              for line in errors(crd_validator(r, "RayCluster"), by_kind["RayCluster"])]
    assert not found, "\n".join(found)
    label, identity, extra, scheme = CLOUD[overlay.name]
    groups = {g["groupName"]: g["template"]["spec"] for g in by_kind["RayCluster"]["spec"]["workerGroupSpecs"]}
    assert list(groups["gpu"]["nodeSelector"]) == [label]
    # every pod on its pool (cluster/nodepools.yaml; placed there by test_scheduling.py)
    assert groups["cpu-data"]["nodeSelector"] and by_kind["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"]
    (gpu,) = groups["gpu"]["containers"]
    for key, value in extra.items():
        assert gpu["resources"]["requests"][key] == gpu["resources"]["limits"][key] == value, key
    _accounts(docs, identity, scheme)
    alone = _render(overlay / "accounts")  # an empty cluster takes it: it brings the namespaces
    assert {d["kind"] for d in alone} == {"Namespace", "ServiceAccount", "ConfigMap"}
    assert {d["metadata"]["name"] for d in alone if d["kind"] == "Namespace"} == {ns for ns, _ in ACCOUNTS}
    _accounts(alone, identity, scheme)


def test_every_rayjob_header_names_an_accounts_path_that_exists():
    for path in sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml")):
        paths = re.findall(r"kubectl apply -k (cluster/overlays/\w+/accounts)", path.read_text())
        assert paths == [f"cluster/overlays/{path.parent.name}/accounts"], path  # its own cloud's
        assert (ROOT / paths[0] / "kustomization.yaml").exists(), path


def test_a_rayjob_that_never_starts_fails_within_the_hour():
    """preRunningDeadlineSeconds (KubeRay >= 1.7): a cluster that cannot start (no GPU nodes, an
    image that cannot be pulled) ends the RayJob instead of waiting out activeDeadlineSeconds."""
    for path in sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml")):
        spec = yaml.safe_load(path.read_text())["spec"]
        assert 0 < spec["preRunningDeadlineSeconds"] <= 3600 < spec["activeDeadlineSeconds"], path.name


@pytest.mark.parametrize("release", KUBERAY_RELEASES)
def test_every_kuberay_manifest_validates_against_the_crd(release):
    """The RayCluster against both releases; the RayJobs against the newest (they use
    preRunningDeadlineSeconds, which KubeRay 1.7 added): to the oldest, that field is all that is
    unknown, which is why their header says KubeRay >= 1.7."""
    docs = [(p, d) for p, d in _docs() if d["kind"] in PLURAL]
    assert {d["kind"] for _, d in docs} == {"RayCluster", "RayJob"}, [p.name for p, _ in docs]
    found = []
    for path, doc in docs:
        lines = errors(crd_validator(release, doc["kind"]), doc)
        if doc["kind"] == "RayJob" and _version(release) < (1, 7):
            assert lines and all("preRunningDeadlineSeconds" in line for line in lines), (path.name, lines)
            assert "KubeRay >= 1.7" in path.read_text(), path.name
            continue
        found += [f"{path.name}: {line}" for line in lines]
    assert not found, "\n".join(found)


def test_every_core_object_validates_against_the_kubernetes_api():
    docs = [(p, d) for p, d in _docs() if d["kind"] not in PLURAL]
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "NetworkPolicy", "ServiceAccount"} <= kinds, kinds
    found = [f"{path.name} {doc['kind']}: {line}" for path, doc in docs
             for line in errors(core_validator(doc["apiVersion"], doc["kind"]), doc)]
    assert not found, "\n".join(found)


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.lstrip("v").split("."))


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
