"""What Ray's autoscaling coordinator gives concurrent Ray Data executions beside Train runs, and
whether such executions run. The question behind it: two 2-CPU sweep trials on two 3-CPU nodes
had their data starve (docs/testing.md). The answer: each trial's driver asked for 0.01 CPU, so no
node had a whole CPU left for a read task; `--driver-cpus 0.01` shows it, `--driver-cpus 0` not.

Run (from the repository root):

  .venv/bin/python benchmarks/data_share.py --nodes 3,3 --trials 2 [--driver-cpus 0.01]

1. Offline, Ray's own coordinator class (`_AutoscalingCoordinatorActor`, built in this process on
   planted nodes of `--nodes` CPUs): each trial's Train run asks for one `--worker-cpus` bundle at
   high priority, then each trial's data stream asks for a share of what is left (as Ray Data's
   executions do). Printed: what each is reserved, per node.
2. Live, the same layout on a local Ray (a 0-CPU head and a node per `--nodes` entry):
   `--driver-cpus` per trial held on each node (as Tune placed the trials' drivers), then a
   placement group and a high-priority coordinator request per trial hold its Train CPUs, then one
   Ray Data execution per trial, in an actor in that group, reads 40 blocks through a 0.2 s map.
   Printed: whether each finished, and in how long (`--timeout` seconds at most).
"""
from __future__ import annotations

import argparse
import time


def offline(cpus: list[float], trials: int, worker_cpus: float) -> dict[str, dict]:
    from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
        STANDARD_RESOURCE_TYPES, ResourceRequestPriority)
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor

    nodes = [{"NodeID": f"node{i}", "Alive": True, "Resources": {"CPU": c, "memory": 8e9, "object_store_memory": 2e9}}
             for i, c in enumerate(cpus)]
    coordinator = _AutoscalingCoordinatorActor(get_cluster_nodes=lambda: nodes,
                                               send_resources_request=lambda *a, **k: None)
    for t in range(trials):
        coordinator.request_resources(f"train-{t}", [{"CPU": worker_cpus}], expire_after_s=600,
                                      priority=ResourceRequestPriority.HIGH)
    for t in range(trials):
        coordinator.request_resources(f"data-{t}", [], expire_after_s=600,
                                      request_remaining=list(STANDARD_RESOURCE_TYPES))
    return {who: {node: res.get("CPU", 0.0) for node, res in coordinator.get_reserved_resources(who).items()}
            for t in range(trials) for who in (f"train-{t}", f"data-{t}")}


def live(cpus: list[float], trials: int, worker_cpus: float, driver_cpus: float,
         timeout: float) -> dict[int, float | None]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import ResourceRequestPriority
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import DefaultAutoscalingCoordinator
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    class Reader:  # a trial's Train worker: its stream runs in the worker, in the trial's group
        def read(self) -> float:
            def slow(batch):
                time.sleep(0.2)
                return batch

            t0 = time.time()
            for _ in ray.data.range(400, override_num_blocks=40).map_batches(slow).iter_batches(batch_size=10):
                pass
            return time.time() - t0

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for c in cpus:
            cluster.add_node(num_cpus=c)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        if driver_cpus:  # the trials' drivers' share, one a node (Tune's trial groups landed so)
            ray.get(placement_group([{"CPU": driver_cpus}] * trials, strategy="STRICT_SPREAD").ready(), timeout=60)
        groups = [placement_group([{"CPU": worker_cpus}], strategy="STRICT_PACK") for _ in range(trials)]
        ray.get([g.ready() for g in groups], timeout=60)
        for t in range(trials):
            DefaultAutoscalingCoordinator(f"train-{t}").request_resources(
                [{"CPU": worker_cpus}], expire_after_s=600, priority=ResourceRequestPriority.HIGH)
        time.sleep(1)
        reads = [Reader.options(scheduling_strategy=PlacementGroupSchedulingStrategy(g)).remote().read.remote()
                 for g in groups]
        ready, _ = ray.wait(reads, num_returns=len(reads), timeout=timeout)
        return {t: ray.get(r) if r in ready else None for t, r in enumerate(reads)}
    finally:  # a stream that never ended is in an actor: the cluster goes with it
        ray.shutdown()
        cluster.shutdown()  # (it also removes the address it wrote to /tmp/ray/ray_current_cluster)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="3,3", help="CPUs of each worker node, comma-separated")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--worker-cpus", type=float, default=2.0, help="each trial's Train bundle")
    p.add_argument("--driver-cpus", type=float, default=0.0, help="each trial driver's CPU share")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    cpus = [float(c) for c in args.nodes.split(",")]
    for who, reserved in offline(cpus, args.trials, args.worker_cpus).items():
        print(f"coordinator, offline: {who} reserved CPUs {reserved}")
    for t, seconds in live(cpus, args.trials, args.worker_cpus, args.driver_cpus, args.timeout).items():
        print(f"live: trial {t}'s data " + (f"finished in {seconds:.1f} s" if seconds is not None
                                            else f"did not finish in {args.timeout:.0f} s"))


if __name__ == "__main__":
    main()
