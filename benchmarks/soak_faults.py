"""The chaos soak's faults (benchmarks/soak.py): a seeded injector that, every 20-45 s, throws one of
them at the running world, logging each fault, its time and what it hit.

  kill_worker      SIGKILL one Ray Train worker process (pre-training's or a trial's)
  kill_node        SIGKILL a whole worker node (raylet and all, `cluster/local.sh kill-node`); a
                   new node joins 30-90 s later
  drain            preemption: the node drained with a 30 s deadline, killed at it; a new one later
  kill_trial_node  the node of a running Tune trial's Train worker, as kill_node (waiting up to 60 s
                   for a trial to train on a worker node)
  mlflow_down      the MLflow server stopped for 30-120 s, then started again on its port
  s3_cut           the S3 endpoint cut off (connections reset, new ones refused) for 10-60 s
  kill_driver      SIGKILL a workload's driver (pre-training or the sweep) and start it again with
                   the same command (the sweep with --resume)
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from typing import Callable

KINDS = ("kill_worker", "kill_node", "drain", "kill_trial_node", "mlflow_down", "s3_cut", "kill_driver")
DRAIN_DEADLINE_S = 30
INTERVAL_S = (20, 45)  # between faults: within the 20-60 s asked for, so 20 minutes throw 30 or more
REPLACE_AFTER_S = (30, 90)  # a lost node's replacement joins after this long (an autoscaler's)
TRIAL_WAIT_S = 60  # kill_trial_node waits this long for a trial on a worker node before passing its turn


class Injector:
    """Throws faults at `world` (benchmarks/soak.py World) from `seed`; `log` is a JSON-lines file."""

    def __init__(self, world, seed: int, log_path: str, say: Callable[[str], None] = print):
        self.world, self.rng, self.say = world, random.Random(seed), say
        self.log_path, self.faults, self._busy = log_path, [], set()
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def busy(self) -> set:
        """The faults still in effect (an outage, a cut, a node to replace)."""
        return set(self._busy)

    def _record(self, kind: str, detail: str, hit: bool) -> None:
        entry = {"t_s": round(time.monotonic() - self._t0, 1), "at": time.strftime("%H:%M:%S"), "kind": kind,
                 "hit": hit, "detail": detail}
        with self._lock:
            self.faults.append(entry)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        self.say(f"[soak] {entry['at']} +{entry['t_s']:.0f}s {kind}: {detail}")

    def _later(self, seconds: float, fn: Callable[[], None], busy: str | None = None) -> None:
        def run():
            try:
                fn()
            finally:
                self._busy.discard(busy)
        if busy:
            self._busy.add(busy)
        threading.Timer(seconds, run).start()

    def run(self, minutes: float, stop: threading.Event) -> None:
        """Every INTERVAL_S one fault, the kinds dealt in shuffled rounds (each kind once per round);
        a kind that finds nothing to hit gives its turn to the next one of the round."""
        deadline, deck = time.monotonic() + 60 * minutes, []
        while not stop.wait(self.rng.uniform(*INTERVAL_S)) and time.monotonic() < deadline:
            for _ in range(len(KINDS)):
                if not deck:
                    deck = list(KINDS)
                    self.rng.shuffle(deck)
                kind, before = deck.pop(), len(self.faults)
                try:
                    getattr(self, kind)()
                except Exception as e:  # noqa: BLE001 - a fault that could not be thrown is logged, not fatal
                    self._record(kind, f"could not be thrown: {type(e).__name__}: {str(e)[:200]}", False)
                if any(f["hit"] and f["kind"] == kind for f in self.faults[before:]):
                    break

    # ----------------------------------------------------------------------------- the faults
    def kill_worker(self) -> None:
        workers = self.world.train_workers()
        if not workers:
            return self._record("kill_worker", "no Train worker alive", False)
        w = self.rng.choice(workers)
        os.kill(w["pid"], signal.SIGKILL)
        self._record("kill_worker", f"RayTrainWorker pid {w['pid']} of {w['job']} on node {w['node']}", True)

    def _lose_node(self, kind: str, index: int, why: str) -> None:
        self.world.cluster.kill_node(index)
        self._record(kind, f"node {index} SIGKILLed ({why})", True)
        self._later(self.rng.uniform(*REPLACE_AFTER_S), self._replace, busy="replace")

    def _replace(self, tries: int = 4) -> None:
        """A new node, tried again 30 s after a failed start as an autoscaler would (the cluster
        lost every worker node in the fifth seed-1 run, whose replacements timed out starting)."""
        for attempt in range(1, tries + 1):
            try:
                index = self.world.cluster.add_node()
            except Exception as e:  # noqa: BLE001 - e.g. Ray's start-up timeout on a loaded machine: logged
                why = str(e).strip().splitlines()[-1][:200]
                self._record("node_joined", f"a new node did not join (try {attempt} of {tries}): {why}", False)
                time.sleep(30)
                continue
            return self._record("node_joined", f"node {index} joined", True)

    def _worker_node(self) -> int | None:
        alive = self.world.alive_worker_nodes()
        return self.rng.choice(alive) if alive else None

    def kill_node(self) -> None:
        index = self._worker_node()
        if index is None:
            return self._record("kill_node", "no worker node alive", False)
        self._lose_node("kill_node", index, "a lost VM")

    def drain(self) -> None:
        index = self._worker_node()
        if index is None:
            return self._record("drain", "no worker node alive", False)
        self.world.drain(index, DRAIN_DEADLINE_S)
        self._record("drain", f"node {index} drained for preemption, deadline {DRAIN_DEADLINE_S} s", True)
        self._later(DRAIN_DEADLINE_S, lambda: self._lose_node("drain_deadline", index, "at its deadline"))

    def kill_trial_node(self, wait_s: float = TRIAL_WAIT_S) -> None:
        """Waits up to `wait_s` for a trial to train on a worker node (trials there are short-lived:
        two seed-1 soaks found one only once each)."""
        start = time.monotonic()
        while True:
            nodes = sorted({w["node_index"] for w in self.world.train_workers() if w["job"] == "sweep"
                            and w["node_index"] not in (None, 0)})
            waited = time.monotonic() - start
            if nodes or waited >= wait_s:
                break
            time.sleep(3)
        if not nodes:
            return self._record("kill_trial_node", f"no trial trained on a worker node in {waited:.0f} s", False)
        self._lose_node("kill_trial_node", self.rng.choice(nodes),
                        f"a running trial's node, found after {waited:.0f} s")

    def mlflow_down(self) -> None:
        if "mlflow" in self._busy:
            return self._record("mlflow_down", "already down", False)
        seconds = self.rng.uniform(30, 120)
        self.world.mlflow_stop()
        self._record("mlflow_down", f"MLflow stopped for {seconds:.0f} s", True)
        self._later(seconds, lambda: (self.world.mlflow_start(), self._record("mlflow_up", "MLflow back", True)),
                    busy="mlflow")

    def s3_cut(self) -> None:
        if "s3" in self._busy:
            return self._record("s3_cut", "already cut", False)
        seconds = self.rng.uniform(10, 60)
        self.world.s3.proxy.cut()
        self._record("s3_cut", f"S3 cut off for {seconds:.0f} s", True)
        self._later(seconds, lambda: (self.world.s3.proxy.restore(), self._record("s3_up", "S3 back", True)),
                    busy="s3")

    def kill_driver(self) -> None:
        running = [w for w in self.world.workloads if w.alive()]
        if not running:
            return self._record("kill_driver", "no driver running", False)
        w = self.rng.choice(running)
        w.kill_and_relaunch()
        self._record("kill_driver", f"{w.name}'s driver SIGKILLed and started again", True)
