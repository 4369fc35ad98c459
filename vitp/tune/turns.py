"""Turns to train, for sweeps whose trials must all exist while few train (HyperBand: a bracket is
cut once all its trials reach its rung, most of them waiting paused). Tune starts every trial;
each trial's driver waits for a turn from the sweep's Turns actor before it trains, lowest trial id
first; a turn is a lease its driver renews, so a driver Tune paused (killed) gives its turn back."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

import ray

LEASE_S = 20.0  # a turn not renewed for this long is free again (its driver is gone)
RENEW_S = 4.0  # how often a driver renews its turn while it trains, and asks for one while it waits
SETTLE_S = 2 * RENEW_S  # a trial asks this long before its first turn: the trials starting with it ask too


class TurnBook:
    """`size` turns; `ask(trial)` grants one to the lowest-numbered trial asking, once it has asked
    for SETTLE_S or has held a turn before (a paused trial resumed: the trials that started with it
    asked long since), True once held; `renew(trial)` keeps it, `give_back(trial)` frees it."""

    def __init__(self, size: int):
        self.size, self.held, self.asking, self.had = size, {}, {}, set()

    def _expire(self) -> None:
        now = time.monotonic()
        self.held = {t: at for t, at in self.held.items() if now - at < LEASE_S}
        self.asking = {t: (first, last) for t, (first, last) in self.asking.items() if now - last < 3 * RENEW_S}

    def ask(self, trial: str) -> bool:
        self._expire()
        if trial in self.held:
            return self.renew(trial)
        now = time.monotonic()
        first = self.asking.get(trial, (now, now))[0]
        self.asking[trial] = (first, now)
        if len(self.held) < self.size and trial == min(self.asking) and (now - first >= SETTLE_S or trial in self.had):
            del self.asking[trial]
            self.held[trial] = time.monotonic()
            self.had.add(trial)
            return True
        return False

    def renew(self, trial: str) -> bool:
        self._expire()
        if trial in self.held:
            self.held[trial] = time.monotonic()
            return True
        return False

    def give_back(self, trial: str) -> None:
        self.held.pop(trial, None)


Turns = ray.remote(num_cpus=0)(TurnBook)  # the sweep's: one actor, asked by every trial's driver


def actor_name(sweep: str, parent_run_id: str) -> str:
    return f"vitp-turns-{sweep}-{parent_run_id}"


def start_turns(sweep: str, parent_run_id: str, size: int):
    """The sweep's Turns actor (the sweep driver holds the handle: it lives as long as the driver)."""
    return Turns.options(name=actor_name(sweep, parent_run_id), get_if_exists=True).remote(size)


@contextlib.contextmanager
def turn(sweep: str, parent_run_id: str, trial: str, say: Callable[[str], None]) -> Iterator[None]:
    """Wait for a turn of the sweep's Turns, hold it (renewed) while the block runs, give it back."""
    turns = ray.get_actor(actor_name(sweep, parent_run_id))
    asked = time.monotonic()
    while not ray.get(turns.ask.remote(trial)):
        if asked and time.monotonic() - asked > SETTLE_S:  # said once, when others hold the turns
            say(f"trial {trial} waits for a turn to train (tune.max_concurrent_trials trials train at once)")
            asked = 0.0
        time.sleep(RENEW_S)
    done = threading.Event()

    def renew() -> None:
        while not done.wait(RENEW_S):
            try:
                ray.get(turns.renew.remote(trial))
            except Exception:  # noqa: BLE001 - the sweep driver is gone: so is this trial, soon
                return

    thread = threading.Thread(target=renew, name="vitp-turn-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        with contextlib.suppress(Exception):
            ray.get(turns.give_back.remote(trial))
