"""The all-reduce bus bandwidth across a recipe's Train gang (`vitp doctor --allreduce`): the worker
group training would get (NCCL on GPUs, gloo on CPUs) all-reduces a float32 buffer; bus bandwidth =
bytes / the slowest rank's mean time x 2(n-1)/n, as nccl-tests reports it (docs/cluster.md).
`python -m vitp.cluster.allreduce` is the probe job (gloo on a laptop too). Must not train, or leave
its Train run's folder behind."""
from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass

from vitp.cluster.checks import Check

RESULT_TAG = "VITP_ALLREDUCE "
FIX = ("check the nodes' fabric: EFA interfaces on p5, GPUDirect-TCPX NICs on a3, one placement group or "
       "compact placement policy, NCCL_DEBUG=INFO in the job's env (docs/cluster.md, 'Bandwidth between nodes')")


@dataclass
class Gang:
    """The worker group to measure: the recipe's parallel settings, and how much to all-reduce."""

    workers: int
    use_gpu: bool
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    mib: int = 0  # 0: 256 MiB on GPUs (bandwidth-bound, as NCCL's own tests), 16 MiB on CPUs
    iters: int = 0  # 0: 20 on GPUs, 5 on CPUs

    @classmethod
    def of(cls, cfg, mib: int = 0) -> "Gang":
        p = cfg.parallel
        return cls(p.num_workers, p.use_gpu, p.cpus_per_worker, p.gpus_per_worker, mib)

    def sized(self) -> "Gang":
        return Gang(self.workers, self.use_gpu, self.cpus_per_worker, self.gpus_per_worker,
                    self.mib or (256 if self.use_gpu else 16), self.iters or (20 if self.use_gpu else 5))


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s (1e9 bytes) of an all-reduce of `nbytes` on `world` ranks."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def _measure(config: dict) -> None:
    """A Train worker's part: warm up, time `iters` all-reduces, report the slowest rank's mean."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    device = ray.train.torch.get_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    buf = torch.ones(config["mib"] * 2**20 // 4, dtype=torch.float32, device=device)
    for _ in range(2):
        dist.all_reduce(buf)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(config["iters"]):
        dist.all_reduce(buf)
    sync()
    mean = torch.tensor([(time.perf_counter() - t0) / config["iters"]], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    ctx = ray.train.get_context()
    ray.get(config["sink"].put.remote(ctx.get_world_rank(), ray.get_runtime_context().get_node_id(),
                                      float(mean.item()), dist.get_backend()))


def measure(gang: Gang, storage_root: str) -> dict:
    """Run the probe on the connected Ray cluster; its Train run's folder goes under
    `storage_root`/.vitp-doctor and is removed. The result: workers, nodes, backend, mib,
    seconds (the slowest rank's mean), algbw_gbps, busbw_gbps."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from vitp import storage

    gang = gang.sized()

    @ray.remote(num_cpus=0)
    class Sink:
        def __init__(self):
            self.seen: dict[int, tuple[str, float, str]] = {}

        def put(self, rank: int, node: str, seconds: float, backend: str) -> None:
            self.seen[rank] = (node, seconds, backend)

        def get(self) -> dict:
            return self.seen

    sink = Sink.remote()
    resources = {"CPU": gang.cpus_per_worker, **({"GPU": gang.gpus_per_worker} if gang.use_gpu else {})}
    root = storage.join(storage_root, ".vitp-doctor")
    name = f"allreduce-{uuid.uuid4().hex[:8]}"
    fs, inner = storage.filesystem(root)
    try:
        TorchTrainer(_measure, train_loop_config={"mib": gang.mib, "iters": gang.iters, "sink": sink},
                     torch_config=TorchConfig(backend="nccl" if gang.use_gpu else "gloo"),
                     scaling_config=ScalingConfig(num_workers=gang.workers, use_gpu=gang.use_gpu,
                                                  resources_per_worker=resources),
                     run_config=RunConfig(name=name, storage_path=inner, storage_filesystem=fs)).fit()
        seen = ray.get(sink.get.remote())
    finally:
        ray.kill(sink)
        storage.rmtree(storage.join(root, name), storage_root)
    seconds = max(s for _, s, _ in seen.values())
    nbytes = gang.mib * 2**20 // 4 * 4
    algbw, busbw = bus_bandwidth(nbytes, seconds, gang.workers)
    return {"workers": gang.workers, "nodes": len({n for n, _, _ in seen.values()}),
            "backend": next(iter(seen.values()))[2], "mib": gang.mib, "seconds": seconds,
            "algbw_gbps": algbw, "busbw_gbps": busbw}


def line(result: dict, min_busbw: float = 0.0) -> Check:
    """The doctor's line for a result; FAIL below `min_busbw` GB/s (0: report only)."""
    text = (f"{result['workers']} workers on {result['nodes']} node(s) ({result['backend']}): "
            f"{result['mib']} MiB in {result['seconds'] * 1e3:.1f} ms, bus bandwidth {result['busbw_gbps']:.2f} GB/s")
    if min_busbw and result["busbw_gbps"] < min_busbw:
        return Check("all-reduce", False, f"{text}, below the {min_busbw:g} GB/s asked", FIX)
    return Check("all-reduce", True, text)


def check(address: str, jobs_api: bool, gang: Gang, storage_root: str, min_busbw: float = 0.0,
          timeout: float = 600.0) -> Check:
    """The doctor's all-reduce line for the cluster at `address`: through a probe job where it is a
    Jobs API (the driver on the cluster, with the nodes' own credentials), else in this process,
    which has joined the cluster."""
    if not jobs_api:
        return line(measure(gang, storage_root), min_busbw)
    import shlex

    from vitp.cluster import jobs  # lazy: ray

    entrypoint = shlex.join(["python", "-m", "vitp.cluster.allreduce", "--json", json.dumps(asdict(gang)),
                             "--storage", storage_root])
    logs = jobs.run_probe_job(address, entrypoint, timeout)
    found = [ln for ln in logs.splitlines() if ln.startswith(RESULT_TAG)]
    if not found:
        raise RuntimeError("the all-reduce probe job printed no result")
    return line(json.loads(found[-1][len(RESULT_TAG):]), min_busbw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitp.cluster.allreduce",
                                     description="All-reduce bus bandwidth across a Ray Train worker group.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="GPU workers (NCCL); default CPU workers (gloo)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--mib", type=int, default=0, help="buffer size (0: 256 on GPUs, 16 on CPUs)")
    parser.add_argument("--storage", default="", help="where the Train run's folder goes (default: a temp dir)")
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)  # the doctor's Gang, whole
    args = parser.parse_args(argv)
    import tempfile

    import ray

    gang = Gang(**json.loads(args.json)) if args.json else Gang(args.workers, args.gpu, args.cpus_per_worker,
                                                                 mib=args.mib)
    if gang.workers < 2:
        parser.error("--workers must be at least 2: an all-reduce on one worker moves nothing")
    from vitp.cluster import allreduce  # the importable module, so Ray pickles _measure by name

    from ray._private.services import canonicalize_bootstrap_address

    from vitp.cluster.ray_token import local_auth_env
    from vitp.net import no_telemetry

    no_telemetry()  # this driver and its Train workers (Ray Train imports MLflow)
    if canonicalize_bootstrap_address(None) is None:  # no cluster to join: ray.init starts one, its token ours
        os.environ.update(local_auth_env()[0])
    ray.init(logging_level="WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        result = allreduce.measure(gang, args.storage or tmp)
    print(RESULT_TAG + json.dumps(result), flush=True)
    print(line(result).line(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
