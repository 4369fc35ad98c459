"""What vitp hands Ray Train's controller (vitp/train/controller.py).

A Train worker that dies while its worker group starts, on real Ray (the session's 4 logical CPUs)
with vitp's Trainer: a worker group callback kills one worker
once the group is built, before the training function runs on it (the window the soak's worker
kills hit, where Ray 2.60 ended the run as a controller error). The run must start the group
again and finish, and the first group's placement group must be gone. And the elastic policy's
worker counts against Train's own, on the clusters the soak was left with.
"""
import contextlib
import logging
import os
import sys
import time

import cloudpickle
import pytest
import ray
import ray.train
from ray.exceptions import RayActorError
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from vitp.train.controller import DATA_CPUS, LeavesCPUsForData, Trainer

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the controller and workers need no tests/ path


@contextlib.contextmanager
def _controller_warnings():
    """The warnings vitp/train/controller.py logs inside the block, as a list of their messages."""
    said, heard = [], logging.Handler(logging.WARNING)
    heard.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vitp.train.controller").addHandler(heard)
    try:
        yield said
    finally:
        logging.getLogger("vitp.train.controller").removeHandler(heard)


def _train(config):
    import ray.train

    ray.train.report({"rank": ray.train.get_context().get_world_rank()})


class KillsAWorkerOnce(WorkerGroupCallback):
    """Kills the group's last worker the first time a group has started, and waits until it is dead."""

    def __init__(self, marker: str):
        self.marker = marker

    def after_worker_group_start(self, worker_group):
        if os.path.exists(self.marker):
            return
        open(self.marker, "w").close()
        victim = worker_group.get_workers()[-1].actor
        ray.kill(victim, no_restart=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get(victim.__ray_ready__.remote(), timeout=10)
            except RayActorError:
                return
            time.sleep(0.2)
        raise AssertionError("the killed worker still answers")


class KillingTrainer(Trainer):
    marker = ""

    def _initialize_and_run_controller(self, **kwargs):
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), KillsAWorkerOnce(self.marker)]
        return super()._initialize_and_run_controller(**kwargs)


def _live_groups() -> set[str]:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_dying_as_its_group_starts_is_retried_and_its_group_released(ray_session, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    before = _live_groups()
    trainer = KillingTrainer(_train, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                             run_config=RunConfig(name="group-start", storage_path=str(tmp_path / "ray"),
                                                  failure_config=FailureConfig(max_failures=0)))
    trainer.marker = str(tmp_path / "killed")
    result = trainer.fit()  # raised "Training failed due to controller error" before
    assert os.path.exists(trainer.marker), "the callback never killed a worker"
    assert result.error is None
    assert _live_groups() - before == set(), "a worker group's placement group outlived its run"


@pytest.mark.parametrize("nodes,reserved,train_own,ours", [
    # what Ray's coordinator reserves for Train: the bundles of its request that fit, no more
    ([4], [4], 2, 1),  # the soak's last node: Train's two workers left no CPU for the reads
    ([4, 4], [4, 2], 3, 3),  # 2 CPUs left over either way
    ([3, 3], [2, 2], 2, 2),  # the rehearsal cluster's two nodes: 2 left
    ([2], [2], 1, 0),  # one worker would take the only 2 CPUs: wait for more instead of hanging
])
def test_an_elastic_run_leaves_cpus_to_its_data_tasks(nodes, reserved, train_own, ours):
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    class OnNodes(LeavesCPUsForData):  # the cluster's CPUs as given, not this process's Ray
        @staticmethod
        def _cluster_cpus():
            return float(sum(nodes))

    config = ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 2})
    reserved = {f"node-{i}": {"CPU": float(n), "memory": 8e9} for i, n in enumerate(reserved)}
    assert ElasticScalingPolicy(config)._count_possible_workers(reserved) == train_own
    n = OnNodes(config)._count_possible_workers(reserved)
    assert n == ours and sum(nodes) - 2 * n >= DATA_CPUS


def _world(config):
    import tempfile

    import ray.train

    with tempfile.TemporaryDirectory() as d:  # Train V2's Result keeps the metrics of checkpointed reports
        ray.train.report({"world": ray.train.get_context().get_world_size()},
                         checkpoint=ray.train.Checkpoint.from_directory(d))


@pytest.mark.ray
@pytest.mark.slow
def test_an_elastic_run_takes_every_worker_that_leaves_a_cpu(ray_session, tmp_path):
    """On the session's 4 CPUs, an elastic run of 1..2 one-CPU workers leaves 2 CPUs for the data,
    so both start (counted against Train's own reservation, one did). That a worker which would
    take the last CPU does not start is the policy's unit test above (the soak's last node)."""
    from ray.train import RunConfig, ScalingConfig

    trainer = Trainer(_world, scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1}),
                      run_config=RunConfig(name="elastic", storage_path=str(tmp_path / "ray")))
    result = trainer.fit()
    assert result.error is None and result.metrics["world"] == 2, result.metrics


@pytest.mark.slow  # waits out a 12 s cut-off
def test_the_controller_makes_its_storage_through_a_store_cut_off(s3):
    """S3 cut off for 12 s (tests/netproxy.py) as Train's controller makes the run's storage
    context (a marker file written to the store): it tries again, says so, and the context is made
    once S3 is back; before, the controller actor's creation failed and the sweep trial with it."""
    from vitp import storage
    from vitp.train.controller import storage_context

    root = storage.join(s3.bucket(), "runs")
    fs, inner = storage.filesystem(root)
    run_config = ray.train.RunConfig(name="cut", storage_path=inner, storage_filesystem=fs)
    with _controller_warnings() as said, s3.proxy.cut_for(12.0):
        context = storage_context(run_config)
    assert any("run cut's Train storage" in line and "storage unreachable" in line for line in said), said
    assert run_config.storage_context is context  # what Train's controller reads next
    assert storage.listdir(storage.join(root, "cut"))  # its marker file is in the bucket


@pytest.mark.slow  # waits out two 6 s cut-offs
def test_trains_checkpoint_bookkeeping_waits_out_a_store_cut_off(s3):
    """Train's checkpoint manager reads its snapshot as the controller is made and writes it after
    each checkpoint; S3 cut off for 6 s at each (the eighth seed-1 soak's pre-training ended as a
    controller error on the write). Train's own manager fails at once; ours tries again, says so,
    and the snapshot is in the bucket once S3 is back."""
    import json

    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager

    from vitp import storage
    from vitp.train.controller import WaitsOutTheStore

    fs, inner = storage.filesystem(storage.join(s3.bucket(), "runs"))
    context = ray.train.RunConfig(name="snap", storage_path=inner, storage_filesystem=fs).storage_context
    with s3.proxy.cut_for(6.0), pytest.raises(OSError):
        CheckpointManager(checkpoint_config=CheckpointConfig(), storage_context=context)
    with _controller_warnings() as said:
        with s3.proxy.cut_for(6.0):
            manager = WaitsOutTheStore(checkpoint_config=CheckpointConfig(), storage_context=context)
        with s3.proxy.cut_for(6.0):
            manager._write_state_to_storage()
    for what in ("read", "write"):
        assert any(f"checkpoint snapshot ({what})" in line and "storage unreachable" in line for line in said), said
    with fs.open_input_stream(context.checkpoint_manager_snapshot_path) as f:
        assert json.loads(f.read()) == json.loads(manager._save_state())
