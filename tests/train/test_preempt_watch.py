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


@pytest.mark.parametrize("min_workers,user_value", [(1, None), (0, None), (1, "90")])
def test_an_elastic_run_gives_train_a_short_start_timeout_around_fit(monkeypatch, min_workers, user_value):
    """Elastic, the timeout is ours inside fit() and gone after; a fixed-size run gets Ray's default
    (unset); a value the user set is kept."""
    from vitp.recipes import resolve
    from vitp.train.trainer import _START_TIMEOUT_ENV, ELASTIC_START_TIMEOUT_S, _elastic_start_timeout

    monkeypatch.delenv(_START_TIMEOUT_ENV, raising=False)
    if user_value:
        monkeypatch.setenv(_START_TIMEOUT_ENV, user_value)
    inside = user_value or (str(ELASTIC_START_TIMEOUT_S) if min_workers else None)
    cfg = resolve("debug", [f"parallel.min_workers={min_workers}"], check_paths=False)
    with _elastic_start_timeout(cfg):
        assert os.environ.get(_START_TIMEOUT_ENV) == inside  # what Train passes on to its controller
    assert os.environ.get(_START_TIMEOUT_ENV) == user_value  # as it was before
