"""Stopping a run cleanly on a signal: Ctrl-C, SLURM's SIGTERM, submitit's SIGUSR2."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

# Signals that stop a run cleanly. SLURM sends SIGTERM when it cancels or requeues a job (then
# SIGKILL after KillWait, 30 s by default), and submitit asks for SIGUSR2 `signal_delay_s` before
# the time limit and on preemption.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


class StopOnSignals:
    """SIGINT/SIGTERM/SIGUSR2 ask the run to stop cleanly (checkpoint, no orphans); a second SIGINT aborts.

    The first stop signal is kept in `received`, with the handler it displaced (`previous`), so
    that once the checkpoint is written the caller can hand the signal to its owner: under
    submitit that is its job handler, which requeues the job (see launch.hand_over).
    """

    def __init__(self, stop: threading.Event):
        self.stop = stop
        self._previous = {}
        self.received: int | None = None
        self.previous = None  # the handler that owned `received` before us

    def __enter__(self):
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning(
            "Received %s: stopping after the current update and saving a checkpoint.", signal.Signals(signum).name
        )
        if self.received is None:
            self.received, self.previous = signum, self._previous[signum]
        self.stop.set()

    def adopt(self, signum: int) -> None:
        """Takes `signum` as received, as if it had come here: another rank of a data-parallel run got it,
        and this rank (0) is the one that hands it to its owner (launch.hand_over)."""
        if self.received is None:
            self.received, self.previous = signum, self._previous.get(signum)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
