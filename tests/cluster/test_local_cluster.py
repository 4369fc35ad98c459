"""A real two-node local Ray cluster: the debug pre-training job through `vitp submit`, where its
Train workers ran, its MLflow run, a failing job's exit status and error, that the nodes share
no directory (working dir, TMPDIR, Ray temp dir) but do share the environment they started in,
and that a metric spool left on the worker node reaches MLflow through the driver."""
import pytest
from mlflow.tracking import MlflowClient

from pipeline import recipes
from pipeline.tracking import resolve_tracking_uri

from .conftest import vitp

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.e2e
def test_debug_pretrain_job_succeeds_spreads_workers_and_logs_to_mlflow(two_node_cluster, tmp_path):
    work_dir = tmp_path / "work"
    out = vitp("submit", "jobs/debug_pretrain.yaml", "--follow", "--address", two_node_cluster.address,
               "--set", f"work_dir={work_dir}")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    job_id = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("submitted "))
    assert f"job {job_id} SUCCEEDED" in out.stdout
    assert "done in" in out.stdout  # the driver's own summary came through --follow

    # The run is in the MLflow store the job wrote (SQLite under work_dir), finished, with metrics.
    cfg = recipes.resolve("debug", [f"work_dir={work_dir}"], check_paths=False)
    client = MlflowClient(resolve_tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == [cfg.run_name]
    assert runs[0].info.status == "FINISHED"
    assert "train/loss" in runs[0].data.metrics

    # Where the two Train workers ran: one on each node (Ray's state API, by the job's driver id).
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors, list_nodes

    info = JobSubmissionClient(two_node_cluster.address).get_job_info(job_id)
    workers = list_actors(address=two_node_cluster.address, detail=True, limit=1000,
                          filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", info.driver_info.id)])
    nodes = {n.node_id for n in list_nodes(address=two_node_cluster.address)}
    assert len(workers) == 2, workers
    assert {w.node_id for w in workers} == nodes and len(nodes) == 2


def test_failing_job_makes_submit_exit_nonzero_with_the_jobs_error(two_node_cluster, tmp_path):
    spec = tmp_path / "bad.yaml"
    # Resolves at submission (paths are not checked there) but fails on the cluster: no such corpus.
    spec.write_text("entrypoint: vitp pretrain debug --set data.source=imagefolder "
                    f"--set data.path={tmp_path}/no-such-corpus --set work_dir={tmp_path}/w\n")
    out = vitp("submit", str(spec), "--follow", "--address", two_node_cluster.address)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FAILED" in out.stderr
    assert "no-such-corpus" in out.stderr and "does not exist" in out.stderr


PROBE = '''
import json, os, sys, tempfile, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

def where():
    node = ray._private.worker._global_node
    return {"node": ray.get_runtime_context().get_node_id(), "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
            "ray_tmp": node.get_temp_dir_path(), "endpoint": os.environ.get("AWS_ENDPOINT_URL")}

ray.init()
probe = ray.remote(num_cpus=0)(where)
tasks = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
         for n in ray.nodes() if n["Alive"]]
print("PROBE " + json.dumps({"driver": where(), "tasks": ray.get(tasks)}))
'''


def _job_result(cluster, script, text: str, tag: str, *args: str) -> dict:
    """Run `text` as a Ray job's driver (on the head) with `args`; the JSON it printed after `tag`."""
    import json
    import sys
    import time

    from ray.job_submission import JobSubmissionClient

    script.write_text(text)
    client = JobSubmissionClient(cluster.address)
    job = client.submit_job(entrypoint=" ".join([sys.executable, str(script), *args]))
    deadline = time.time() + 300
    while not client.get_job_status(job).is_terminal() and time.time() < deadline:
        time.sleep(1)
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == "SUCCEEDED", logs[-3000:]
    return json.loads(next(line for line in logs.splitlines() if line.startswith(tag))[len(tag):])


def test_nodes_share_no_directory_and_inherit_the_environment(two_node_cluster, tmp_path):
    """Each node runs in its own working dir, TMPDIR and Ray temp dir (node-0 = the head, where job
    drivers run); the environment cluster/local.sh started in reaches every task on every node."""
    import os

    seen = _job_result(two_node_cluster, tmp_path / "probe.py", PROBE, "PROBE ")
    head, worker = two_node_cluster.node_dirs
    assert seen["driver"]["cwd"] == str(head / "work") and seen["driver"]["tmp"] == str(head / "tmp")
    by_dir = {}
    for t in seen["tasks"]:
        node_dir = next(d for d in (head, worker) if t["cwd"] == str(d / "work"))
        assert (t["tmp"], t["ray_tmp"]) == (str(node_dir / "tmp"), str(node_dir / "ray")), t
        assert t["endpoint"] == os.environ["AWS_ENDPOINT_URL"]
        by_dir[node_dir] = t["node"]
    assert len(by_dir) == 2 and len(set(by_dir.values())) == 2, seen


SPOOL_JOB = r'''
import json, os, subprocess, sys
import ray
from pipeline.tracking.runs import RunLogger
from pipeline.train.spools import gather_spools

uri, = sys.argv[1:]
ray.init()
logger = RunLogger.start(uri, "spools", "rank0-elsewhere", background=True)
here = ray.get_runtime_context().get_node_id()
other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)

# rank 0 on the other node: spools steps 1-5 and dies before sending any (MLflow is not asked)
RANK0 = """
import os, sys
from pipeline.tracking.spoolfile import MetricSpool, spool_dir_for
spool = MetricSpool(spool_dir_for(sys.argv[1]))
for step in range(1, 6):
    spool.append(step, 1000 + step, {"train/loss": 1.0 / step})
print(spool.dir, flush=True)
os._exit(0)
"""

@ray.remote(num_cpus=0, scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(other, soft=False))
def rank0(run_id):
    out = subprocess.run([sys.executable, "-c", RANK0, run_id], capture_output=True, text=True, check=True)
    return out.stdout.strip()

spool_dir = ray.get(rank0.remote(logger.run_id))
gathered = gather_spools(logger.run_id)
logger.end("FINISHED")
print("SPOOL " + json.dumps({"run_id": logger.run_id, "dir": spool_dir, "gathered": gathered,
                             "left": sorted(os.listdir(spool_dir)) if os.path.isdir(spool_dir) else []}))
'''


def test_a_spool_left_on_another_node_reaches_mlflow_before_the_run_ends(two_node_cluster, tmp_path):
    """Rank 0 on the worker node spooled steps 1-5 and died before sending them (its spool is in
    that node's TMPDIR, which the driver on the head cannot see): the driver gathers it through a
    task per node before it ends the run, every step arrives once, and the node's copy is gone."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    seen = _job_result(two_node_cluster, tmp_path / "spool_job.py", SPOOL_JOB, "SPOOL ", uri)
    worker_tmp = str(two_node_cluster.node_dirs[1] / "tmp")
    assert seen["dir"].startswith(worker_tmp), seen  # the spool was on the other node's disk
    assert seen["gathered"] == 1 and seen["left"] == [], seen
    mlflow = MlflowClient(uri)
    history = sorted((m.step, m.value) for m in mlflow.get_metric_history(seen["run_id"], "train/loss"))
    assert history == [(step, 1.0 / step) for step in range(1, 6)]
    assert mlflow.get_run(seen["run_id"]).info.status == "FINISHED"
