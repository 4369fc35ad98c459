"""Where a job's driver runs, and where it logs: the shipped specs ask for the head's own resource
(vitp_driver), which every head we ship offers and no worker does; a spec's resources are checked
before anything is sent; and a job is never sent this machine's loopback as its MLflow address when
the cluster is elsewhere."""
import json
import re
import shlex

import pytest
import yaml

from vitp.cluster.jobs import check_job_tracking, loopback_host, this_machines_addresses
from vitp.cluster.jobspec import DRIVER_RESOURCE, load_spec
from vitp.errors import ConfigError

from .conftest import ROOT, vitp

JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
CLOUD_JOBS = [p for p in JOBS if p.stem != "debug_pretrain"]  # that one is for a laptop's cluster
ENV = {"VITP_STORE": "s3://bucket/vit", "PRETRAINED": "s3://bucket/vit/h14_i21k/export"}


def _launcher_offers(path) -> tuple[dict[str, dict], str]:
    """(node type -> its resources, the head node type) of a Ray cluster launcher YAML."""
    conf = yaml.safe_load(path.read_text())
    return {name: t.get("resources", {}) for name, t in conf["available_node_types"].items()}, conf["head_node_type"]


def _kuberay_offers(spec: dict) -> dict[str, dict]:
    """group -> the custom resources its rayStartParams give (head: 'head'), read twice: as the pod's
    shell reads `ray start --resources=VALUE` (KubeRay writes that line), and as Ray's KubeRay
    autoscaler reads the group (its own parser), which must agree."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    groups = {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}
    out = {}
    for name, g in groups.items():
        params = g.get("rayStartParams", {})
        raw = params.get("resources")
        out[name] = json.loads(" ".join(shlex.split(raw))) if raw else {}
        assert _get_custom_resources({}, params, name) == out[name], (name, raw)
    return out


RAYCLUSTER = yaml.safe_load((ROOT / "cluster" / "kuberay" / "raycluster.yaml").read_text())
RAYJOBS = sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml"))


def _local_sh_head_offers() -> dict:
    text = (ROOT / "cluster" / "local.sh").read_text()
    head = text[text.index('"$BIN/ray" start --head'):]
    head = head[:head.index("&\n")]
    return json.loads(shlex.split(head[head.index("--resources"):])[1])


@pytest.mark.parametrize("path", CLOUD_JOBS, ids=lambda p: p.name)
def test_every_cloud_spec_runs_its_driver_on_the_head(path):
    spec = load_spec(str(path), environ=ENV)
    assert spec.kwargs.get("entrypoint_resources") == {DRIVER_RESOURCE: 1}, path.name
    # the heads offer no CPU: a CPU request would send the driver to a worker
    assert not spec.kwargs.get("entrypoint_num_cpus") and not spec.kwargs.get("entrypoint_num_gpus")


def test_every_head_we_ship_offers_the_driver_resource_and_no_worker_does():
    for path in (ROOT / "cluster" / "aws.yaml", ROOT / "cluster" / "gcp.yaml"):
        types, head = _launcher_offers(path)
        assert types[head].get(DRIVER_RESOURCE, 0) >= 1 and types[head].get("CPU") == 0, path.name
        assert all(DRIVER_RESOURCE not in r for name, r in types.items() if name != head), path.name
    groups = _kuberay_offers(RAYCLUSTER["spec"])
    assert groups.pop("head").get(DRIVER_RESOURCE, 0) >= 1
    assert all(DRIVER_RESOURCE not in r for r in groups.values()), groups
    assert _local_sh_head_offers().get(DRIVER_RESOURCE, 0) >= 1


@pytest.mark.parametrize("path", RAYJOBS, ids=lambda p: p.name)
def test_every_rayjob_asks_for_what_its_own_head_offers(path):
    """The RayJob's submitter passes entrypointResources (a JSON string) to `ray job submit`; its
    cluster's head offers that resource and no worker group does."""
    spec = yaml.safe_load(path.read_text())["spec"]
    asked = json.loads(spec["entrypointResources"])
    assert asked == {DRIVER_RESOURCE: 1} and "entrypointNumCpus" not in spec, path.name
    groups = _kuberay_offers(spec["rayClusterSpec"])
    assert groups.pop("head").get(DRIVER_RESOURCE, 0) >= asked[DRIVER_RESOURCE], path.name
    assert all(DRIVER_RESOURCE not in r for r in groups.values()), path.name


