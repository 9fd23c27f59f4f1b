"""The ActorPool server spread over processes (backend.server_shards > 1): each shard its own GIL.

A shard is a process running what a one-process learner runs for its clients: an ActorPool with
its gRPC server (every shard binds the one configured address with SO_REUSEPORT, so the kernel
spreads remote clients over them; the token and every wire check are the same code) and its share
of the local shared-memory clients (local.py), their sessions, checks and unroll assembly. Only
two things leave a shard, both through shared memory that the learner allocated, with a byte or
two on a pipe to say where:

- inference requests: the shard's own dynamic batch is written into its request tensors; the
  learner's CentralServer gathers the shards' batches into one pass of the acting policy on the
  learner's device and writes each shard's rows of the answer back (a few tensor ops per batch,
  whatever the number of envs);
- finished unrolls: written into one of the shard's rollout slots, which the learner's queue
  hands out as batches and gives back once copied.

LSTM state stays with each session, in its shard (it travels with the request). A shard that
dies is replaced (its remote clients reconnect, to any shard; its local clients, orphaned, exit
and the new shard starts others), up to backend.max_actor_restarts; one that stops for a reason
a restart cannot fix (a refused local client, a port it cannot bind) stops the run with one line.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import Callable

import torch

from torchbeast_hydra.backends.poly.batcher import BatcherClosed, DynamicBatcher
from torchbeast_hydra.env.layout import env_outputs
from torchbeast_hydra.run.devices import set_gil_switch_interval
from torchbeast_hydra.run.supervision import ActorProcesses, parent_alive, process_context

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often a side waiting on the other looks whether it is still there
OK, FAILED, CLOSED = b"\x00", b"\x01", b"\x02"  # an inference reply's first byte
RUNNING, FINISH, STOP = 0, 1, 2  # the learner's command to a shard: carry on, end (clients exit), end (clients wait)
SHARD_FAILED = 5  # a shard's exit code: it stopped for a reason a restart cannot fix (logged above)
# Shared statistics a shard keeps current: clients connected, CPU seconds and envs of its steps (totals), its port.
CONNECTED, STEP_SECONDS, STEP_ENVS, PORT, STATS = 0, 1, 2, 3, 4
STOPPED = "the learner was stopped; its run resumes when started again"  # what clients that wait are told
_SLOT = struct.Struct("<ii")  # a rollout slot's index and width


def auto_shards(cores: int) -> int:
    """backend.server_shards=0: one shard per 4 cores. A shard's server work (~30 us an env-step
    on this code) keeps well under a core at the rates a 4-core share of envs produces, and each
    shard takes a core from the envs it serves; below 8 cores one process is the better use."""
    return max(1, cores // 4)


@dataclass(frozen=True)
class ShardPlan:
    """What the learner's shards are given at start (all picklable: spawned with it)."""

    spec: object  # EnvSpec
    settings: object  # server.ServerSettings, max_clients being this shard's share
    token: str
    max_message_bytes: int
    max_batch_size: int
    batch_timeout_s: float
    initial_state: tuple  # one env's core state, [1, ...] tensors: a session's start
    local: object = None  # LocalClients, or None: no shared-memory clients
    max_restarts: int = 0  # for the shard's local clients
    gil_switch_interval_ms: float | None = None  # backend.gil_switch_interval_ms


@dataclass(frozen=True)
class LocalClients:
    """A shard's share of role=all's shared-memory env clients."""

    indices: tuple  # the run's client numbers this shard starts
    num_envs: int
    make_envs: object
    max_restarts: int


class ShardLink:
    """The shared memory between the learner and one shard (one incarnation: a replacement gets a
    fresh one, so nothing a dead shard left half-written is read)."""

    def __init__(self, ctx, request: dict, reply: dict, slots: list):
        """request/reply: key -> [rows, ...] tensor templates; slots: (rollouts, state) templates."""
        self.request, self.reply = _shared(request), _shared(reply)
        self.slots = [(_shared(rollouts), tuple(_shared(dict(enumerate(state))).values())) for rollouts, state in slots]
        self.stats = torch.zeros(STATS, dtype=torch.float64).share_memory_()
        self.counters = self.stats.numpy()  # the same memory, read without torch's per-read cost
        self.command = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.infer, self.infer_shard = ctx.Pipe()  # learner end, shard end
        self.rollouts, self.rollouts_shard = ctx.Pipe()

    def for_shard(self) -> dict:
        """What the shard process is spawned with (the learner keeps its own pipe ends)."""
        names = ("request", "reply", "slots", "stats", "command", "infer_shard", "rollouts_shard")
        return {name: getattr(self, name) for name in names}

    def close(self) -> None:
        for conn in (self.infer, self.rollouts, self.infer_shard, self.rollouts_shard):
            conn.close()


