"""The learner's intra-op threads, settled at run time by trying the cores once.

devices.learner_threads gives a bf16 CPU learner one thread where actor processes fill the cores:
its math then costs less than theirs, so it waits for them, and a second thread only takes their
cycles (Pong). Where the actors' side is cheap (NetHack's env clients mostly wait), the learner
stays the slower side and one thread leaves a core idle. Which case a run is in shows only while
it runs, so the learner checks: once warm, if its updates fill most of the wall clock, it tries
the cores for a window and keeps them only if the run steps faster (docs/performance.md#cpu-speed-options).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

WARMUP_UPDATES = 5  # queues filling, clients connecting, first-call allocations
WINDOW_S = 20.0  # each measurement; with the warm-up, a run has decided within its first minute
SETTLE_UPDATES = 3  # after a change of threads, before measuring again
# The share of the wall clock in updates above which the learner may be the slower side. An
# update's wall time includes its waits for a core, so where actors hold the cores (2-core Pong)
# this passes too, and the trial's measurement decides.
BUSY = 0.85
GAIN = 1.05  # the cores stay only if steps/s rise at least this much
# The cores' window ends early where they plainly lose: after EARLY_S, at under LOSING of the
# starting rate (2-core Pong: 2 threads step 12-30% slower; a whole window cost a run 2-6 s).
EARLY_S = 5.0
LOSING = 0.9


class ThreadTrial:
    """Holds the learner's thread count (`threads`); `observe` each logged update row.

    Phases: warm-up, then a window at the starting count. If the learner was busy for less than
    BUSY of it, the actors are the slower side and nothing changes. Otherwise a window at `cores`
    threads follows (cut short where they plainly lose), and the faster of the two stays. One
    decision a run, written to the log.
    """

    def __init__(self, threads: int, cores: int, clock=time.monotonic):
        self.threads = threads
        self.first = threads
        self.cores = cores
        self.clock = clock
        self.settled = threads >= cores  # nothing to try
        self._lock = threading.Lock()
        self._skip = WARMUP_UPDATES
        self._window = None  # (start time, start step, busy seconds so far)
        self._base = None  # steps/s at the starting count, once measured

    def observe(self, row: dict) -> None:
        """One update's logs.csv row (its step and update_ms). Called from any learner thread."""
        if self.settled:
            return
        with self._lock:
            if self._skip > 0:
                self._skip -= 1
                if self._skip == 0:
                    self._window = (self.clock(), row["step"], 0.0)
                return
            start, start_step, busy = self._window
            busy += row["update_ms"] / 1000
            elapsed = self.clock() - start
            self._window = (start, start_step, busy)
            if elapsed < EARLY_S:
                return
            rate = (row["step"] - start_step) / elapsed
            if elapsed >= WINDOW_S or self._losing(rate):
                self._decide(rate, busy / elapsed)

    def _losing(self, rate: float) -> bool:
        """On the cores' window (the starting rate known), stepping plainly slower than it."""
        return self._base is not None and rate < LOSING * self._base

    def _decide(self, rate: float, busy: float) -> None:
        if self._base is None:
            if busy < BUSY:
                self._settle(f"the learner waits for rollouts ({busy:.0%} busy): it keeps {threads(self.first)}")
                return
            self._base = rate
            log.info(
                "The learner is the slower side (%.0f%% busy, %.0f steps/s on %s): trying %d threads.",
                100 * busy, rate, threads(self.first), self.cores,
            )  # fmt: skip
            self.threads = self.cores
            self._skip = SETTLE_UPDATES
            return
        kept = rate >= GAIN * self._base
        self.threads = self.cores if kept else self.first
        self._settle(
            f"{self.cores} threads stepped at {rate:.0f}/s against {self._base:.0f} on {threads(self.first)}: "
            f"it keeps {threads(self.threads)}"
        )

    def _settle(self, outcome: str) -> None:
        self.settled = True
        log.info("Learner threads: %s.", outcome)


def threads(count: int) -> str:
    return f"{count} thread{'s' if count != 1 else ''}"
