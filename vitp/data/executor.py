"""Ray Data's streaming executor, paced so that a backpressured pipeline waits instead of spins.

Owns the one patch this package makes to Ray: a minimum duration for each scheduling round of
every StreamingExecutor in the process (Train workers call it). Must not change what a round does.
"""
from __future__ import annotations

import os
import time

# Ray 2.60's StreamingExecutor runs its scheduling loop on a thread of the process that iterates
# the dataset, with no pause between rounds: a round blocks in `ray.wait` only while tasks are
# running and not done. When the consumer is the slower side (training, normally), every task is
# finished or held back by backpressure, so the loop spins. In a Ray Train worker that thread
# takes a core and competes with the training loop for the GIL (py-spy: about half of the
# worker's samples were in it). A 2-worker debug run logging to an MLflow server trained at 6.1
# steps/s unpaced and 20.3 paced (benchmarks/RESULTS.md, "Ray Data's executor in a Train
# worker"). A round that returns sooner than ROUND_S sleeps the rest (releasing the GIL); rounds
# that wait on running tasks take longer and are not delayed; each round still dispatches every
# task it can.

ROUND_S = 0.05  # half the 0.1 s Ray Data itself waits on running tasks per round
ROUND_ENV = "VITP_RAY_DATA_ROUND_S"  # seconds; 0 leaves Ray Data's loop as it is


def pace_streaming_executor(round_s: float | None = None) -> bool:
    """Pace every StreamingExecutor of this process (idempotent); `round_s` defaults to
    $VITP_RAY_DATA_ROUND_S, else ROUND_S. False where it is 0 or this Ray Data has no scheduling
    round to pace (then it runs unchanged)."""
    if round_s is None:
        try:
            round_s = float(os.environ.get(ROUND_ENV) or ROUND_S)
        except ValueError:
            raise ValueError(f"{ROUND_ENV}={os.environ[ROUND_ENV]!r} is not a number of seconds "
                             "(0 leaves Ray Data's scheduling loop unpaced)") from None
    if round_s <= 0:
        return False
    try:
        from ray.data._internal.execution.streaming_executor import StreamingExecutor
    except ImportError:
        return False
    step = getattr(StreamingExecutor, "_scheduling_loop_step", None)
    if step is None:
        return False
    if getattr(step, "paced_round_s", None) is not None:
        step.paced_round_s = round_s
        return True

    def paced_step(self, topology):
        t0 = time.perf_counter()
        more = step(self, topology)
        left = paced_step.paced_round_s - (time.perf_counter() - t0)
        if more and left > 0:
            time.sleep(left)
        return more

    paced_step.paced_round_s = round_s
    paced_step.__wrapped__ = step
    StreamingExecutor._scheduling_loop_step = paced_step
    return True