def _shared(templates: dict) -> dict:
    return {key: torch.zeros_like(t).share_memory_() for key, t in templates.items()}


# -- the shard's side: a process of its own --------------------------------------------------------


class RemoteInference:
    """The shard's dynamic batch, written into the shared request rows, answered by the learner."""

    def __init__(self, link: dict, stopping: threading.Event):
        self.request, self.reply = link["request"], link["reply"]
        self.conn = link["infer_shard"]
        self.stopping = stopping

    def assemble(self, requests: list) -> dict:
        """The batch, concatenated straight into the shared request rows (the batcher's one copy)."""
        n = 0
        for request in requests:
            rows = next(iter(request.values())).shape[0]
            for key, value in request.items():
                self.request[key][n : n + rows].copy_(value)
            n += rows
        return {key: value[:n] for key, value in self.request.items()}

    def __call__(self, inputs: dict) -> dict:
        n = next(iter(inputs.values())).shape[0]
        self.conn.send_bytes(struct.pack("<i", n))
        while not self.conn.poll(POLL_S):
            if not parent_alive() or self.stopping.is_set():
                raise BatcherClosed("the learner is gone")
        answer = self.conn.recv_bytes()
        if answer[:1] == CLOSED:
            raise BatcherClosed("the learner stopped")
        if answer[:1] != OK:
            raise RuntimeError(answer[1:].decode())
        return {key: value[:n].clone() for key, value in self.reply.items()}


class SharedEmit:
    """The shard's finished unrolls, into a free rollout slot; the learner gives slots back."""

    takes_views = True  # copies the rows it is given before it returns (rollouts.RolloutBuilder)

    def __init__(self, link: dict, stopping: threading.Event):
        self.slots, self.conn = link["slots"], link["rollouts_shard"]
        self.free = list(range(len(self.slots)))
        self.stopping = stopping
        self.lock = threading.Lock()  # sessions emit from their own threads

    def __call__(self, rollouts: dict, core_state: tuple) -> None:
        k = rollouts["mask"].shape[1]
        with self.lock:
            while not self.free:  # back-pressure: the learner's queue is full
                if self.stopping.is_set():
                    return
                if self.conn.poll(POLL_S):
                    self.free.append(_SLOT.unpack(self.conn.recv_bytes())[0])
            index = self.free.pop()
            slot, state = self.slots[index]
            for key, value in rollouts.items():
                slot[key][:, :k].copy_(value)
            for target, value in zip(state, core_state):
                target[:k].copy_(value)
            self.conn.send_bytes(_SLOT.pack(index, k))


