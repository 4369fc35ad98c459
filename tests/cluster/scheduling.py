"""Place a RayCluster's or RayJob's pods on node pools as kube-scheduler would, offline.

The node pools are cluster/nodepools.yaml, the machines' capacities cluster/machines.yaml
(`shapes`); a machine's allocatable follows its cloud's published reservation formula (the sources
are in nodepools.yaml's header). A pod fits a node when the node's labels satisfy its nodeSelector,
it tolerates every NoSchedule/NoExecute taint, and its requests (the sum over its containers, the
largest init container if larger) fit what is left of the allocatable once the cloud's DaemonSets
and the pods already placed there are counted. KubeRay's rule: a cluster is Ready only when every
pod of it runs, so all of them must fit at once; pools grow up to their max_nodes.

The pods are the ones KubeRay creates: the head (with the autoscaler sidecar when in-tree
autoscaling is on, at KubeRay's default resources), `replicas` of each worker group (or
`maxReplicas`, the most the autoscaler may ask for), and for a RayJob in K8sJobMode its submitter.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
POOLS = yaml.safe_load((ROOT / "cluster" / "nodepools.yaml").read_text())
SHAPES = yaml.safe_load((ROOT / "cluster" / "machines.yaml").read_text())["shapes"]
GI = 2 ** 30
MI = 2 ** 20
# KubeRay's defaults for containers it adds (ray-operator/controllers/ray/common: the autoscaler
# sidecar's and the RayJob submitter's resources when the manifest names none)
AUTOSCALER = {"cpu": 0.5, "memory": 512 * MI}
SUBMITTER = {"cpu": 0.5, "memory": 200 * MI}
RESOURCES = ("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu", "vpc.amazonaws.com/efa")
_UNITS = {"Ki": 2 ** 10, "Mi": MI, "Gi": GI, "Ti": 2 ** 40, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "m": 1e-3, "": 1}


def quantity(value) -> float:
    """A Kubernetes quantity (`500m`, `32Gi`, `8`, 2.5) as a number (bytes, cores, devices)."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value).strip())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _tiers(total: float, tiers: list[tuple[float, float]]) -> float:
    """sum of rate x the part of `total` in each (width, rate) tier, the last tier open-ended."""
    reserved, left = 0.0, total
    for width, rate in tiers:
        part = min(left, width)
        reserved += part * rate
        left -= part
    return reserved


def _cpu_reserved(vcpu: int) -> float:
    return _tiers(vcpu, [(1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025)])


def allocatable(cloud: str, machine: str, disk_gib: float) -> dict[str, float]:
    """What kube-scheduler may hand out on one node of `machine` with a `disk_gib` boot disk."""
    shape, reserve = SHAPES[machine], POOLS[cloud]["reserve"]
    memory, disk = shape["memory_gib"] * GI, disk_gib * GI
    cpu = shape["vcpu"] - (_cpu_reserved(shape["vcpu"]) if reserve in ("eks", "gke") else 0)
    if reserve == "eks":
        memory -= (255 + 11 * shape["max_pods"]) * MI + 100 * MI
        disk = disk - GI - 0.10 * disk
    elif reserve == "gke":
        memory -= _tiers(shape["memory_gib"], [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06),
                                                (float("inf"), 0.02)]) * GI + 100 * MI
        fs = 0.94 * disk
        disk = fs - min(0.5 * disk, 6 * GI + 0.35 * disk, 100 * GI) - 0.10 * fs
    else:
        memory -= 100 * MI
        disk -= 0.10 * disk
    out = {"cpu": cpu, "memory": memory, "ephemeral-storage": disk,
           "nvidia.com/gpu": shape.get("gpus", 0), "vpc.amazonaws.com/efa": shape.get("efa", 0)}
    for key, value in POOLS[cloud]["daemonsets"].items():
        out[key] -= quantity(value)
    return out


@dataclass
class Pod:
    name: str
    requests: dict[str, float]
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)


def _requests(pod_spec: dict, extra: dict | None = None) -> dict[str, float]:
    total = dict.fromkeys(RESOURCES, 0.0)
    for c in pod_spec.get("containers", []):
        res = c.get("resources", {})
        # a container with limits and no requests is given requests = limits
        for key, value in {**res.get("limits", {}), **res.get("requests", {})}.items():
            total[key] = total.get(key, 0.0) + quantity(value)
    for key, value in (extra or {}).items():
        total[key] += value
    for c in pod_spec.get("initContainers", []):
        res = c.get("resources", {})
        for key, value in {**res.get("limits", {}), **res.get("requests", {})}.items():
            total[key] = max(total.get(key, 0.0), quantity(value))
    return total


