"""PreemptionWatch (vitp/train/preempt.py) when Train's synchronization actor is gone: the worker
group is being torn down, so the rank waits to be stopped instead of printing a traceback."""
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
