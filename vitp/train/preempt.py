"""Preemption notices on a Ray Train worker: checkpoint at the notice, again as late as is
safe before the node's deadline, then wait for Train to restart the run on what remains.

The loop calls `PreemptionWatch` after every step (LoopHooks.checkpoint_now) on every rank.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import ray.exceptions

from .step import all_reduce_max

NO_DEADLINE_S = 120.0  # Ray Train's own fallback window when a drain gives no deadline
SAFETY_S = 5.0  # besides twice the last checkpoint's and step's time
TEARDOWN_WAIT_S = 120.0  # how long a rank waits to be stopped once its worker group is going


class PreemptionWatch:
    """checkpoint_now hook: a checkpoint at the first notice (Train agrees on it across ranks), so
    one exists whatever happens next; then the last one when the deadline is within two checkpoints
    and two of the slowest steps since the notice (+ SAFETY_S; ranks agree by an all-reduce), after
    which `park` holds the ranks until Train tears the group down: steps after it would be lost.
    A node still there a minute past its deadline (a cancelled drain) lets training go on."""

    def __init__(self, device, say: Callable[[str], None], poll=None, teardown_wait_s: float = TEARDOWN_WAIT_S):
        import ray.train

        self.device, self.say = device, say
        self.poll = poll or ray.train.get_preemption_info
        self.teardown_wait_s = teardown_wait_s
        self.deadline: Optional[float] = None
        self.final = False
        self.checkpoint_s = 0.0  # the last checkpoint's time, set by the worker
        self.step_s, self._t = 0.0, time.time()
        self.slowest_s = 0.0  # the slowest step since the notice
        self._asked = False  # the last call asked for a checkpoint: the interval since includes it
        self.steps: list[int] = []  # steps checkpointed for a notice

    def __call__(self, step: int) -> bool:
        now = time.time()
        took = max(0.0, now - self._t - (self.checkpoint_s if self._asked else 0.0))
        self.step_s, self._t = max(0.5 * self.step_s, took), now
        if self.deadline is not None:
            self.slowest_s = max(self.slowest_s, took)
        self._asked = self._ask(step, now)
        return self._asked

    def _ask(self, step: int, now: float) -> bool:
        try:
            info = self.poll()
        except ray.exceptions.ActorDiedError:
            # The poll asks Train's synchronization actor, which goes with the worker group: the
            # group is being torn down (a Tune scheduler stopped the trial, the run restarts or
            # was aborted) and Train stops this worker within seconds. Waiting for that keeps a
            # traceback for a trial stopped on purpose off the console; a rank still running
            # after teardown_wait_s raises after all.
            time.sleep(self.teardown_wait_s)
            raise
        if info is None or self.final:
            return False
        if self.deadline is None:
            self.deadline = info.deadline_ms / 1000 if info.deadline_ms else now + NO_DEADLINE_S
            self.say(f"preemption notice for node(s) {', '.join(info.preempted_node_ids)} (ranks "
                     f"{info.preempted_ranks}), deadline in {self.deadline - now:.0f} s: "
                     f"checkpointing at step {step}")
            self.steps.append(step)
            return True
        need = 2 * (self.checkpoint_s + max(self.step_s, self.slowest_s)) + SAFETY_S
        late = all_reduce_max({"late": float(now + need >= self.deadline)}, self.device)["late"] > 0
        if late:
            self.final = True
            self.say(f"deadline in {self.deadline - now:.0f} s: last checkpoint at step {step}")
            self.steps.append(step)
        return late

    def park(self) -> None:
        """After the last checkpoint: wait for the teardown (or a minute past the deadline)."""
        if not self.final:
            return
        while time.time() < (self.deadline or 0) + 60:
            time.sleep(0.5)
        self.say("the preempted node outlived its deadline by a minute: training goes on")
        self.deadline, self.final, self.slowest_s = None, False, 0.0