@pytest.mark.parametrize("value", ["{vitp_driver: 0}", "{vitp_driver: -1}", "{vitp_driver: .nan}",
                                   "{vitp_driver: true}", "{vitp_driver: one}", "{1: 1}"])
def test_a_bad_resource_amount_is_refused_in_one_line(tmp_path, value):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"entrypoint: vitp config debug\nentrypoint_resources: {value}\n")
    with pytest.raises(ConfigError, match=r"entrypoint_resources .*positive amount.*vitp_driver: 1"):
        load_spec(str(spec))
    out = vitp("submit", str(spec), "--address", "http://127.0.0.1:9")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("uri,loopback", [("http://127.0.0.1:5000", True), ("https://localhost", True),
                                          ("http://[::1]:5000", True), ("http://0.0.0.0:5000", True),
                                          ("http://127.8.9.1", True), ("http://mlflow.mlflow.svc:5000", False),
                                          ("http://10.0.0.7:5000", False), ("sqlite:///x.db", False),
                                          ("file:///tmp/mlruns", False)])
def test_loopback_hosts(uri, loopback):
    assert bool(loopback_host(uri)) is loopback


def test_a_loopback_mlflow_address_goes_only_to_a_cluster_on_this_machine():
    mine = sorted(ip for ip in this_machines_addresses() if not ip.startswith("127."))
    assert mine, "this machine has an address besides loopback"
    env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}

    def never():
        raise AssertionError("asked the cluster although its address is elsewhere")

    # a head elsewhere: refused without asking it
    with pytest.raises(ConfigError, match=r"--job-tracking-uri .*VITP_JOB_TRACKING_URI"):
        check_job_tracking(env, "http://203.0.113.7:8265", never)
    # a port-forward (the address is this machine) to nodes elsewhere: refused
    with pytest.raises(ConfigError, match=r"nodes 10\.4\.0\.9"):
        check_job_tracking(env, "http://127.0.0.1:8265", lambda: [mine[0], "10.4.0.9"])
    # every node is this machine (cluster/local.sh): taken
    check_job_tracking(env, "http://127.0.0.1:8265", lambda: mine)
    check_job_tracking(env, f"http://{mine[0]}:8265", lambda: mine)
    # an address the cluster resolves itself: never asked
    check_job_tracking({"MLFLOW_TRACKING_URI": "http://mlflow.mlflow.svc:5000"}, "http://203.0.113.7:8265", never)


def test_submit_refuses_to_send_a_loopback_mlflow_address_to_a_cluster_elsewhere():
    env = {**ENV, "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
    out = vitp("submit", "jobs/fewshot.yaml", "--address", "http://203.0.113.7:8265", env=env)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "--job-tracking-uri" in out.stderr
    assert not re.search(r"^submitted", out.stdout, re.M)
    # the user's own --job-tracking-uri is taken as it is (nothing listens there: refused after)
    out = vitp("submit", "jobs/fewshot.yaml", "--address", "http://203.0.113.7:9", "--job-tracking-uri",
               "http://10.0.0.7:5000", env=env, timeout=120)
    assert out.returncode == 3, out.stderr


def test_doctor_fails_a_cluster_where_no_node_offers_the_driver_resource(ray_session, tmp_path):
    """This session's Ray (started by ray.init, as a cluster someone else set up) has no head
    resource: every shipped spec would wait there, so the doctor's cluster line says so, with the fix.
    (Joined from this process, which is connected already: the doctor's path for a GCS address.)"""
    import ray

    from vitp.cluster.doctor import _join
    from vitp.recipes import resolve

    found = []
    check = _join(ray.get_runtime_context().gcs_address, resolve("debug", [f"work_dir={tmp_path}"]), found)
    assert found and found[0].nodes, "the cluster was read"
    assert not check.ok and f"no node offers {DRIVER_RESOURCE}" in check.detail, check.line()
    assert f"--resources '{{\"{DRIVER_RESOURCE}\": 16}}'" in check.fix, check.line()
