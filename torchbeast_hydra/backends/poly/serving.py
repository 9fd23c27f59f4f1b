"""The ActorPool's gRPC server on one event loop (grpc.aio): one thread serves every stream.

A sync gRPC server runs each stream's handler on a pool thread, and each message crosses threads
on its way (gRPC's poller, the stream's handler, the batcher, and back), every crossing a GIL
hand-off, with as many threads contending for the GIL as there are streams. Here one thread, the
process's serving loop (every server of the process shares it), reads, checks and assembles every
stream's steps and writes their replies; a step leaves it only for central inference, whose answers
come back once a batch (batcher.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from torchbeast_hydra.backends.poly import wire

# Streams beyond max_clients that gRPC still hands to us, so we can refuse them with a reason.
REFUSAL_HEADROOM = 8

_loop: tuple | None = None  # (the process's serving loop, its thread), once started
_starting = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's serving loop, started on first use in a daemon thread of its own."""
    global _loop
    with _starting:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="actorpool-loop", daemon=True)
            thread.start()
            _loop = loop, thread
    return _loop[0]


def loop_thread() -> threading.Thread:
    event_loop()
    return _loop[1]


def loop_cpu_seconds() -> float:
    """CPU seconds the serving loop's thread has used (0 before it starts): all of it is the server's."""
    if _loop is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(_loop[1].ident))


def run(coroutine):
    """Runs a coroutine on the serving loop and returns its result (from any other thread)."""
    return asyncio.run_coroutine_threadsafe(coroutine, event_loop()).result()


class Server:
    """A grpc.aio server on the serving loop, with the sync server's start() and stop(grace).wait()."""

    def __init__(self, server: grpc.aio.Server, pool):
        self.server, self.pool = server, pool
        self.watchdog = None

    def start(self) -> None:
        run(self._start())

    async def _start(self) -> None:
        await self.server.start()
        self.watchdog = asyncio.get_running_loop().create_task(self.pool.drop_idle_streams())

    def stop(self, grace: float | None) -> "Stopping":
        """Stops serving, ending open streams after grace seconds; wait() on the result."""
        return Stopping(asyncio.run_coroutine_threadsafe(self._stop(grace), event_loop()))

    async def _stop(self, grace: float | None) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        await self.server.stop(grace)


class Stopping:
    def __init__(self, future):
        self.future = future

    def wait(self, timeout: float | None = None) -> bool:
        """True once stopped; False if timeout passed first (as the sync server's event)."""
        try:
            self.future.result(timeout)
        except TimeoutError:
            return False
        return True


def make_server(pool, address: str, max_message_bytes: int, reuse_port: bool = False) -> tuple[Server, int]:
    """A gRPC server for the pool (server.ActorPool) on address (HOST:PORT, port 0 for any); returns
    it unstarted, and its port. reuse_port: other processes may listen on the same port (server
    shards: shards.py).

    gRPC itself turns away streams beyond pool.settings.max_clients + REFUSAL_HEADROOM with a terse
    RESOURCE_EXHAUSTED; up to there the pool refuses them with a message that names the setting.
    """
    limit = pool.settings.max_clients + REFUSAL_HEADROOM
    options = wire.channel_options(max_message_bytes) + ([("grpc.so_reuseport", 1)] if reuse_port else [])

    async def create() -> tuple:
        server = grpc.aio.server(handlers=[pool.handler()], options=options, maximum_concurrent_rpcs=limit)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            await server.stop(None)
            raise
        if not port:
            await server.stop(None)
        return server, port

    server, port = run(create())
    return Server(server, pool), port
