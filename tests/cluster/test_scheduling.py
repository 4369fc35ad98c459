"""Every pod we ship scheduled, not read: the RayCluster of each overlay (at the size it starts at
and at the most its autoscaler may ask for) and every generated RayJob (cluster, submitter) placed
on the node pools of cluster/nodepools.yaml by tests/cluster/scheduling.py, kube-scheduler's rules
on each machine's allocatable; the launchers' node types against their machines' capacity. A pod
that fits no pool fails with the pool and the shortfall."""
import copy
import re

import pytest
import yaml

from .conftest import ROOT
from .scheduling import GI, POOLS, SHAPES, Pod, allocatable, cluster_pods, job_pods, place, quantity
from .test_manifest_schemas import _render

CLOUDS = sorted(POOLS)
RAYJOBS = {c: sorted((ROOT / "cluster" / "kuberay" / c).glob("rayjob-*.yaml")) for c in CLOUDS}


def _cluster(cloud: str) -> dict:
    (cluster,) = [d for d in _render(ROOT / "cluster" / "overlays" / cloud) if d["kind"] == "RayCluster"]
    return cluster


@pytest.fixture(scope="module")
def clusters() -> dict[str, dict]:
    return {cloud: _cluster(cloud) for cloud in CLOUDS}


def test_every_overlay_has_its_node_pools_and_every_rayjob_its_cloud():
    overlays = {p.parent.name for p in (ROOT / "cluster" / "overlays").glob("*/kustomization.yaml")}
    assert overlays == set(CLOUDS)
    for cloud in CLOUDS:
        assert len(RAYJOBS[cloud]) == 7, cloud
        for pool in POOLS[cloud]["pools"].values():
            assert pool["machine"] in SHAPES, f"cluster/machines.yaml: add shapes.{pool['machine']}"


@pytest.mark.parametrize("at_max", [False, True], ids=["replicas", "maxReplicas"])
@pytest.mark.parametrize("cloud", CLOUDS)
def test_the_long_lived_cluster_schedules_on_its_pools(clusters, cloud, at_max):
    """KubeRay calls a cluster Ready only when every pod runs: all of them, at once."""
    problems = place(cloud, cluster_pods(clusters[cloud]["spec"], "vit", at_max=at_max))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", [p for c in CLOUDS for p in RAYJOBS[c]], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_rayjob_schedules_on_its_clouds_pools(path):
    problems = place(path.parent.name, job_pods(yaml.safe_load(path.read_text())))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_no_cpu_pod_may_take_a_gpu_node(clusters, cloud):
    """The head, Ray Data and the submitters have node selectors that keep them off GPU machines:
    on EKS GPU nodes carry no taint, and a CPU pod there holds a p5's CPUs and memory."""
    gpu_pools = {name: p for name, p in POOLS[cloud]["pools"].items() if SHAPES[p["machine"]].get("gpus")}
    pods = [p for path in RAYJOBS[cloud] for p in job_pods(yaml.safe_load(path.read_text()))]
    pods += cluster_pods(clusters[cloud]["spec"], "vit", at_max=True)
    for pod in (p for p in pods if not p.requests["nvidia.com/gpu"]):
        for name, pool in gpu_pools.items():
            assert any(pool.get("labels", {}).get(k) != v for k, v in pod.node_selector.items()), (
                f"{pod.name} may land on {cloud}/{name}: give it a node selector")


# ---------------------------------------------------------------- the blockers the check finds


def _widened(cluster: dict, group: str, **requests) -> dict:
    spec = copy.deepcopy(cluster["spec"])
    (g,) = [x for x in spec["workerGroupSpecs"] if x["groupName"] == group]
    for res in g["template"]["spec"]["containers"][0]["resources"].values():
        res.update(requests)
    return spec


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_data_pod_of_a_whole_32_vcpu_node_fits_nowhere(clusters, cloud):
    """32 CPU / 128Gi, the size the cpu-data group had: larger than any 32-vCPU node's allocatable
    (c7i.8xlarge has 64 GiB; n2-standard-32 ~118 GiB after GKE's reservation)."""
    spec = _widened(clusters[cloud], "cpu-data", cpu="32", memory="128Gi")
    problems = place(cloud, cluster_pods(spec, "vit"))
    assert problems and all("cpu-data" in p for p in problems), problems
    assert f"{cloud}/cpu ({POOLS[cloud]['pools']['cpu']['machine']}): cpu 32 requested" in problems[0], problems[0]


