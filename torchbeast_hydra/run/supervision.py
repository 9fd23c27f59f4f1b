"""The run's helper processes (mono actors, poly env clients and shards, the evaluator): how they
start, and how acting ones are watched and replaced when they die."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

# The helpers' entry points' modules: imported once, in the fork server (process_context).
PRELOAD = [
    "torchbeast_hydra.backends.mono.backend",
    "torchbeast_hydra.backends.poly.local",
    "torchbeast_hydra.backends.poly.client",
    "torchbeast_hydra.backends.poly.shards",
    "torchbeast_hydra.evaluation.periodic",
]


def process_context():
    """The multiprocessing context helpers start in: multiprocessing's fork server, where the
    platform has one (else spawn).

    A helper starts as clean as spawn's (no threads, locks or CUDA state of the learner's), but is
    forked from one server process that imported torch and this package once: it does not pay
    2-3 s of CPU for its imports, and shares those pages with its siblings. Like the modules, the
    environment variables are the server's: those of the moment it started (start_fork_server).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start_fork_server() -> None:
    """Starts the fork server now: its imports then overlap the learner's own start-up (its model,
    its optimiser's import of torch._dynamo) instead of holding up its first helper (~2 s)."""
    if process_context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


def parent_alive() -> bool:
    """In a helper: whether the process that started it still runs (a helper outliving its run stops)."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


class ActorProcesses:
    """Acting processes (mono actors, poly env clients), replaced when they die, up to a limit.

    start(index, number) starts the process for slot `index`; `number` counts every start of the
    run (replacements too), for actor_seed. on_exit(index) cleans up after a process that ended.
    An exit code in `final` is never replaced (the process finished its job); one in `fatal`
    stops the run with that message (a restart could not fix it).
    """

    def __init__(
        self,
        start: Callable[[int, int], Any],
        count: int,
        max_restarts: int,
        what: str = "Actor",
        on_exit: Callable[[int], None] = lambda index: None,
        final=(),
        fatal=None,
    ):
        self._start_process, self.count, self.max_restarts = start, count, max_restarts
        self.what, self.on_exit, self.final, self.fatal = what, on_exit, tuple(final), dict(fatal or {})
        self.processes = {}
        self.restarts = 0
        self.started = 0
        self.exit_codes = []  # of processes that ended for good

    def start(self) -> None:
        for index in range(self.count):
            self._start(index)

    def _start(self, index: int) -> None:
        self.processes[index] = self._start_process(index, self.started)
        self.started += 1

    def supervise(self, replace: bool, broken=()) -> None:
        """Replaces processes that died (or whose pipe broke) while `replace`; raises when they keep dying."""
        for index, process in list(self.processes.items()):
            if process.is_alive() and index not in broken:
                continue
            process.join(timeout=1.0)
            if process.is_alive():  # its pipe broke but it lingers: end it
                process.kill()
                process.join()
            del self.processes[index]
            self.on_exit(index)
            code = process.exitcode
            if not replace or code in self.final:
                self.exit_codes.append(code)
                continue
            if code in self.fatal:
                raise RuntimeError(self.fatal[code].format(index=index))
            self.restarts += 1
            log.error(
                "%s %d (pid %s) %s; starting a replacement (%d/%d).",
                self.what,
                index,
                process.pid,
                describe_exit(code),
                self.restarts,
                self.max_restarts,
            )
            if self.restarts > self.max_restarts:
                raise RuntimeError(
                    f"{self.what.lower()}s died {self.restarts} times (last exit code {code}); see the log "
                    "above for the cause. Raise backend.max_actor_restarts if crashes are expected."
                )
            self._start(index)

    @property
    def running(self) -> bool:
        return any(process.is_alive() for process in self.processes.values())

    def stop(self, timeout: float = 5.0) -> None:
        """Waits up to timeout for the processes to exit (after being told to), then ends them."""
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join()


def describe_exit(exitcode: int | None) -> str:
    """An actor's end in words; a SIGKILL is most often the kernel's out-of-memory killer."""
    text = f"died with exit code {exitcode}"
    if exitcode == -9:
        text += (
            " (SIGKILL: most often the kernel's out-of-memory killer, see `dmesg`; if memory is short, "
            "lower backend.num_actors, batch_size or unroll_length)"
        )
    return text
