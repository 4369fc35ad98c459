"""A real two-node local Ray cluster: a failing job's exit status and error, that the nodes share
no directory (working dir, TMPDIR, Ray temp dir) but do share the environment they started in,
that a metric spool left on the worker node reaches MLflow through the driver, that two 2-CPU
sweep trials train side by side on two 3-CPU nodes, and that a real
Train run whose rank 0 runs on the worker node and is killed before its last send loses no step;
that a vitp driver joining the cluster removes the placement groups an ended vitp job left; that
two nodes added at once each get directories of their own.
A pre-training job through `vitp submit --follow`, one Train worker per node, its MLflow run
FINISHED: the rehearsal's stage 2 (tests/cluster/test_rehearsal.py), on S3, with a worker killed."""
import pytest
from mlflow.tracking import MlflowClient

from .conftest import sets, vitp

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.e2e  # on the cluster the e2e tests below start
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
            "ray_tmp": node.get_temp_dir_path(), "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
            "ray_address": os.environ.get("RAY_ADDRESS")}

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


@pytest.mark.e2e  # on the cluster the e2e tests below start
def test_nodes_share_no_directory_and_inherit_the_environment(two_node_cluster, tmp_path):
    """Each node runs in its own working dir, TMPDIR and Ray temp dir (node-0 = the head, where job
    drivers run); the environment cluster/local.sh started in reaches every task on every node, and
    RAY_ADDRESS names this cluster there (Ray's state API finds it, not another Ray beside it)."""
    import os

    seen = _job_result(two_node_cluster, tmp_path / "probe.py", PROBE, "PROBE ")
    head, worker = two_node_cluster.node_dirs
    assert seen["driver"]["cwd"] == str(head / "work") and seen["driver"]["tmp"] == str(head / "tmp")
    by_dir = {}
    for t in seen["tasks"]:
        node_dir = next(d for d in (head, worker) if t["cwd"] == str(d / "work"))
        assert (t["tmp"], t["ray_tmp"]) == (str(node_dir / "tmp"), str(node_dir / "ray")), t
        assert t["endpoint"] == os.environ["AWS_ENDPOINT_URL"]
        assert t["ray_address"] == f"127.0.0.1:{two_node_cluster.port}", t
        by_dir[node_dir] = t["node"]
    assert len(by_dir) == 2 and len(set(by_dir.values())) == 2, seen


SPOOL_JOB = r'''
import json, os, subprocess, sys
import ray
from vitp.tracking.runs import RunLogger
from vitp.train.spools import gather_spools

uri, = sys.argv[1:]
ray.init()
logger = RunLogger.start(uri, "spools", "rank0-elsewhere", background=True)
here = ray.get_runtime_context().get_node_id()
other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)

# rank 0 on the other node: spools steps 1-5 and dies before sending any (MLflow is not asked)
RANK0 = """
import os, sys
from vitp.tracking.spoolfile import MetricSpool, spool_dir_for
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


@pytest.mark.e2e  # a job on the cluster the e2e tests above start
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


@pytest.mark.e2e  # a sweep on the cluster the e2e tests above start
def test_two_trials_of_two_cpus_each_train_side_by_side_on_two_three_cpu_nodes(two_node_cluster, tmp_path):
    """A sweep of two trials, each one 2-CPU Train worker, on two 3-CPU nodes: one trial trains on
    each node and reads its data with the CPU that node has left. Each trial's driver asked for a
    token 0.01 CPU, so a node with a driver had 0.99 CPU left, no 1-CPU read task of either trial
    could run anywhere, and the sweep hung on "Cluster resources are not enough to run any task"."""
    import subprocess

    gcs = f"127.0.0.1:{two_node_cluster.port}"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = [f"work_dir={tmp_path}/work"]
    r = vitp("preprocess", "debug_finetune", "--address", gcs, *sets(common))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    settings = ["parallel.num_workers=1", "parallel.cpus_per_worker=2", "parallel.global_batch=16",
                "parallel.micro_batch=16", "parallel.grad_accum=1", "train.steps=10", "train.log_every=5",
                "train.eval_every=0", "train.checkpoint_every=0", "tune.max_concurrent_trials=2"]
    try:
        r = vitp("sweep", "debug_finetune", "--name", "side-by-side", "--address", gcs, "--tracking-uri", uri,
                 "--space", "optim.lr=0.03,0.1", *sets(common + settings), timeout=420)
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        pytest.fail(f"the sweep did not end in {e.timeout:.0f} s:\n{out[-3000:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    mlflow = MlflowClient(uri)
    runs = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()], "tags.sweep = 'side-by-side'")
    trials = [run for run in runs if run.data.tags.get("mlflow.parentRunId")]
    assert len(trials) == 2 and all(run.info.status == "FINISHED" for run in trials), \
        [(run.info.run_name, run.info.status) for run in trials]


# The run's checkpoint interval; MLflow goes down once rank 0 has logged SENT_BEFORE_OUTAGE steps.
CHECKPOINT_EVERY, SENT_BEFORE_OUTAGE = 50, 60
RANK0_JOB = r'''
import functools, json, sys
import ray, ray.train
from vitp import recipes
from vitp.config import Run
from vitp.data.commands import ensure_shards
from vitp.train.trainer import run_training

