"""The chaos soak: faults at random for `--minutes` while pre-training and a sweep run, then the
invariants checked: nothing lost, nothing duplicated. A benchmark (`make soak`), not part of CI.

Run (from the repository root):

  .venv/bin/python benchmarks/soak.py --minutes 20 --seed 1

The world, all on 127.0.0.1, started and stopped here in a temp dir: a three-node Ray cluster
(`cluster/local.sh`, nodes sharing no directory), S3 (moto) behind a TCP forwarder the soak can cut
(tests/s3server.py, tests/netproxy.py), and an MLflow server on a real PostgreSQL (Debian's
package) with its artifacts on S3. Running at once, each from its own driver on this machine: an
elastic pre-training run (`debug`, 1..3 workers, ZeRO-2, a checkpoint every 20 steps, every
sample recorded) and a fine-tuning sweep (`debug_finetune`, ASHA over a random search, 6 trials,
2 at a time); a workload that ends is followed by the next (a new run name) until the faults stop.
benchmarks/soak_faults.py throws a fault every 20-45 s (seeded: the same seed throws the same
sequence; what each hits depends on timing) and logs each to FAULTS.jsonl. When the workloads
have ended, the invariants are checked and printed as a table (soak-result.json beside it), the
tracking load run (benchmarks/tracking_load.py) goes against the same PostgreSQL-backed server,
and the table goes to benchmarks/RESULTS.md unless `--no-results`. Exit 1 if any invariant fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks", ROOT / "tests"):
    sys.path.insert(0, str(p))

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)
from soak_checks import Picks, check_all, table  # noqa: E402  (benchmarks/soak_checks.py)
from soak_faults import Injector  # noqa: E402

from vitp.net import free_port  # noqa: E402
from vitp.tracking.spool import SEND_LOG_ENV  # noqa: E402

# a trial's 2-CPU worker does not fit beside another and pre-training's on the head: one trial
# trains on a worker node, for kill_trial_node to find
PRETRAIN = ["parallel.num_workers=3", "parallel.min_workers=1", "parallel.cpus_per_worker=2",
            "parallel.zero_stage=2", "parallel.global_batch=24", "parallel.micro_batch=8", "parallel.grad_accum=1",
            "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=20", "train.keep_checkpoints=3",
            "train.record_samples=true", "train.max_failures=50", "optim.warmup_steps=5"]
SWEEP = ["parallel.num_workers=1", "parallel.cpus_per_worker=2", "train.steps=200", "train.eval_every=20",
         "train.log_every=1", "train.max_failures=50", "tune.num_samples=6", "tune.max_concurrent_trials=2",
         "tune.trial_retries=5"]


class Workload:
    """One driver on this machine (its output appended to `log`), relaunched by the same command."""

    def __init__(self, name: str, argv: list[str], resume_flag: list[str], env: dict[str, str], log: Path):
        self.name, self.argv, self.resume_flag, self.env, self.log = name, argv, resume_flag, env, log
        self.proc, self.launches, self.exits, self._seen = None, 0, [], None
        self.resumable = True  # False while the sweep has no state to resume (it was killed first)
        self.lock = threading.Lock()  # the injector's kill and the soak's relaunch, one at a time

    def start(self, resume: bool = False) -> None:
        argv = self.argv + (self.resume_flag if resume and self.resumable else [])
        with open(self.log, "a") as out:
            out.write(f"\n[soak] {time.strftime('%H:%M:%S')} launch {self.launches + 1}: {shlex.join(argv)}\n")
            out.flush()
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.launches += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_and_relaunch(self) -> None:
        with self.lock:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._seen = self.proc.pid
            self.exits.append("SIGKILL (the soak)")
            self.start(resume=True)

    def interrupt(self, grace_s: float = 180) -> None:
        """What a user's Ctrl-C does (the run ends KILLED, a sweep saves its state), SIGKILL after `grace_s`."""
        if not self.alive():
            return
        os.kill(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def poll(self) -> int | None:
        """The exit code once the current launch ended (each launch's recorded once), else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        if self._seen != self.proc.pid:
            self._seen = self.proc.pid
            self.exits.append(self.proc.returncode)
            tail = self.log.read_text()[-3000:]
            if "no sweep state at" in tail:  # killed before Tune saved anything: start it afresh
                self.resumable = False
            elif "continue it with --resume" in tail:
                self.resumable = True
        return self.proc.returncode


class World:
    """S3 behind a cuttable forwarder, PostgreSQL + MLflow (artifacts on S3), a three-node cluster."""

    def __init__(self, root: Path, nodes: int, cpus: int):
        from localcluster import LocalCluster  # tests/localcluster.py
        from postgres import PostgresServer  # tests/postgres.py
        from s3server import S3Server, s3_environment  # tests/s3server.py

        self.root = root
        os.environ.update(s3_environment(free_port()))  # before anything starts: every process inherits it
        self.sends = root / "sends"  # every acknowledged metric post, written down by its sender
        os.environ[SEND_LOG_ENV] = str(self.sends)
        self.s3 = S3Server(str(root))
        self.bucket = self.s3.bucket("soak")
        self.db = PostgresServer(Path(tempfile.mkdtemp(prefix="vitp-pg-", dir="/tmp")))
        password = os.urandom(12).hex()
        self.db.create("mlflow", password, "mlflow")
        self.backend = f"postgresql://mlflow:{quote(password, safe='')}@127.0.0.1:{self.db.port}/mlflow"
        self.mlflow_port, self.server = free_port(), None
        self.mlflow_start()
        self.store = f"{self.bucket}/vit"
        env = {"VITP_STORE": self.store, "MLFLOW_TRACKING_URI": self.uri}
        self.cluster = LocalCluster(root, workers=nodes - 1, num_cpus=cpus, auth=False, env=env)
        self.gcs = f"127.0.0.1:{self.cluster.port}"
        self.workloads: list[Workload] = []

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def mlflow_start(self) -> None:
        """The server on its port again (retried while the old one's port is not free yet)."""
        from vitp.tracking import TrackingError, start_server

        deadline = time.monotonic() + 300
        while True:
            try:
                self.server = start_server(self.backend, f"{self.bucket}/mlflow", port=self.mlflow_port,
                                           workers=2, timeout=180, log_path=self.root / "mlflow-server.log")
                return
            except TrackingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(3)

    def mlflow_stop(self) -> None:
        self.server.stop()

    def leaders(self) -> list[int]:
        return [int(p) for p in (self.cluster.state_dir / "pids").read_text().split()]

    def alive_worker_nodes(self) -> list[int]:
        out = []
        for i, pid in enumerate(self.leaders()):
            try:
                os.kill(pid, 0)
                out.append(i) if i else None
            except ProcessLookupError:
                pass
        return out

    def train_workers(self) -> list[dict]:
        """Alive Train workers: pid, node index (by the node's process group), and whose (pretrain, sweep)."""
        from ray.util.state import list_actors

        actors = list_actors(address=self.cluster.address, detail=True, limit=10_000,
                             filters=[("state", "=", "ALIVE")])
        sweep_jobs = {a.job_id for a in actors if a.class_name == "ImplicitFunc"}
        leaders, out = self.leaders(), []
        for a in actors:
            if a.class_name != "RayTrainWorker" or not a.pid:
                continue
            try:
                session = os.getsid(a.pid)
            except ProcessLookupError:
                continue
            out.append({"pid": a.pid, "node": a.node_id[:8], "node_index": leaders.index(session) if session in
                        leaders else None, "job": "sweep" if a.job_id in sweep_jobs else "pretrain"})
        return out

    def drain(self, index: int, deadline_s: float) -> None:
        """What `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds` sends."""
        import ray
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=self.gcs)
        marker = f"/node-{index}/"
        node_id = next(n.node_id.hex() for n in gcs.get_all_node_info().values()
                       if marker in n.raylet_socket_name and n.state == 0)  # 0: ALIVE
        accepted, refusal = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                           "soak: spot reclaim", int((time.time() + deadline_s) * 1000))
        if not accepted:
            raise RuntimeError(f"drain of node {index} refused: {refusal}")

    def stop(self) -> None:
        self.cluster.stop()
        if self.server:
            self.server.stop()
        self.db.stop()
        self.s3.stop()


