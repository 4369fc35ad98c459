"""The launcher files' node types under Ray's own autoscaler, on this machine: Ray's fake multi-node
provider takes cluster/aws.yaml's (or gcp.yaml's) worker types as they are (GPUs are logical
resources there: nothing needs one), the head gets a placement group shaped like the Ray Train gang a
shipped job spec asks for (its recipe's workers x {GPU: 1, CPU: cpus_per_worker}), and the
autoscaler must launch GPU nodes of the launcher's type until it fits; a task then runs in
every bundle."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from vitp.cluster.jobspec import load_spec

from .conftest import ROOT, LocalCluster, vitp_env

SPEC = ROOT / "jobs" / "pretrain_b16_i21k.yaml"  # 8 Train workers: one 8-GPU node


def fake_config(launcher: dict) -> dict:
    """The launcher's worker node types for Ray's fake multi-node provider (node_config is the
    cloud's and means nothing there; each node's object store is kept small)."""
    workers = {name: {"resources": {**t["resources"], "object_store_memory": 100 * 2**20}, "node_config": {},
                      "min_workers": t.get("min_workers", 0), "max_workers": t["max_workers"]}
               for name, t in launcher["available_node_types"].items() if name != launcher["head_node_type"]}
    head = launcher["available_node_types"][launcher["head_node_type"]]["resources"]
    return {"cluster_name": launcher["cluster_name"], "max_workers": launcher["max_workers"],
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "available_node_types": {"ray.head.default": {"resources": head, "node_config": {}, "max_workers": 0},
                                     **workers},
            "head_node_type": "ray.head.default", "upscaling_speed": launcher["upscaling_speed"],
            "idle_timeout_minutes": launcher["idle_timeout_minutes"], "auth": {}, "docker": {},
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": []}


# The driver: the gang as a placement group, then one task in each bundle reporting its node's resources.
GANG = textwrap.dedent("""
    import json, sys, ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    workers, cpus = int(sys.argv[1]), float(sys.argv[2])
    ray.init(address=sys.argv[3], logging_level="ERROR")
    pg = placement_group([{"GPU": 1, "CPU": cpus}] * workers, strategy="PACK")
    ray.get(pg.ready(), timeout=float(sys.argv[4]))
    where = ray.remote(num_cpus=cpus, num_gpus=1)(lambda: ray.get_runtime_context().get_node_id())
    ids = ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                   for i in range(workers)])
    shapes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    print("GANG " + json.dumps([shapes[i] for i in ids]))
""")


@pytest.mark.long_cases("gcp.yaml", reason="the rest of the grid; CI keeps aws.yaml")
@pytest.mark.e2e
@pytest.mark.timeout(600)  # CI caps an e2e test at 10 minutes (tests/test_suite_markers.py)
@pytest.mark.parametrize("launcher", ["aws.yaml", "gcp.yaml"])
def test_the_launchers_gpu_type_is_launched_for_a_specs_train_gang(launcher, tmp_path):
    config = yaml.safe_load((ROOT / "cluster" / launcher).read_text())
    (cfg,) = load_spec(str(SPEC), environ={"VITP_STORE": "s3://b/vit"}, check_recipe=False).calls[0].configs()
    workers, cpus = cfg.parallel.num_workers, cfg.parallel.cpus_per_worker
    gpu_type = config["available_node_types"]["gpu"]["resources"]
    cluster = LocalCluster(tmp_path, workers=0, num_cpus=0, auth=False, fake_autoscaling=fake_config(config))
    try:
        out = subprocess.run([sys.executable, "-c", GANG, str(workers), str(cpus), f"127.0.0.1:{cluster.port}", "600"],
                             capture_output=True, text=True, timeout=700, env=vitp_env())
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        shapes = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("GANG "))[5:])
    finally:
        cluster.stop()
    print(f"{launcher}: {workers} bundles on {len({json.dumps(s, sort_keys=True) for s in shapes})} node shape(s): "
          f"{shapes[0]}")
    assert len(shapes) == workers
    # every bundle on a node of the launcher's GPU type, as many of them as the gang needs
    assert all(s["GPU"] == gpu_type["GPU"] and s["CPU"] == gpu_type["CPU"] for s in shapes), shapes
    # the nodes the autoscaler started went with the cluster
    deadline = time.monotonic() + 30
    while (left := _processes_of(cluster.port)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left


def _processes_of(gcs_port: int) -> list[str]:
    """Command lines of this machine's processes that name the cluster's GCS port."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"127.0.0.1:{gcs_port}" in cmd and "pytest" not in cmd:
            out.append(cmd[:200])
    return out
