"""What vitp hands Ray Train's controller in place of its own parts (`Trainer`).

Owns: the failure policy's use (failures.py decides which errors are final), the storage context
and Train's checkpoint bookkeeping kept through a store outage, a worker group that retries a start
a worker died in, an elastic policy that leaves CPUs to the data, and the gang's wait (placement.py).
"""

from __future__ import annotations

import contextlib
import time

import ray
from ray.exceptions import RayActorError
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.exceptions import (InsufficientClusterResourcesError, WorkerGroupStartupFailedError,
                                               WorkerGroupStartupTimeoutError)
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.controller import controller as train_controller
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.worker_group import WorkerGroup
from ray.train.v2.api import data_parallel_trainer
from ray.train.v2.api.exceptions import ControllerError

from ..console import get_logger
from ..errors import ClusterError
from ..storage import through_outages
from .failures import UserErrorsAreFinal
from .placement import PlacementClock, never_fits

log = get_logger(__name__)

# CPUs an elastic run leaves free of its workers: one Ray Data read task of the streams that feed
# them (vitp/train/streams.py) asks for one.
DATA_CPUS = 1.0
# While a worker group waits to (re)start, the coordinator's view of the cluster is refreshed at most
# this often (each refresh lists the nodes and re-reserves every request), each within this timeout.
FRESH_VIEW_S = 5.0
FRESH_VIEW_TIMEOUT_S = 10.0


class StartsWholeOrRetries(WorkerGroup):
    """Train's worker group, except that a worker dying after the group is built but before every
    worker runs the training function is a startup failure, which Train retries. Ray 2.60 raises
    the dead actor's error from there, so the controller ended the run ("controller error"; the
    soak's worker kills hit that window) and left the group's other workers and placement group
    holding their CPUs: those are released here first."""

    def _start(self):
        try:
            super()._start()
        except RayActorError as e:
            if self.has_started():  # Train cleans up only a group that was never built
                with contextlib.suppress(Exception):
                    self._worker_group_state.shutdown()
                self._clear_state()
            raise WorkerGroupStartupFailedError(f"a worker died while its group started: {e}") from e


class LeavesCPUsForData(ElasticScalingPolicy):
    """Train's elastic policy, with no more workers than leave DATA_CPUS of the cluster's CPUs.
    Train's own took every CPU of what was left of a cluster (two 2-CPU workers on the soak's last
    4-CPU node), and the workers then waited forever for the data tasks that had no CPU to run on.
    The count is against the live nodes' CPUs: what Ray's coordinator reserves for Train is never
    more than Train asked for, so leaving a CPU of that reservation always cost a worker (the
    rehearsal's 3 + 3 CPUs ran one 2-CPU worker of two)."""

    _view_refreshed = float("-inf")

    def make_decision_for_non_running_worker_group(self):
        """Before a worker group (re)starts, Ray's coordinator counts against the cluster as it is
        now: its own view is refreshed every 20 s, so a node that joined just before (or was lost
        just before) was missing from (or still in) the count. Two drills in a row on the rehearsal
        cluster started a two-node elastic run with one worker: the coordinator, left by the run
        before, had not yet seen the node that joined."""
        now = time.monotonic()
        if now - self._view_refreshed >= FRESH_VIEW_S:
            self._view_refreshed = now
            with contextlib.suppress(Exception):  # best effort: Train's own next read says what it can
                ray.get(self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                        timeout=FRESH_VIEW_TIMEOUT_S)
                self._latest_reserved_resources_query_time = float("-inf")  # read the fresh reservation
        return super().make_decision_for_non_running_worker_group()

    def _count_possible_workers(self, reserved_resources) -> int:
        n = super()._count_possible_workers(reserved_resources)
        per_worker = self.scaling_config._resources_per_worker_not_none.get("CPU", 0.0)
        cpus = self._cluster_cpus()
        while n > 0 and per_worker and cpus - n * per_worker < DATA_CPUS:
            n -= 1
        return n

    @staticmethod
    def _cluster_cpus() -> float:
        """The CPUs of the cluster's live nodes, where the streams' read tasks run (as
        streams.reader_share counts them)."""
        import ray

        return ray.cluster_resources().get("CPU", 0.0)