def vitp(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitp.cli", *args]


def sets(items: list[str]) -> list[str]:
    return [f"--set={s}" for s in items]


def prepare(world: World, env: dict[str, str]) -> str:
    """Both workloads' shards in the bucket (preprocessed on the cluster); the work dir."""
    work = f"{world.store}/soak"
    for recipe in ("debug", "debug_finetune"):
        r = subprocess.run(vitp("preprocess", recipe, "--address", world.gcs, f"--set=work_dir={work}"), cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"vitp preprocess {recipe} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return work


def workload(world: World, env, work: str, kind: str, n: int, args) -> Workload:
    common = ["--address", world.gcs, "--tracking-uri", world.uri, f"--set=work_dir={work}"]
    if kind == "pretrain":
        argv = vitp("pretrain", "debug", *common, *sets(PRETRAIN + [f"train.steps={args.pretrain_steps}",
                                                                    f"tracking.run_name=soak-pretrain-{n}"]))
        return Workload(f"pretrain-{n}", argv, [], env, world.root / f"pretrain-{n}.log")
    argv = vitp("sweep", "debug_finetune", "--name", f"soak-sweep-{n}", *common, "--search", "random",
                "--scheduler", "asha", "--space", "optim.lr=loguniform(1e-3,0.3)",
                *sets(SWEEP + [f"tune.seed={args.seed + n}"]))
    return Workload(f"sweep-{n}", argv, ["--resume"], env, world.root / f"sweep-{n}.log")


def soak(args) -> dict:
    from localcluster import vitp_env

    root = Path(tempfile.mkdtemp(prefix=f"vitp-soak-{args.seed}-", dir="/tmp"))
    print(f"[soak] seed {args.seed}, {args.minutes} min of faults; everything under {root}", flush=True)
    world = World(root, args.nodes, args.cpus)
    try:
        env = vitp_env({"VITP_STORE": world.store, "MLFLOW_TRACKING_URI": world.uri})
        work = prepare(world, env)
        made = {"pretrain": 0, "sweep": 0}

        def next_of(kind):
            made[kind] += 1
            w = workload(world, env, work, kind, made[kind], args)
            world.workloads.append(w)
            w.start()
            return w

        current = {kind: next_of(kind) for kind in made}
        stop = threading.Event()
        injector = Injector(world, args.seed, str(root / "FAULTS.jsonl"))
        thread = threading.Thread(target=injector.run, args=(args.minutes, stop), daemon=True)
        t0, interrupted, picks = time.monotonic(), [], Picks()
        thread.start()
        while thread.is_alive() or any(w.alive() for w in current.values()):
            time.sleep(2)
            picks.scan([w.log for w in world.workloads])  # what each resume picked, read now
            for kind, w in list(current.items()):
                with w.lock:
                    rc = w.poll()
                    if rc is None or not thread.is_alive():
                        continue
                    if rc != 0:  # a user would run it again: the same command
                        w.start(resume=True)
                    else:
                        current[kind] = next_of(kind)
            if time.monotonic() - t0 > 60 * (args.minutes + args.settle_minutes):
                print("[soak] the workloads did not end in time: interrupting them (Ctrl-C)", flush=True)
                for w in current.values():
                    if w.alive():
                        interrupted.append(w.name)
                    w.interrupt()
                break
        stop.set()
        print(f"[soak] faults over after {(time.monotonic() - t0) / 60:.1f} min; checking the invariants", flush=True)
        while "mlflow" in injector.busy():  # an outage still running ends first
            time.sleep(1)
        if not world.server.alive():
            world.mlflow_start()
        result = check_all(world, work, env, interrupted, picks)
        result.update({"seed": args.seed, "minutes": args.minutes, "faults": injector.faults, "root": str(root),
                       "workloads": {w.name: {"launches": w.launches, "exits": w.exits} for w in world.workloads}})
        if args.load:
            from tracking_load import run as load_run  # benchmarks/tracking_load.py

            result["tracking_load"] = load_run(argparse.Namespace(
                tracking_uri=world.uri, ranks=8, trials=32, steps=args.load_steps, rate=5.0, workers=2,
                artifacts=None, rounds=5, round_steps=20))
        return result
    finally:
        world.stop()


def main() -> None:
    # started in the background (nohup ... &), SIGINT is ignored, and every driver would inherit that:
    # the soak's Ctrl-C and the interrupt it sends its drivers at the deadline need it back
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="how long faults are thrown")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=4, help="logical CPUs per node")
    # ~25 steps/min under faults on 2 cores: a run that spans the faults and ends within the settle
    ap.add_argument("--pretrain-steps", type=int, default=800)
    ap.add_argument("--settle-minutes", type=float, default=30.0, help="how long the workloads may run on after")
    ap.add_argument("--no-load", dest="load", action="store_false", help="skip the tracking load run")
    ap.add_argument("--load-steps", type=int, default=300)
    ap.add_argument("--json", help="write the result here too")
    add_results_args(ap)
    args = ap.parse_args()
    result = soak(args)
    text = table(result)
    print(text)
    out = Path(args.json or Path(result["root"]) / "soak-result.json")
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"[soak] result: {out}; faults: {result['root']}/FAULTS.jsonl; replay: "
          f"{shlex.join([sys.executable, 'benchmarks/soak.py', '--minutes', str(args.minutes), '--seed', str(args.seed)])}")
    append_result(args.results, f"Chaos soak, seed {args.seed} (`benchmarks/soak.py`)", text,
                  notes=f"{len([f for f in result['faults'] if f['hit']])} faults thrown in {args.minutes} min.")
    sys.exit(1 if any(c["violations"] for c in result["checks"]) else 0)


if __name__ == "__main__":
    main()
