"""The learner's thread trial: one thread where the actors are the slower side, the cores where the
learner is and they pay, and the learner threads applying whatever it holds."""

import logging

import pytest
import torch

from torchbeast_hydra.backends.loop import Backend
from torchbeast_hydra.run import thread_trial
from torchbeast_hydra.run.thread_trial import ThreadTrial


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def feed(trial: ThreadTrial, clock: Clock, updates: int, steps_per_s: float, busy: float, step: int = 0) -> int:
    """Rows of 0.1 s apart, each a 0.1 * busy s update of 0.1 * steps_per_s steps."""
    for _ in range(updates):
        clock.now += 0.1
        step += round(0.1 * steps_per_s)
        trial.observe({"step": step, "update_ms": 100 * busy})
    return step


def window_updates() -> int:
    return round(thread_trial.WINDOW_S / 0.1) + 1


def test_a_learner_that_waits_for_rollouts_keeps_its_one_thread(caplog):
    clock = Clock()
    trial = ThreadTrial(1, 2, clock)
    with caplog.at_level(logging.INFO):
        feed(trial, clock, thread_trial.WARMUP_UPDATES + window_updates(), 1000, busy=0.7)
    assert trial.settled and trial.threads == 1
    assert "the learner waits for rollouts (70% busy): it keeps 1 thread" in caplog.text


@pytest.mark.parametrize(
    "rate_on_the_cores, kept",
    [(440, "2 threads stepped at 440/s against 380 on 1 thread: it keeps 2 threads"), (390, "it keeps 1 thread")],
)
def test_a_busy_learner_keeps_the_cores_only_if_they_step_faster(caplog, rate_on_the_cores, kept):
    clock = Clock()
    trial = ThreadTrial(1, 2, clock)
    with caplog.at_level(logging.INFO):
        step = feed(trial, clock, thread_trial.WARMUP_UPDATES + window_updates(), 380, busy=0.95)
        assert trial.threads == 2 and not trial.settled  # on trial
        step = feed(trial, clock, thread_trial.SETTLE_UPDATES + window_updates(), rate_on_the_cores, 0.95, step)
    assert trial.settled and kept in caplog.text
    assert trial.threads == (2 if rate_on_the_cores > 380 * thread_trial.GAIN else 1)
    threads = trial.threads
    feed(trial, clock, 2 * window_updates(), 5000, busy=1.0, step=step)  # decided once a run
    assert trial.threads == threads


def test_the_cores_window_ends_early_where_they_plainly_lose_and_not_where_they_are_close():
    clock = Clock()
    trial = ThreadTrial(1, 2, clock)
    step = feed(trial, clock, thread_trial.WARMUP_UPDATES + window_updates(), 1000, busy=0.95)
    early = round(thread_trial.EARLY_S / 0.1) + 1
    step = feed(trial, clock, thread_trial.SETTLE_UPDATES + early, 1000 * (thread_trial.LOSING - 0.1), 0.95, step)
    assert trial.settled and trial.threads == 1  # decided at EARLY_S, not WINDOW_S

    close = ThreadTrial(1, 2, clock)
    step = feed(close, clock, thread_trial.WARMUP_UPDATES + window_updates(), 1000, busy=0.95, step=step)
    feed(close, clock, thread_trial.SETTLE_UPDATES + early, 1000 * (thread_trial.LOSING + 0.05), 0.95, step)
    assert not close.settled and close.threads == 2  # still on trial: the full window decides


def test_a_learner_with_the_cores_or_as_configured_is_never_tried():
    clock = Clock()
    for trial in (ThreadTrial(2, 2, clock), ThreadTrial(1, 1, clock)):
        assert trial.settled
        feed(trial, clock, thread_trial.WARMUP_UPDATES + 3 * window_updates(), 100, busy=1.0)
        assert trial.threads == trial.first


class FakeRun:
    """What Backend._learn touches of a TrainingRun: one 10-step row per update."""

    device = torch.device("cpu")
    done = False

    def __init__(self):
        self.step = 0

    @staticmethod
    def batch_figures(batch):
        return 10, []

    def update(self, batch, core_state, observed, figures, versions):
        self.step += 10
        return {"step": self.step, "update_ms": 100.0}


class Publisher:
    def after_update(self):
        pass


def test_the_learner_threads_apply_what_the_trial_holds(monkeypatch):
    """Each learner thread sets its intra-op threads when the trial changes them, and only then."""
    backend = Backend.__new__(Backend)  # its learner loop alone, on a fake run
    backend.run, backend.publisher, backend._errors = FakeRun(), Publisher(), []
    batches = iter(range(thread_trial.WARMUP_UPDATES + 2))
    batch = {"policy_version": torch.zeros(3, 2, dtype=torch.int64), "mask": torch.ones(3, 2, dtype=torch.bool)}
    backend.next_batch = lambda: (batch, (), {}) if next(batches, None) is not None else None
    trial = ThreadTrial(1, 2, Clock())
    trial.observe = lambda row: setattr(trial, "threads", 2 if row["step"] >= 50 else 1)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    backend._learn(trial)
    assert calls == [1, 2] and not backend._errors