def storage_context(run_config):
    """The run's Ray Train storage context, made through a store that cannot be reached for a while:
    making it writes a marker file to the store (`storage.through_outages`)."""
    return through_outages(lambda: run_config.storage_context, f"run {run_config.name}'s Train storage",
                           log.warning)


class WaitsOutTheStore(CheckpointManager):
    """Train's checkpoint bookkeeping (a snapshot of the reported checkpoints, read as the
    controller is made and written after each checkpoint), each read and write tried again while
    the store cannot be reached: the eighth seed-1 soak cut S3 off as a checkpoint was registered,
    and the write's error ended the pre-training as a controller error (exit 1)."""

    def _maybe_load_state_from_storage(self):
        through_outages(super()._maybe_load_state_from_storage, "Train's checkpoint snapshot (read)", log.warning)

    def _write_state_to_storage(self):
        through_outages(super()._write_state_to_storage, "Train's checkpoint snapshot (write)", log.warning)


class Controller(TrainController):
    """Train's controller, with worker groups that retry a start a worker died in. It is built with
    the run's storage context: S3 cut off then made the actor's creation fail, the run (or the
    sweep trial) with it; the context is made first here, waiting out the outage, and its
    checkpoint bookkeeping waits out the store (WaitsOutTheStore). A gang the cluster does not place
    within `placement_timeout_s` ends the run in one line (placement.py): Train alone retries the
    start every RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S for ever, an elastic run waits for ever."""

    worker_group_cls = StartsWholeOrRetries

    def __init__(self, train_fn_ref, train_run_context, *args, placement_timeout_s: float = 0.0, **kwargs):
        self._placement = PlacementClock(placement_timeout_s)
        storage_context(train_run_context.run_config)  # a cached property: Train's read finds it made
        train_controller.CheckpointManager = WaitsOutTheStore  # the name Train's __init__ builds it by
        try:
            super().__init__(train_fn_ref, train_run_context, *args, **kwargs)
        finally:
            train_controller.CheckpointManager = CheckpointManager

    def _make_and_handle_scaling_decision_for_non_running_worker_group(self, controller_state):
        # each pass while no group runs: an elastic run below min_workers decides nothing, and waits here
        scaling = self._train_run_context.scaling_config
        try:
            self._placement.check(scaling.max_workers, scaling._resources_per_worker_not_none, scaling.min_workers)
        except ClusterError as e:  # a ControllerError: no traceback from Train's loop, and not retried
            raise ControllerError(e) from None
        return super()._make_and_handle_scaling_decision_for_non_running_worker_group(controller_state)

    def _start_worker_group(self, num_workers: int, resources_per_worker: dict) -> None:
        self._placement.waiting()
        try:
            super()._start_worker_group(num_workers, resources_per_worker)
        except InsufficientClusterResourcesError as e:
            raise ControllerError(never_fits(num_workers, resources_per_worker, e)) from None
        except WorkerGroupStartupTimeoutError:
            try:
                self._placement.check(num_workers, resources_per_worker)
            except ClusterError as e:
                raise ControllerError(e) from None
            raise  # within the budget: Train tries again
        self._placement.placed()


@contextlib.contextmanager
def _our_controller():
    """Train makes its controller actor of `data_parallel_trainer.TrainController`: ours meanwhile."""
    data_parallel_trainer.TrainController = Controller
    try:
        yield
    finally:
        data_parallel_trainer.TrainController = TrainController


class Trainer(TorchTrainer):
    """TorchTrainer whose controller does not retry a user's mistake (UserErrorsAreFinal), does
    retry a worker group a worker died in as it started, and, elastic, leaves CPUs to the data.
    With `placement_timeout_s` (parallel.placement_timeout_s) a gang not placed in that time ends
    the run with GangNotPlaced."""

    def __init__(self, *args, placement_timeout_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.placement_timeout_s = placement_timeout_s

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["placement_timeout_s"] = self.placement_timeout_s
        if "failure_policy" in controller_init_kwargs:  # otherwise Train's own policy runs
            controller_init_kwargs["failure_policy"] = UserErrorsAreFinal(self.run_config.failure_config)
        if type(controller_init_kwargs.get("scaling_policy")) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = LeavesCPUsForData(self.scaling_config)
        with _our_controller():
            return super()._initialize_and_run_controller(**controller_init_kwargs)
