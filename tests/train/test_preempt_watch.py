"""PreemptionWatch (vitp/train/preempt.py) when Train's synchronization actor is gone: the worker
group is being torn down, so the rank waits to be stopped instead of printing a traceback. And the
start timeout an elastic run gives Train around fit(), so it restarts on what a lost node left."""
import os

import pytest
from ray.exceptions import ActorDiedError

from vitp.train import preempt
from vitp.train.preempt import PreemptionWatch


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The waits PreemptionWatch asks for, recorded instead of slept."""
    out: list[float] = []
    monkeypatch.setattr(preempt.time, "sleep", out.append)
    return out


def _dead():
    raise ActorDiedError()


def test_a_torn_down_group_waits_then_raises_and_says_nothing(sleeps):
    said = []
    watch = PreemptionWatch("cpu", said.append, poll=_dead, teardown_wait_s=42)
    with pytest.raises(ActorDiedError):
        watch(1)
    assert sleeps == [42] and said == []  # waited to be stopped first, printed nothing


def test_any_other_poll_error_is_raised_at_once(sleeps):
    def broken():
        raise ValueError("not a teardown")

    watch = PreemptionWatch("cpu", print, poll=broken)
    with pytest.raises(ValueError, match="not a teardown"):
        watch(1)
    assert sleeps == []


def test_no_notice_is_no_checkpoint(sleeps):
    watch = PreemptionWatch("cpu", print, poll=lambda: None)
    assert watch(1) is False and watch.deadline is None and sleeps == []


@pytest.mark.parametrize("min_workers,placement_s,user_value,inside", [
    (1, 1800, None, "25"),  # elastic: ELASTIC_START_TIMEOUT_S, then it decides again
    (0, 1800, None, "1800"),  # fixed: one wait of parallel.placement_timeout_s
    (0, 0, None, None),  # 0 = for ever: Ray's default (60 s), retried for ever
    (1, 1800, "90", "90"),
    (0, 1800, "90", "90"),
])
def test_train_gets_the_start_timeout_of_the_run_around_fit(monkeypatch, min_workers, placement_s, user_value, inside):
    """Elastic, a short timeout; fixed-size, parallel.placement_timeout_s; each ours inside fit() and
    gone after. 0 leaves Ray's default (unset); a value the user set is kept."""
    from vitp.recipes import resolve
    from vitp.train.trainer import _START_TIMEOUT_ENV, ELASTIC_START_TIMEOUT_S, _start_timeout

    assert ELASTIC_START_TIMEOUT_S == 25
    monkeypatch.delenv(_START_TIMEOUT_ENV, raising=False)
    if user_value:
        monkeypatch.setenv(_START_TIMEOUT_ENV, user_value)
    cfg = resolve("debug", [f"parallel.min_workers={min_workers}", f"parallel.placement_timeout_s={placement_s}"],
                  check_paths=False)
    with _start_timeout(cfg):
        assert os.environ.get(_START_TIMEOUT_ENV) == inside  # what Train passes on to its controller
    assert os.environ.get(_START_TIMEOUT_ENV) == user_value  # as it was before


# ------------------------------------------------------------------- when the last checkpoint is taken
# A rank's steps replayed on a fake clock: the watch is called after every step, a checkpoint it
# asks for takes CKPT_S, and the last one must be complete before the node's deadline.

CKPT_S = 1.4


def _replay(monkeypatch, step_times: list[float], notice_after: int, window_s: float):
    """(steps checkpointed, when each was complete, the deadline) for steps taking `step_times`,
    a notice after step `notice_after` giving the node `window_s`."""
    from types import SimpleNamespace

    clock = [1000.0]
    monkeypatch.setattr(preempt.time, "time", lambda: clock[0])
    info = [None]
    watch = PreemptionWatch("cpu", lambda line: None, poll=lambda: info[0])
    done: list[tuple[int, float]] = []
    for step, took in enumerate(step_times, start=1):
        clock[0] += took
        if step == notice_after:
            info[0] = SimpleNamespace(deadline_ms=(clock[0] + window_s) * 1000, preempted_node_ids=["n"],
                                      preempted_ranks=[1])
        if watch(step):
            clock[0] += CKPT_S
            watch.checkpoint_s = CKPT_S
            done.append((step, clock[0]))
            if watch.final:
                break
    return done, (info[0].deadline_ms / 1000 if info[0] else None)


def test_steady_steps_checkpoint_at_the_notice_and_once_more_just_before_the_deadline(monkeypatch):
    step_s = 0.15
    done, deadline = _replay(monkeypatch, [step_s] * 400, notice_after=20, window_s=16)
    assert [s for s, _ in done][0] == 20 and len(done) == 2
    last_step, complete = done[-1]
    assert complete < deadline
    # not much earlier than it had to be: within the rule's margin (+ one step) of the deadline
    assert deadline - complete <= 2 * (CKPT_S + step_s) + preempt.SAFETY_S + step_s


def test_a_stall_after_the_notice_moves_the_last_checkpoint_earlier(monkeypatch):
    """A draining cluster: a step soon after the notice stalls for 7 s, and another stall comes
    later, wherever it falls. The last checkpoint is complete before the deadline in every case
    (a decayed step time would forget the first stall within a few fast steps)."""
    for fast in range(0, 300, 3):
        times = [0.1] * 25 + [7.0] + [0.1] * fast + [7.0] + [0.1] * 400
        done, deadline = _replay(monkeypatch, times, notice_after=20, window_s=40)
        assert len(done) == 2 and done[-1][1] < deadline, (fast, done, deadline)