def shard_main(index: int, ids: tuple, plan: ShardPlan, link: dict, address: str | None) -> None:
    """A shard process: an ActorPool serving its gRPC clients and local clients until told to stop.
    ids: (first, step) of the client ids it gives: every shard, and every shard's replacement, its own."""
    from torchbeast_hydra.backends.poly import local
    from torchbeast_hydra.backends.poly.client import FINISHED, REFUSED, SERVER_FAILED, UNREACHABLE
    from torchbeast_hydra.backends.poly.server import ActorPool
    from torchbeast_hydra.backends.poly.serving import make_server

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner stops us
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s][shard {index}][%(levelname)s] - %(message)s")
    torch.set_num_threads(1)
    set_gil_switch_interval(plan.gil_switch_interval_ms)
    _name_process(b"poly-shard")
    stopping = threading.Event()
    remote = RemoteInference(link, stopping)
    pool = None
    inference = DynamicBatcher(
        remote,
        plan.max_batch_size,
        plan.batch_timeout_s,
        producers=lambda: pool.connected,
        name="shard-inference",
        assemble=remote.assemble,
    )
    template = plan.initial_state
    pool = ActorPool(
        plan.spec,
        plan.settings,
        token=plan.token,
        inference=inference,
        initial_state=lambda n: tuple(s.expand(n, *s.shape[1:]).clone() for s in template),
        emit=SharedEmit(link, stopping),
        client_ids=itertools.count(*ids),
    )
    stats = link["stats"]
    server = clients = None
    try:
        if address is not None:
            try:
                server, port = make_server(pool, address, plan.max_message_bytes, reuse_port=True)
            except RuntimeError:
                port = 0
            if not port:
                log.error("Shard %d cannot listen on %s (backend.address).", index, address)
                sys.exit(SHARD_FAILED)
            server.start()
            stats[PORT] = port
        if plan.local is not None:
            ctx = process_context()
            spec = plan.local

            def start(slot: int, number: int):
                return local.start_client(pool, ctx, spec.num_envs, spec.make_envs, spec.indices[slot])

            clients = ActorProcesses(
                start,
                len(spec.indices),
                spec.max_restarts,
                what="Env client",
                final=(FINISHED, UNREACHABLE),
                fatal={
                    REFUSED: "the learner refused an env client; see its log above.",
                    SERVER_FAILED: "serving an env client failed; see the traceback above.",
                },
            )
            clients.start()
        while int(link["command"][0]) == RUNNING:
            if not parent_alive():
                return  # the learner is gone: nothing to serve
            time.sleep(0.05)
            seconds, envs = pool.take_step_totals()
            stats[CONNECTED] = pool.connected
            stats[STEP_SECONDS] += seconds
            stats[STEP_ENVS] += envs
            if clients is not None:
                try:
                    clients.supervise(replace=True)
                except RuntimeError as error:
                    log.error("Shard %d stops the run: %s", index, error)
                    sys.exit(SHARD_FAILED)
        finished = int(link["command"][0]) == FINISH
        stopping.set()  # sessions waiting on inference or on a free rollout slot end now
        pool.stop(finished, "training finished" if finished else STOPPED)
        deadline = time.monotonic() + 5.0
        while pool.connected and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stopping.set()
        inference.close()
        if server is not None:
            server.stop(grace=1.0).wait()
        if clients is not None:
            clients.stop(timeout=10.0)


def _name_process(name: bytes) -> None:
    """The process's name in ps and /proc/PID/comm (Linux), where its command line names only spawn."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


# -- the learner's side ----------------------------------------------------------------------------


class CentralServer:
    """Central inference for the shards: one batched pass over the batches they send, on the
    learner's device; each shard's rows of the answer go back into its reply tensors."""

    def __init__(self, fn: Callable[[dict], dict], max_batch_size: int, timeout_s: float, pin: bool, on_error):
        self.fn, self.max_batch_size, self.timeout_s, self.pin = fn, max_batch_size, timeout_s, pin
        self.on_error = on_error
        self.links = {}  # shard index -> ShardLink (the learner's view, replaced on restart)
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self._stats = []  # (batch size, seconds in fn, CPU seconds of the whole batch) since the last take_stats()

    def take_stats(self) -> list:
        with self.lock:
            stats, self._stats = self._stats, []
        return stats

    def serve(self, setup: Callable[[], None] | None = None) -> None:
        if setup is not None:
            setup()
        while not self.closed.is_set():
            cpu_started = time.thread_time()
            batch = self._gather()
            if batch:
                self._answer(batch, cpu_started)
        with self.lock:
            links = list(self.links.values())
        for link in links:  # a shard waiting for an answer is told we stopped
            with _ignore_broken():
                while link.infer.poll(0):
                    link.infer.recv_bytes()
                    link.infer.send_bytes(CLOSED)

    def _gather(self) -> list:
        """[(link, rows)]: the shards' waiting batches, waiting up to timeout_s after the first for
        every shard with clients to send one (none is waited on twice)."""
        pending, rows, deadline = {}, 0, None
        with self.lock:  # one look a batch: a shard added meanwhile sends again after this batch
            links = {link.infer: link for link in self.links.values()}
        while rows < self.max_batch_size:
            active = sum(1 for link in links.values() if link.counters[CONNECTED] > 0)
            if pending and len(pending) >= active:
                break
            wait = POLL_S if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                break
            for conn in connection.wait([c for c in links if links[c] not in pending], wait):
                try:
                    n = struct.unpack("<i", conn.recv_bytes())[0]
                except (EOFError, OSError):  # the shard died: its supervisor replaces it
                    del links[conn]
                    with self.lock:
                        self.links = {i: link for i, link in self.links.items() if link.infer is not conn}
                    continue
                pending[links[conn]] = n
                rows += n
            if deadline is None:
                if not pending:
                    return []
                deadline = time.monotonic() + self.timeout_s
        return list(pending.items())

    def _answer(self, batch: list, cpu_started: float) -> None:
        started = time.perf_counter()
        try:
            inputs = {
                key: _concat([link.request[key][:n] for link, n in batch], self.pin) for key in batch[0][0].request
            }
            outputs = self.fn(inputs)
        except Exception as error:  # every shard of the batch hears it; the owner stops the run
            text = f"{type(error).__name__}: {error}".encode()
            for link, _ in batch:
                with _ignore_broken():
                    link.infer.send_bytes(FAILED + text)
            self.on_error(error)
            return
        seconds, first = time.perf_counter() - started, 0
        for link, n in batch:
            for key, value in link.reply.items():
                value[:n].copy_(outputs[key][first : first + n])
            first += n
            with _ignore_broken():
                link.infer.send_bytes(OK)
        with self.lock:
            self._stats.append((first, seconds, time.thread_time() - cpu_started))


def _concat(tensors: list, pin: bool) -> torch.Tensor:
    """One copy, always: the central policy may keep its inputs (CentralInference.answered), and
    the shared rows are the shard's to overwrite."""
    size = sum(t.shape[0] for t in tensors)
    out = torch.empty((size, *tensors[0].shape[1:]), dtype=tensors[0].dtype, pin_memory=pin)
    return torch.cat(tensors, out=out)