def test_gke_gpu_nodes_refuse_pods_without_the_toleration(clusters):
    spec = copy.deepcopy(clusters["gke"]["spec"])
    spec["workerGroupSpecs"][0]["template"]["spec"].pop("tolerations")
    problems = place("gke", cluster_pods(spec, "vit"))
    assert problems and "taint nvidia.com/gpu=present:NoSchedule not tolerated" in problems[0], problems


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_pod_asking_for_more_disk_than_its_node_has_fits_nowhere(clusters, cloud):
    spec = _widened(clusters[cloud], "cpu-data", **{"ephemeral-storage": "500Gi"})
    problems = place(cloud, cluster_pods(spec, "vit"))
    assert problems and "ephemeral-storage 500.0Gi requested" in problems[0], problems


def test_the_gke_allocatable_follows_the_published_formula():
    """The plan-node-sizes page's example node: 4 vCPU, 100 GiB boot disk: 3920m CPU and
    47060071478 bytes of ephemeral storage allocatable; and its memory tiers worked for 150 GiB:
    9.8577 GiB reserved with the eviction threshold."""
    SHAPES["example"] = {"vcpu": 4, "memory_gib": 150}
    POOLS["gke-example"] = {"reserve": "gke", "daemonsets": {}, "pools": {}}
    try:
        a = allocatable("gke-example", "example", 100)
    finally:
        del SHAPES["example"], POOLS["gke-example"]
    assert a["cpu"] == pytest.approx(3.92)
    assert a["memory"] / GI == pytest.approx(150 - 9.8577, abs=1e-3)
    assert a["ephemeral-storage"] == pytest.approx(47060071478, rel=0.01)


# ---------------------------------------------------------------- what every pod must have


def _ray_pods(cluster_spec: dict):
    for group in [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]:
        yield group.get("groupName", "head"), group