uri, work, shards, steps, checkpoint_every = sys.argv[1:]
ray.init()
here = ray.get_runtime_context().get_node_id()
other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
# The one Train worker (rank 0) on the node that is not the driver's: Train's per-worker label
# selector, set here because where rank 0 runs is otherwise Ray's choice.
ray.train.ScalingConfig = functools.partial(ray.train.ScalingConfig, label_selector=[{"ray.io/node-id": other}])
cfg = recipes.resolve("debug", [f"work_dir={work}", f"data.shards={shards}", f"tracking.uri={uri}",
                                "tracking.run_name=rank0-elsewhere", "parallel.num_workers=1", "parallel.grad_accum=2",
                                "parallel.cpus_per_worker=2", f"train.steps={steps}", "train.log_every=1",
                                "train.eval_every=0", f"train.checkpoint_every={checkpoint_every}",
                                "train.max_failures=1", "tracking.log_timeout_s=2", "tracking.system_metrics=false"])
ensure_shards(Run.of(cfg))  # the test session's: already there
summary = run_training(Run.of(cfg), with_val=False)
print("RANK0 " + json.dumps({"run_id": summary.mlflow_run_id, "node": other, "step": summary.metrics["step"]}))
'''


def _spooled_steps(spool_root) -> int:
    """The highest step in any spool file under `spool_root` (0 if none)."""
    import json

    top = 0
    for path in spool_root.rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                top = max(top, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError):
                continue  # a line being written
    return top


@pytest.mark.long(reason="a long fault drill; CI kills the rehearsal's worker mid-run and resumes from the "
                         "bucket")
@pytest.mark.e2e
def test_rank0_on_the_worker_node_killed_before_its_last_send_loses_and_repeats_no_step(two_node_cluster, debug_shards,
                                                                                       tmp_path):
    """A real Train run whose only worker, rank 0, runs on the non-head node (on the session's debug
    shards). MLflow goes down after step SENT_BEFORE_OUTAGE; rank 0 spools on past the next
    checkpoint and is SIGKILLed with those steps never sent, and its spool file is deleted (as a lost
    node's disk); MLflow comes back; Train restarts the worker from that checkpoint, so the steps
    before it are not trained again and reach MLflow only from the checkpoint's metric backlog.
    Every step's train/loss is in MLflow exactly once and the run is FINISHED."""
    import json
    import os
    import signal
    import sys
    import time

    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    from vitp.net import free_port
    from vitp.tracking.server import start_server

    # margin: the outage and the kill (near step 110 or 160) must come before the run ends, also at
    # 40 steps/s (about 15 on 2 cores here)
    steps = 400
    store, port = f"sqlite:///{tmp_path}/mlflow.db", free_port()
    server = start_server(store, str(tmp_path / "artifacts"), port=port, log_path=tmp_path / "mlflow-1.log")
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_JOB)
    jobs = JobSubmissionClient(two_node_cluster.address)
    job = jobs.submit_job(entrypoint=" ".join([sys.executable, str(script), server.uri, str(tmp_path / "work"),
                                               debug_shards, str(steps), str(CHECKPOINT_EVERY)]))
    mlflow = MlflowClient(server.uri)

    def logged(run_id) -> list[int]:
        return [m.step for m in mlflow.get_metric_history(run_id, "train/loss")]

    deadline, run_id = time.time() + 400, None
    while run_id is None or len(logged(run_id)) < SENT_BEFORE_OUTAGE:  # past the first checkpoint
        assert not jobs.get_job_status(job).is_terminal(), jobs.get_job_logs(job)[-3000:]
        assert time.time() < deadline, f"the run never logged {SENT_BEFORE_OUTAGE} steps"
        exp = mlflow.get_experiment_by_name("vit-pipeline-debug")
        runs = mlflow.search_runs([exp.experiment_id], "attributes.run_name = 'rank0-elsewhere'") if exp else []
        run_id = runs[0].info.run_id if runs else None
        time.sleep(0.5)
    server.stop()  # the outage: rank 0 spools what it cannot send
    sent = max(m.step for m in MlflowClient(store).get_metric_history(run_id, "train/loss"))  # the store itself
    spool_root = two_node_cluster.node_dirs[1] / "tmp" / f"vitp-{os.geteuid()}" / "mlflow-spool" / run_id
    # past the next checkpoint: the restarted worker resumes from it, so steps sent+1..checkpoint
    # are trained once only, and reach MLflow only if the dead rank 0's spool does
    target, deadline = (sent // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY + 10, time.time() + 300
    while _spooled_steps(spool_root) < target:
        assert not jobs.get_job_status(job).is_terminal(), "the run ended during the outage (raise steps)"
        assert time.time() < deadline, f"rank 0 spooled no step {target} under {spool_root}"
        time.sleep(0.2)
    (rank0,) = list_actors(address=two_node_cluster.address, detail=True,
                           filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    spooled = _spooled_steps(spool_root)
    os.kill(rank0.pid, signal.SIGKILL)  # before its last send: steps sent+1..spooled are only in its spool
    lost = list(spool_root.glob(f"{rank0.pid}-*.jsonl"))
    for path in lost:  # and that spool goes as with its node's disk: steps before the checkpoint come from it
        path.unlink()
    server = start_server(store, str(tmp_path / "artifacts"), port=port, log_path=tmp_path / "mlflow-2.log")
    while not jobs.get_job_status(job).is_terminal():
        time.sleep(1)
    logs = jobs.get_job_logs(job)
    assert jobs.get_job_status(job) == "SUCCEEDED", logs[-3000:]
    seen = json.loads(next(line for line in logs.splitlines() if line.startswith("RANK0 "))[len("RANK0 "):])
    assert rank0.node_id == seen["node"] and seen["step"] == steps  # rank 0 ran on the node without the driver
    print(f"MLflow had steps 1-{sent}; rank 0 had spooled to step {spooled} when it was killed")
    assert spooled >= target > sent and lost, (sent, spooled, lost)
    mlflow = MlflowClient(server.uri)
    assert sorted(logged(run_id)) == list(range(1, steps + 1))  # every step, once
    assert mlflow.get_run(run_id).info.status == "FINISHED"
    server.stop()


KEEPER = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], namespace="orphans")

@ray.remote(num_cpus=0)
class Keeper:  # outlives this job; the group it makes is not detached, so it is its job's
    def make(self):
        self.pg = placement_group([{"CPU": 1}])
        ray.get(self.pg.ready())
        return self.pg.id.hex()

print("PG " + ray.get(Keeper.options(name=sys.argv[2], lifetime="detached").remote().make.remote()))
"""

JANITOR = """
import json, sys, time
from ray.util.state import list_placement_groups
from vitp.cluster.connect import connect_ray
from vitp.config import ExperimentConfig
connect_ray(ExperimentConfig(), sys.argv[1])
mine, theirs = sys.argv[2:]
deadline = time.time() + 60
while time.time() < deadline:
    live = {g.placement_group_id for g in list_placement_groups(address=sys.argv[1], limit=10000) if g.state != "REMOVED"}
    if mine not in live:
        break
    time.sleep(1)
print("LEFT " + json.dumps(sorted(live & {mine, theirs})))
import ray
for name in ("ours", "theirs"):
    ray.kill(ray.get_actor(name, namespace="orphans"))
"""


@pytest.mark.e2e
def test_a_driver_joining_removes_the_placement_groups_an_ended_vitp_job_left(two_node_cluster, tmp_path):
    """A job that ran vitp (a script named vitp) ends and leaves a placement group that is not
    detached, as Ray should have removed with it (the chaos soak's sweep drivers, SIGKILLed, left
    their trials' worker groups holding CPUs so that a pre-training waited forever): a vitp driver
    that joins the cluster removes it, and names it. Another job's such group stays (a detached
    actor of it may still use it)."""
    import subprocess
    import sys

    from tests.localcluster import vitp_env

    def run(script, *args):
        out = subprocess.run([sys.executable, str(script), f"127.0.0.1:{two_node_cluster.port}", *args], env=vitp_env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    (tmp_path / "vitp").write_text(KEEPER)
    (tmp_path / "keeper.py").write_text(KEEPER)
    (tmp_path / "janitor.py").write_text(JANITOR)
    ours = run(tmp_path / "vitp", "ours").stdout.split("PG ")[1].split()[0]
    theirs = run(tmp_path / "keeper.py", "theirs").stdout.split("PG ")[1].split()[0]
    out = run(tmp_path / "janitor.py", ours, theirs)
    assert out.stdout.split("LEFT ")[1].strip() == f'["{theirs}"]', out.stdout + out.stderr[-2000:]
    assert f"removed placement group {ours}" in out.stderr + out.stdout


@pytest.mark.e2e
def test_two_nodes_added_at_once_each_get_an_index_and_directories_of_their_own(two_node_cluster):
    """Two nodes joining at once (an autoscaler replacing two lost VMs, as the chaos soak does) each
    get their own index and directories, and both are recorded for kill-node and stop: two
    add-nodes at once took the same index, so two raylets shared one node's directories and one of
    them was lost from the cluster's record."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    cluster = two_node_cluster
    recorded = len((cluster.state_dir / "pids").read_text().split())  # the head's and each worker's
    with ThreadPoolExecutor(2) as pool:
        indices = sorted(pool.map(lambda _: cluster.add_node(), range(2)))
    try:
        assert indices == [recorded, recorded + 1], indices
        pids = (cluster.state_dir / "pids").read_text().split()
        assert len(set(pids)) == len(pids) == recorded + 2, pids
        gcs = ray._raylet.GcsClient(address=f"127.0.0.1:{cluster.port}")
        sockets = [n.raylet_socket_name for n in gcs.get_all_node_info().values() if n.state == 0]  # 0: ALIVE
        for i in indices:
            own = [s for s in sockets if s.startswith(f"{cluster.node_dirs[i] / 'ray'}/")]
            assert len(own) == 1, (i, sockets)
    finally:
        for i in indices:
            cluster.kill_node(i)