class _ignore_broken:
    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        return kind is not None and issubclass(kind, (BrokenPipeError, EOFError, OSError))


class RolloutReceiver:
    """Hands the shards' finished unrolls (views of their slots) to the learner's queue; a slot goes
    back to its shard once the learner has copied it."""

    def __init__(self, queue, stopping: threading.Event):
        self.queue, self.stopping = queue, stopping
        self.links = {}
        self.lock = threading.Lock()

    def serve(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                links = {link.rollouts: link for link in self.links.values()}
            for conn in connection.wait(list(links), POLL_S):
                try:
                    index, k = _SLOT.unpack(conn.recv_bytes())
                except (EOFError, OSError):
                    with self.lock:
                        self.links = {i: link for i, link in self.links.items() if link.rollouts is not conn}
                    continue
                slot, state = links[conn].slots[index]
                rollouts = {key: value[:, :k] for key, value in slot.items()}
                release = _Release(conn, index)
                self.queue.put(rollouts, tuple(s[:k] for s in state), self.stopping, release=release)


@dataclass(frozen=True)
class _Release:
    conn: object
    index: int

    def __call__(self) -> None:
        with _ignore_broken():
            self.conn.send_bytes(_SLOT.pack(self.index, 0))


class ShardedServer:
    """K shard processes, central inference and the rollout receiver, as the learner runs them;
    offers what the backend reads of a one-process ActorPool (connected, stop, step statistics)."""

    def __init__(
        self,
        plan: ShardPlan,
        shards: int,
        address: str,
        central: Callable[[dict], dict],
        rollouts,
        *,
        local: LocalClients | None = None,
        pin: bool = False,
        on_error: Callable[[BaseException], None] = lambda error: None,
        max_restarts: int = 0,
        setup: Callable[[], None] | None = None,
    ):
        self.plan, self.shards, self.address = plan, shards, address
        self.ctx = process_context()
        self.rollouts = rollouts
        self.stopping = threading.Event()
        self.central = CentralServer(central, plan.max_batch_size, plan.batch_timeout_s, pin, on_error)
        self.receiver = RolloutReceiver(rollouts, self.stopping)
        self.local = local
        self.failure = None  # set when a shard stopped for a reason a restart cannot fix
        self.port = None
        self.templates = self._templates(central)
        self._step_totals = {}  # shard index -> (seconds, envs) already taken
        self.id_step = shards + max_restarts + 1  # shard start n gives client ids n, n + id_step, ...
        self.processes = ActorProcesses(
            self._start_shard,
            shards,
            max_restarts,
            what="Server shard",
            fatal={SHARD_FAILED: "server shard {index} stopped the run; see its log above."},
        )
        self.threads = [
            threading.Thread(target=self.central.serve, args=(setup,), name="central-inference", daemon=True),
            threading.Thread(target=self.receiver.serve, name="shard-rollouts", daemon=True),
        ]

    def _templates(self, central) -> tuple:
        """Row templates of the request, the reply (from one pass of the policy over a zero env
        step) and a rollout slot, sized for the largest batch a shard sends and the learner's chunks."""
        from torchbeast_hydra.env.layout import rollout_specs

        plan = self.plan
        rows = max(plan.max_batch_size, plan.settings.max_envs_per_client)
        one = {key: torch.from_numpy(value) for key, value in env_outputs(plan.spec, 1).items()}
        from torchbeast_hydra.backends.poly.server import POLICY_INPUTS

        request = {key: one[key] for key in (*plan.spec.leaf_keys, *POLICY_INPUTS)}
        request.update({f"core_state_{i}": s for i, s in enumerate(plan.initial_state)})
        reply = central({key: value.clone() for key, value in request.items()})
        widen = lambda t: torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)  # noqa: E731
        T, C = plan.settings.unroll_length, plan.settings.chunk_size
        specs = rollout_specs(plan.spec)
        slot = {key: torch.zeros((T + 1, C, *shape), dtype=dtype) for key, (shape, dtype) in specs.items()}
        state = tuple(torch.zeros((C, *s.shape[1:]), dtype=s.dtype) for s in plan.initial_state)
        # Enough slots for the learner's queue spread over the shards, and one being filled.
        count = math.ceil(self.rollouts.capacity / (C * self.shards)) + 2
        return (
            {key: widen(value) for key, value in request.items()},
            {key: widen(value) for key, value in reply.items()},
            [(slot, state)] * count,
        )

    @property
    def connected(self) -> int:
        with self.central.lock:
            return int(sum(link.counters[CONNECTED] for link in self.central.links.values()))

    def take_step_stats(self) -> float | None:
        """CPU microseconds of the shards' server work per env step since the last call."""
        seconds = envs = 0.0
        with self.central.lock:
            links = dict(self.central.links)
        for index, link in links.items():
            total = (float(link.counters[STEP_SECONDS]), float(link.counters[STEP_ENVS]))
            taken = self._step_totals.get(index, (0.0, 0.0))
            if taken[0] > total[0]:  # a fresh link: the shard was replaced
                taken = (0.0, 0.0)
            seconds += total[0] - taken[0]
            envs += total[1] - taken[1]
            self._step_totals[index] = total
        return 1e6 * seconds / envs if envs else None

    def start(self) -> int:
        """Starts the shards, all on one port (port 0: a free one, held meanwhile); returns the
        port once every shard listens."""
        for thread in self.threads:
            thread.start()
        host, _, port = self.address.rpartition(":")
        with _reserved_port(host, int(port)) as port:
            self.address, self.port = f"{host}:{port}", port
            self.processes.start()
            for index in range(self.shards):
                self._wait_listening(index)
        return self.port

    def _wait_listening(self, index: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.central.links[index].stats[PORT]:
            if not self.processes.processes[index].is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server shard {index} could not serve on {self.address}; see its log above")
            time.sleep(0.02)

    def _start_shard(self, index: int, number: int):
        request, reply, slots = self.templates
        link = ShardLink(self.ctx, request, reply, slots)
        local = None
        if self.local is not None:
            indices = tuple(i for i in self.local.indices if i % self.shards == index)
            if indices:
                local = LocalClients(indices, self.local.num_envs, self.local.make_envs, self.local.max_restarts)
        plan = _replace(self.plan, local=local)
        process = self.ctx.Process(
            target=shard_main,
            args=(index, (number, self.id_step), plan, link.for_shard(), self.address),
            name=f"server-shard-{index}",
        )
        process.start()
        link.infer_shard.close()  # the shard's ends are the shard's: a dead shard reads as EOF here
        link.rollouts_shard.close()
        with self.central.lock:
            old = self.central.links.get(index)
            self.central.links[index] = link
        with self.receiver.lock:
            self.receiver.links[index] = link
        if old is not None:
            log.info("Server shard %d restarted (pid %d).", index, process.pid)
        return process

    def supervise(self, replace: bool) -> None:
        self.processes.supervise(replace=replace)

    def stop(self, finished: bool) -> None:
        """Ends every shard's streams (clients exit when finished, else they wait to reconnect),
        then the shards, central inference and the receiver."""
        with self.central.lock:
            links = list(self.central.links.values())
        for link in links:
            link.command[0] = FINISH if finished else STOP
        deadline = time.monotonic() + 20
        for process in self.processes.processes.values():
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.stopping.set()
        self.central.closed.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout=5)


@contextlib.contextmanager
def _reserved_port(host: str, port: int):
    """Yields port, or for 0 a free port held by a bound (not listening) SO_REUSEPORT socket, so
    that no other program takes it while the shards, with SO_REUSEPORT too, bind it."""
    if port:
        yield port
        return
    family = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as reserved:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((host.strip("[]"), 0))
        yield reserved.getsockname()[1]


def _replace(plan: ShardPlan, **changes) -> ShardPlan:
    from dataclasses import replace

    return replace(plan, **changes)
