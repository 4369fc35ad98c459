"""pipeline/data/executor.py: the training stream, backpressured behind a slow consumer with the
object-store budget a Train worker's data has, makes Ray Data's scheduling loop spin (the Ray
behaviour the pacing works around; if an upgrade stops it, this test says the pacing can go)
and, paced, run at most one round per ROUND_S. Rounds are counted, not timed: unpaced they run
in the hundreds or thousands a second; paced they cannot exceed elapsed / ROUND_S."""
import time

import pytest

from pipeline.recipes import resolve

pytestmark = pytest.mark.ray


def _rounds_behind_a_slow_consumer(cfg, seconds: float) -> tuple[int, float]:
    """Scheduling rounds of rank 0's training stream while its consumer takes a batch every
    20 ms for `seconds`, after 40 batches (by then backpressure holds the pipeline)."""
    from ray.data import DataContext, ExecutionResources
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    from pipeline.data.ingest import build_train_dataset

    ctx = DataContext.get_current()
    step, limits, rounds = StreamingExecutor._scheduling_loop_step, ctx.execution_options.resource_limits, [0]

    def counted(self, topology):
        rounds[0] += 1
        return step(self, topology)

    StreamingExecutor._scheduling_loop_step = counted
    ctx.execution_options.resource_limits = ExecutionResources(object_store_memory=2e6)
    try:
        it = iter(build_train_dataset(cfg, rank=0, world=2).iter_batches(batch_size=16, batch_format="numpy"))
        for _ in range(40):
            next(it)
            time.sleep(0.02)
        start, t0 = rounds[0], time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            next(it)
            time.sleep(0.02)
        return rounds[0] - start, time.perf_counter() - t0
    finally:
        StreamingExecutor._scheduling_loop_step = step
        ctx.execution_options.resource_limits = limits


def test_backpressured_training_stream_spins_unless_paced(ray_session, debug_shards):
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    from pipeline.data.executor import ROUND_S, pace_streaming_executor

    cfg = resolve("debug", [f"data.shards={debug_shards}", "parallel.num_workers=2", "train.steps=2000"])
    original = StreamingExecutor._scheduling_loop_step
    spun, spun_s = _rounds_behind_a_slow_consumer(cfg, 2.0)
    try:
        assert pace_streaming_executor() and pace_streaming_executor()  # idempotent
        assert StreamingExecutor._scheduling_loop_step.__wrapped__ is original  # wrapped once
        paced, paced_s = _rounds_behind_a_slow_consumer(cfg, 2.0)
    finally:
        StreamingExecutor._scheduling_loop_step = original
    assert paced <= paced_s / ROUND_S + 2, (paced, paced_s)
    assert spun > 5 * spun_s / ROUND_S, (
        f"unpaced, Ray Data ran only {spun} scheduling rounds in {spun_s:.1f} s behind a slow "
        "consumer: if it no longer spins, pipeline/data/executor.py's pacing can go")