def _pod(name: str, template: dict, extra: dict | None = None) -> Pod:
    spec = template.get("spec", {})
    return Pod(name, _requests(spec, extra), dict(spec.get("nodeSelector", {})), list(spec.get("tolerations", [])))


def cluster_pods(cluster_spec: dict, name: str, at_max: bool = False) -> list[Pod]:
    """The pods KubeRay makes for a RayCluster spec: head, then each group's replicas (or maxReplicas)."""
    head = cluster_spec["headGroupSpec"]
    pods = [_pod(f"{name}-head", head["template"], AUTOSCALER if cluster_spec.get("enableInTreeAutoscaling") else None)]
    for group in cluster_spec.get("workerGroupSpecs", []):
        count = group.get("maxReplicas", 0) if at_max else group.get("replicas", 0)
        pods += [_pod(f"{name}-{group['groupName']}-worker-{i}", group["template"]) for i in range(count)]
    return pods


def job_pods(rayjob: dict) -> list[Pod]:
    """The pods of a RayJob: its cluster's and, in K8sJobMode, the submitter's."""
    spec = rayjob["spec"]
    name = rayjob["metadata"]["name"]
    pods = cluster_pods(spec["rayClusterSpec"], name)
    if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
        template = copy.deepcopy(spec.get("submitterPodTemplate") or {"spec": {"containers": [{}]}})
        pod = _pod(f"{name}-submitter", template)
        if not any(c.get("resources") for c in template["spec"].get("containers", [])):
            for key, value in SUBMITTER.items():
                pod.requests[key] += value
        pods.append(pod)
    return pods


def _tolerates(pod: Pod, taint: dict) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for t in pod.tolerations:
        if t.get("effect") not in (None, "", taint["effect"]):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("operator", "Equal") == "Equal" and t.get("value") == taint.get("value"):
            return True
    return False


def _why_not(pod: Pod, pool: dict) -> str | None:
    """Why `pod` may never run on `pool` (selector, taint), or None."""
    labels = pool.get("labels", {})
    wrong = {k: v for k, v in pod.node_selector.items() if labels.get(k) != v}
    if wrong:
        return f"nodeSelector {wrong} matches no label of it"
    for taint in pool.get("taints", []):
        if not _tolerates(pod, taint):
            return f"taint {taint['key']}={taint.get('value', '')}:{taint['effect']} not tolerated"
    return None


def _show(key: str, value: float) -> str:
    if key in ("memory", "ephemeral-storage"):
        return f"{value / GI:.1f}Gi"
    return f"{value:g}"


def place(cloud: str, pods: list[Pod]) -> list[str]:
    """Place every pod at once on `cloud`'s pools; one line per pod that fits nowhere (empty: all run).

    Largest first (GPUs, then CPU, then memory), each on the first node with room, a new node of the
    first pool that admits it while the pool has nodes to give."""
    pools = POOLS[cloud]["pools"]
    free = {p: allocatable(cloud, spec["machine"], spec["disk_gib"]) for p, spec in pools.items()}
    nodes: dict[str, list[dict[str, float]]] = {p: [] for p in pools}
    problems = []
    order = sorted(pods, key=lambda p: (-p.requests["nvidia.com/gpu"], -p.requests["cpu"], -p.requests["memory"]))
    for pod in order:
        admitting = [p for p in pools if _why_not(pod, pools[p]) is None]
        placed = False
        for p in admitting:
            for node in nodes[p]:
                if all(pod.requests.get(k, 0.0) <= node.get(k, 0.0) + 1e-9 for k in pod.requests):
                    placed = True
                    break
            else:
                if len(nodes[p]) < pools[p]["max_nodes"] and all(
                        pod.requests.get(k, 0.0) <= free[p].get(k, 0.0) + 1e-9 for k in pod.requests):
                    node = dict(free[p])
                    nodes[p].append(node)
                    placed = True
            if placed:
                for k, v in pod.requests.items():
                    node[k] = node.get(k, 0.0) - v
                break
        if placed:
            continue
        reasons = []
        for p, spec in pools.items():
            why = _why_not(pod, spec)
            if why is None:
                short = {k: (v, free[p].get(k, 0.0)) for k, v in pod.requests.items() if v > free[p].get(k, 0.0) + 1e-9}
                if short:
                    why = "; ".join(f"{k} {_show(k, v)} requested, {_show(k, a)} allocatable"
                                    for k, (v, a) in short.items())
                else:
                    why = f"all {spec['max_nodes']} nodes full"
            reasons.append(f"{cloud}/{p} ({spec['machine']}): {why}")
        problems.append(f"pod {pod.name} fits no pool: " + " | ".join(reasons))
    return problems
