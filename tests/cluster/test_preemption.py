"""A preemption on a two-node cluster: the worker node is drained with a deadline mid-run
(`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`) and
killed at the deadline, as a cloud reclaims a spot node. Nodes share nothing but an S3 bucket
(moto) and an MLflow server; training is elastic (1..2 workers) and goes on on the head."""
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, vitp, vitp_env

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.e2e]

DEADLINE_S = 20
MAX_WASTED_STEPS = 5  # the bar of Ray Train's own preemption release test
SETTINGS = [
    "parallel.num_workers=2", "parallel.min_workers=1", "parallel.cpus_per_worker=2",
    "parallel.zero_stage=2", "parallel.global_batch=32", "parallel.micro_batch=16",
    "parallel.grad_accum=1", "train.steps=400", "train.log_every=1", "train.eval_every=0",
    "train.checkpoint_every=200", "optim.warmup_steps=5",
]


def sets(items):
    return [a for item in items for a in ("--set", item)]


def _wait_for(pattern: str, log: Path, proc, timeout: float = 600) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, log.read_text(), re.M)
        if m:
            return m
        assert proc.poll() is None, f"training ended before {pattern!r}:\n{log.read_text()[-6000:]}"
        time.sleep(0.5)
    pytest.fail(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-6000:]}")


@pytest.mark.timeout(1800)
def test_drained_node_checkpoints_before_its_deadline_and_the_run_goes_on(rehearsal, tmp_path):
    from mlflow.tracking import MlflowClient
    from ray.util.state import list_nodes

    from vitp import storage

    env, cluster = rehearsal.env, rehearsal.cluster
    gcs = f"127.0.0.1:{cluster.port}"
    work = storage.join(rehearsal.store, "preempt")
    common = [f"work_dir={work}", f"data.shards={storage.join(work, 'shards')}",
              "tracking.run_name=preempted"]
    r = vitp("preprocess", "debug", "--address", gcs, *sets(common), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    log = tmp_path / "pretrain.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vitp.cli", "pretrain", "debug", "--address", gcs,
             "--tracking-uri", rehearsal.mlflow.uri, *sets(common + SETTINGS)],
            cwd=ROOT, env=vitp_env(env), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(r"\[preempted\] step 1[0-9]/", log, proc)
        nodes = list_nodes(address=cluster.address, detail=True)
        worker_node = next(n.node_id for n in nodes if not n.is_head_node and n.state == "ALIVE")
        t_drain = time.time()
        drain = subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", gcs,
             "--node-id", worker_node, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
             "--reason-message", "spot reclaim", "--deadline-remaining-seconds", str(DEADLINE_S)],
            capture_output=True, text=True, env=vitp_env(), timeout=60)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        _wait_for(r"preemption notice for node", log, proc, timeout=DEADLINE_S + 30)
        # the cloud takes the node at the deadline: its `ray start` process group ends
        time.sleep(max(0.0, t_drain + DEADLINE_S - time.time()))
        node_pid = int((cluster.state_dir / "pids").read_text().split()[1])
        subprocess.run(["kill", "-KILL", "--", f"-{node_pid}"], check=False)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 0, text[-8000:]

    last = re.findall(r"last checkpoint at step (\d+)", text)
    resumed = re.findall(r"\[preempted\] resumed from \S+ at step (\d+)", text)
    assert last and resumed, text[-8000:]
    saved, restart = int(last[-1]), int(resumed[-1])
    assert restart == saved, f"resumed at {restart}, not at the preemption checkpoint {saved}"
    before = text[:text.rindex("resumed from")]
    trained = max(int(s) for s in re.findall(r"\[preempted\] step (\d+)/", before))
    wasted = trained - saved
    print(f"preemption: checkpoint at step {saved}, last step before the restart {trained}, "
          f"wasted {wasted} step(s)")
    assert wasted <= MAX_WASTED_STEPS

    client = MlflowClient(rehearsal.mlflow.uri)
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             "attributes.run_name = 'preempted'")[0]
    assert run.info.status == "FINISHED"
    committed = [m for m in client.get_metric_history(run.info.run_id, "perf/ckpt_mb") if m.step == saved]
    assert committed and committed[0].timestamp / 1000 < t_drain + DEADLINE_S, "committed after the deadline"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 401)), "a step is missing or logged twice"
    workers = dict((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "parallel/workers"))
    assert workers[0] == 2 and workers[saved] == 1, workers  # went on with the capacity left