@pytest.mark.parametrize("cloud", CLOUDS)
def test_every_ray_pod_has_a_shared_memory_object_store_and_a_disk_request(clusters, cloud):
    """A memory-backed /dev/shm at least as large as the object store Ray is told to use (without it
    Ray puts the store on the container's disk: 64 MiB is Docker's /dev/shm), inside the memory
    limit it counts against; an ephemeral-storage request (spilled objects, logs) so the kubelet
    does not evict the pod for the disk it writes."""
    specs = [clusters[cloud]["spec"]] + [yaml.safe_load(p.read_text())["spec"]["rayClusterSpec"] for p in RAYJOBS[cloud]]
    for spec in specs:
        for name, group in _ray_pods(spec):
            pod = group["template"]["spec"]
            (c,) = pod["containers"]
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/dev/shm" in mounts, f"{name}: no /dev/shm"
            (vol,) = [v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"]]
            assert vol["emptyDir"]["medium"] == "Memory", name
            shm = quantity(vol["emptyDir"]["sizeLimit"])
            store = quantity(group["rayStartParams"]["object-store-memory"])
            limit = quantity(c["resources"]["limits"]["memory"])
            assert store <= shm < limit, (name, store / GI, shm / GI, limit / GI)
            assert quantity(c["resources"]["requests"]["ephemeral-storage"]) > 0, name


@pytest.mark.parametrize("cloud", CLOUDS)
def test_ray_is_told_the_cpus_its_pod_has(clusters, cloud):
    for name, group in _ray_pods(clusters[cloud]["spec"]):
        (c,) = group["template"]["spec"]["containers"]
        assert float(group["rayStartParams"]["num-cpus"]) <= quantity(c["resources"]["limits"]["cpu"]), name


def test_every_eks_gpu_pod_gets_efa_its_p5_and_ncclS_efa_settings():
    """RayCluster and RayJobs alike (the RayJobs are built from the overlay's RayCluster)."""
    specs = [("RayCluster", _cluster("eks")["spec"])]
    specs += [(p.name, yaml.safe_load(p.read_text())["spec"]["rayClusterSpec"]) for p in RAYJOBS["eks"]]
    for where, spec in specs:
        (gpu,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu"]
        pod = gpu["template"]["spec"]
        (c,) = pod["containers"]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}, where
        efa = SHAPES["p5.48xlarge"]["efa"]
        assert quantity(c["resources"]["requests"]["vpc.amazonaws.com/efa"]) == efa, where
        assert quantity(c["resources"]["limits"]["vpc.amazonaws.com/efa"]) == efa, where
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["NCCL_NET_PLUGIN"] == "ofi" and env["FI_EFA_USE_DEVICE_RDMA"] == "1", where


def test_only_eks_gpu_pods_ask_for_efa():
    for cloud in ("gke", "gfd"):
        for path in RAYJOBS[cloud]:
            assert "vpc.amazonaws.com/efa" not in path.read_text(), path


# ---------------------------------------------------------------- the launchers' node types


@pytest.mark.parametrize("launcher", ["aws.yaml", "gcp.yaml"])
def test_every_launcher_node_type_offers_ray_no_more_than_its_machine_has(launcher):
    config = yaml.safe_load((ROOT / "cluster" / launcher).read_text())
    for name, node in config["available_node_types"].items():
        nc = node["node_config"]
        machine = nc.get("InstanceType") or nc.get("machineType")
        assert machine in SHAPES, f"{launcher} {name}: add shapes.{machine} to cluster/machines.yaml"
        shape, res = SHAPES[machine], node.get("resources", {})
        assert res.get("CPU", 0) <= shape["vcpu"], (name, res, shape)
        assert res.get("GPU", 0) == shape.get("gpus", 0), (name, res, shape)  # all of a GPU machine's GPUs, or none
        assert res.get("memory", 0) <= shape["memory_gib"] * GI, (name, res, shape)
        assert node.get("max_workers", 0) <= config["max_workers"], name


def test_a_pod_larger_than_any_machine_fails_with_every_pool_and_its_shortfall():
    pod = Pod("huge", {"cpu": 300.0, "memory": 4096 * GI, "ephemeral-storage": 0.0, "nvidia.com/gpu": 8.0,
                       "vpc.amazonaws.com/efa": 0.0}, tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    (line,) = place("gke", [pod])
    assert "gke/gpu (a3-highgpu-8g): cpu 300 requested" in line and "memory 4096.0Gi requested" in line, line
    assert "gke/cpu (n2-standard-32)" in line and "gke/system (n2-standard-16)" in line, line


def test_the_docs_node_pool_table_is_the_one_the_check_uses():
    """docs/cluster.md, "Node pools": every pool, its machine, disk and node count as in
    cluster/nodepools.yaml, and what is left per node as tests/cluster/scheduling.py computes it."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    rows = {(m[0], m[1]): m[2:] for m in re.findall(
        r"^\| `(\w+)` \| (\w+) \| (\S+) \([^)]*\) \| (\d+) GiB \| ([0-9.]+) CPU, ([0-9.]+) GiB, (\d+) GiB disk[^|]*\| (\d+) \|",
        text, re.M)}
    want = {(c, p) for c in CLOUDS for p in POOLS[c]["pools"]}
    assert set(rows) == want, set(rows) ^ want
    for (cloud, pool), (machine, disk, cpu, memory, eph, nodes) in rows.items():
        spec = POOLS[cloud]["pools"][pool]
        assert (machine, int(disk), int(nodes)) == (spec["machine"], spec["disk_gib"], spec["max_nodes"]), (cloud, pool)
        a = allocatable(cloud, machine, spec["disk_gib"])
        assert (cpu, memory, int(eph)) == (f"{a['cpu']:.2f}", f"{a['memory'] / GI:.1f}",
                                           round(a["ephemeral-storage"] / GI)), (cloud, pool)
