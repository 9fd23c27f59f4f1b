"""The ActorPool gRPC service: env clients stream their envs' outputs and receive actions.

Each client stream is one session, a coroutine on the process's serving loop (serving.py, grpc.aio):
the server checks the client's token and env, then for every Step evaluates the policy for its envs
in the shared dynamic batch (batcher.py), writes the rows of its unrolls (rollouts.py) and answers
with actions. LSTM state per env lives here.
A malformed message ends that client's stream with INVALID_ARGUMENT, as does a step that central
inference answers with non-finite outputs for some of the client's envs (the run stops only when
the model itself is broken: backend.py's CentralInference); the server and the other clients
carry on, and none of a refused client's unfinished unrolls reach the learner (a step enters
them only once answered with finite outputs). A client silent for longer than
client_idle_timeout_s (while the server waits for it) is dropped, so silent streams cannot hold
every slot; past max_clients streams, new ones are refused with a message naming the setting.
Unrolls a client that leaves (or is dropped for silence) had started are handed on as partial
rollouts. Clients on the learner's own machine reach the same sessions over shared memory instead
of a stream (local.py).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import logging
import threading
import time
import warnings
from concurrent import futures
from dataclasses import dataclass
from typing import Collection, Iterator

import grpc
import numpy as np
import torch

from torchbeast_hydra.backends.poly import serving, wire
from torchbeast_hydra.backends.poly.batcher import BatcherClosed, DynamicBatcher
from torchbeast_hydra.backends.poly.frame_stacks import StackReceiver, stackable
from torchbeast_hydra.backends.poly.rollouts import Emit, RolloutBuilder
from torchbeast_hydra.backends.poly.serving import make_server  # noqa: F401 (where callers look for it)
from torchbeast_hydra.env.layout import FLOAT32_LIMIT, rollout_specs
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.run.seeding import actor_seed

log = logging.getLogger(__name__)

POLICY_INPUTS = ("reward", "done", "last_action")  # and the observation's keys (EnvSpec.leaf_keys)
# Decoded steps are read-only views of the received bytes; torch warns that such tensors must not
# be written to, and nothing here writes to them.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)


class InferenceFailed(RuntimeError):
    """Central inference raised (a bug in the model, CUDA out of memory, ...): the stream ends as
    if the learner stopped, which it does (the batcher's owner hears of the error, batcher.py)."""


MAX_DETAILS = 2000  # characters of a refusal's text: it may quote what the client sent
# Refusals a well-behaved client meets and retries (a learner stopping, or full): not counted as bad clients.
WAIT_AND_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Refused(Exception):
    """A client the server will not serve; carries the gRPC status to end its stream with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        # One line, of bounded length: gRPC's trailers are small, and a client's strings are its own to choose.
        details = details.encode("unicode_escape").decode("ascii")
        if len(details) > MAX_DETAILS:
            details = details[: MAX_DETAILS - 3] + "..."
        super().__init__(details)
        self.code, self.details = code, details


@dataclass(frozen=True)
class ServerSettings:
    """Everything the ActorPool is configured with (but the token); from_config is where it comes from."""

    env_id: str  # named when a client with another env is refused
    unroll_length: int  # T: steps per unroll
    chunk_size: int  # rollouts handed on together at most (the learner's batch size)
    cut_at_reset: bool  # an env reset ends its unroll early (a partial, masked rollout)
    seed: int  # the run's seed: each connection's env seeds derive from it (seeding.actor_seed)
    max_envs_per_client: int
    max_clients: int  # concurrent streams; more are refused with a message naming the setting
    client_idle_timeout_s: float  # a stream the server waits on longer is dropped
    float_limit: float = FLOAT32_LIMIT  # float observations beyond it are refused (accel.float_limit)

    @classmethod
    def from_config(cls, cfg, float_limit: float = FLOAT32_LIMIT) -> ServerSettings:
        """float_limit: what the model computes in allows (accel.float_limit; Backend.float_limit)."""
        backend = cfg.backend
        return cls(
            env_id=cfg.env.id,
            unroll_length=cfg.unroll_length,
            chunk_size=cfg.batch_size,
            cut_at_reset=backend.cut_at_reset,
            seed=cfg.seed,
            max_envs_per_client=backend.max_envs_per_client,
            max_clients=backend.max_clients,
            client_idle_timeout_s=backend.client_idle_timeout_s,
            float_limit=float_limit,
        )


class ActorPool:
    """The service behind ActorPool/Connect; one instance serves every client."""

    def __init__(
        self,
        spec: EnvSpec,
        settings: ServerSettings,
        *,
        token: str,
        inference: DynamicBatcher,
        initial_state,
        emit: Emit,
        newer_weights=None,
        client_ids: Iterator[int] | None = None,
    ):
        """initial_state: num_envs -> tuple of [num_envs, ...] tensors; emit: takes finished rollouts;
        newer_weights(version): with backend.synchronous, waits for acting weights newer than version;
        client_ids: the ids (and so the env seeds) this pool gives clients (a shard's own: shards.py).
        Whatever inference raises (a NaN action, a model's bug, CUDA out of memory) reaches its
        owner through the batcher's on_error and stops the run; the streams end as the learner stops."""
        self.spec = spec
        self.settings = settings
        self.token = token.encode()
        self.inference = inference
        self.initial_state = initial_state
        self.emit = emit
        self.newer_weights = newer_weights
        # backend.synchronous: a stream's steps wait on the learner, so they run off the serving loop,
        # on a thread each stream can have at once (a shared pool smaller than that could hold up the
        # very steps whose unrolls the learner waits for).
        self.waiting_steps = (
            futures.ThreadPoolExecutor(settings.max_clients + serving.REFUSAL_HEADROOM, "actorpool-synchronous")
            if newer_weights is not None
            else None
        )
        self.stopping = threading.Event()
        self.finished = False  # on stopping: clients exit (True) or reconnect to a restarted learner
        self.finished_reason = "training finished"  # what exiting clients are told
        self._ids = client_ids if client_ids is not None else itertools.count()
        self._lock = threading.Lock()
        self.connected = 0
        self.rejected = 0  # streams ended for a bad token, env or message
        self.dropped = 0  # streams ended for silence
        self._streams = set()  # every open stream, hello or not: they hold the slots
        self._full_warned = False
        self._step_seconds = 0.0  # local clients' threads' CPU in their steps (decode, assembly), not inference's
        self._step_envs = 0
        self._loop_cpu = serving.loop_cpu_seconds()  # the serving loop's CPU: all of it serves the streams

    def handler(self) -> grpc.GenericRpcHandler:
        # Requests arrive as bytes and are parsed here, so garbage gets our status and message.
        # connect is a coroutine: grpc.aio's server (serving.py) runs it on the serving loop.
        method = grpc.stream_stream_rpc_method_handler(
            self.connect, request_deserializer=None, response_serializer=wire.ServerMessage.SerializeToString
        )
        return grpc.method_handlers_generic_handler(wire.SERVICE, {"Connect": method})

    async def connect(self, _requests, context) -> None:
        """One client's stream, a coroutine on the serving loop (serving.py); it reads the client's
        messages with context.read() (the request iterator goes unused)."""
        peer = context.peer()
        session = None
        stream = Stream(context, asyncio.current_task())
        try:
            self._authenticate(context)
            self._open(stream)
            hello = self._hello(await stream.receive())
            client_id, seed = self.new_client()
            session = self.open_session(hello.num_envs)
            stacks = StackReceiver() if stackable(self.spec) else None  # this stream's last frames
            log.info("Client %d connected from %s with %d envs.", client_id, peer, hello.num_envs)
            await stream.send(wire.ServerMessage(welcome=wire.Welcome(client_id=client_id, seed=seed)))
            while (raw := await stream.receive()) is not None:
                if self.stopping.is_set():
                    break
                # A stack of frames is built where it goes, in the unroll's next row: no copy after.
                frames_out = session.builder.row_ahead(wire.FRAME) if stacks is not None else None
                try:
                    step = self._step(raw, hello.num_envs, stacks, frames_out)
                    actions = await session.step_async(step, () if stacks is None else (wire.FRAME,))
                except (BatcherClosed, InferenceFailed):
                    break
                message = wire.ServerMessage()
                wire.encode_array(actions, message.actions)
                self.count_step(0.0, hello.num_envs)  # its CPU: the serving loop's (take_step_totals)
                await stream.send(message)
            else:
                return  # the client closed its stream
            if not self.finished:
                raise Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    "the learner stopped before the end of training; reconnect to it when it is restarted",
                )
            await stream.send(wire.ServerMessage(finished=wire.Finished(reason=self.finished_reason)))
        except Refused as refused:
            if refused.code not in WAIT_AND_RETRY:
                self.refuse(session, peer, refused.details)
            await context.abort(refused.code, refused.details)
        except asyncio.CancelledError:  # the client went away, or we dropped it for silence
            if not stream.dropped:
                raise
            await context.abort(grpc.StatusCode.CANCELLED, "no message for too long (backend.client_idle_timeout_s)")
        finally:
            self._close(stream)
            if stream.dropped:
                log.warning(
                    "Dropped client %s: no message for %g s (backend.client_idle_timeout_s).",
                    peer,
                    self.settings.client_idle_timeout_s,
                )
            if session is not None:
                self.close_session(session, client_id)

    # -- a client's session, whichever way it connects (a gRPC stream, or shared memory: local.py) --

    def new_client(self) -> tuple[int, int]:
        """A new client's id, and the seed its envs derive theirs from (seeding.actor_seed)."""
        client_id = next(self._ids)
        return client_id, actor_seed(self.settings.seed, client_id, self.settings.max_envs_per_client)

    def open_session(self, num_envs: int, buffers: list | None = None) -> "Session":
        """buffers: the client's rows in shared memory, which it writes itself (local.py)."""
        session = Session(self, num_envs, buffers)
        with self._lock:
            self.connected += 1
        return session

    def refuse(self, session: "Session | None", who, reason: str) -> None:
        """A client sent what we refuse: none of its unrolls may reach the learner."""
        with self._lock:
            self.rejected += 1
        if session is not None:
            session.discarded = True
        log.warning("Refused client %s: %s", who, reason)

    def close_session(self, session: "Session", client_id: int) -> None:
        """The client left: its unfinished unrolls go on as partial rollouts (or are discarded)."""
        partial = session.close()
        with self._lock:
            self.connected -= 1
        if not self.stopping.is_set():
            fate = "are discarded" if session.discarded else "go to the learner as partial rollouts"
            log.info("Client %d left; its %d unfinished unrolls %s.", client_id, partial, fate)

    def count_step(self, seconds: float, num_envs: int) -> None:
        with self._lock:
            self._step_seconds += seconds
            self._step_envs += num_envs

    def take_step_stats(self) -> float | None:
        """CPU microseconds of server work per env step since the last call (None without steps)."""
        seconds, envs = self.take_step_totals()
        return 1e6 * seconds / envs if envs else None

    def take_step_totals(self) -> tuple[float, int]:
        """(CPU seconds, env steps) of server work since the last call (a shard sums them: shards.py)."""
        loop_cpu = serving.loop_cpu_seconds()
        with self._lock:
            totals = self._step_seconds + loop_cpu - self._loop_cpu, self._step_envs
            self._step_seconds, self._step_envs, self._loop_cpu = 0.0, 0, loop_cpu
        return totals

    def _open(self, stream: "Stream") -> None:
        with self._lock:
            full = len(self._streams) >= self.settings.max_clients
            if not full:
                self._streams.add(stream)
        if full:
            if not self._full_warned:  # once: a waiting client retries every few seconds
                self._full_warned = True
                log.warning("A client found the learner full (backend.max_clients=%d).", self.settings.max_clients)
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the learner already serves backend.max_clients={self.settings.max_clients} client streams: "
                "raise backend.max_clients on the learner (silent clients are dropped after "
                f"backend.client_idle_timeout_s={self.settings.client_idle_timeout_s:g} s)",
            )

    def _close(self, stream: "Stream") -> None:
        with self._lock:
            self._streams.discard(stream)

    async def drop_idle_streams(self) -> None:
        """Cancels streams that have kept the server waiting too long; their coroutines then end.
        Runs on the serving loop (the server starts it). A stream is dropped only when found idle at
        two looks in a row: a message that came while the loop was held up (a loaded machine, the
        learner's queue full) is read between them, and that is no client's silence."""
        timeout = self.settings.client_idle_timeout_s
        interval = min(1.0, timeout / 4)
        last = resumed = time.monotonic()
        suspects = set()
        while not self.stopping.is_set():
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last > 2 * interval:  # the loop itself was held up: the time it lost is no one's silence
                resumed = now - interval
            last = now
            with self._lock:
                idle = {s for s in self._streams if not s.dropped and now - max(s.waiting_since, resumed) > timeout}
                dropping = idle & suspects
                self.dropped += len(dropping)
            suspects = idle - dropping
            for stream in dropping:
                stream.drop()

    def stop(self, finished: bool, reason: str = "training finished") -> None:
        """Ends every stream at its next step: clients exit when finished (told why), else they reconnect."""
        self.finished = finished
        self.finished_reason = reason
        self.stopping.set()

    def _authenticate(self, context) -> None:
        token = dict(context.invocation_metadata()).get(wire.TOKEN_METADATA_KEY, "")
        if not hmac.compare_digest(token.encode(), self.token):
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong token: start clients with the learner's TORCHBEAST_TOKEN",
            )

    def _hello(self, raw: bytes | None):
        if raw is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before its hello")
        try:
            message = wire.parse(wire.ClientMessage, raw)
        except wire.WireError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed hello: {error}") from None
        if message.WhichOneof("kind") != "hello":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a stream must start with a hello")
        hello, spec = message.hello, self.spec
        theirs = ([(a.name, a.dtype, list(a.shape)) for a in hello.obs], hello.action_space)
        leaves = [(leaf.key, leaf.dtype.name, list(leaf.shape)) for leaf in spec.leaves]
        ours = (leaves, wire.action_space_text(spec.actions))
        if theirs != ours:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the client's env {hello.env_id} (observations {_describe(theirs[0])}, "
                f"actions {theirs[1] or '?'}) does not match the learner's {self.settings.env_id} "
                f"({_describe(ours[0])}, actions {ours[1]}): start clients with the same env config",
            )
        if not 1 <= hello.num_envs <= self.settings.max_envs_per_client:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_envs={hello.num_envs} must be in [1, {self.settings.max_envs_per_client}] "
                "(backend.max_envs_per_client)",
            )
        return hello

    def _step(self, raw: bytes, num_envs: int, stacks: StackReceiver | None, frames_out: np.ndarray | None) -> dict:
        try:
            message = wire.parse(wire.ClientMessage, raw)
            return wire.decode_step(message, num_envs, self.spec, self.settings.float_limit, stacks, frames_out)
        except wire.WireError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed step: {error}") from None


def _describe(leaves: list) -> str:
    """Observation leaves as a log reads them: `uint8 [4, 84, 84]` for a frame, else `name: dtype [shape]` each."""
    if [name for name, _, _ in leaves] == [wire.FRAME]:
        return f"{leaves[0][1]} {leaves[0][2]}"
    return "{" + ", ".join(f"{name}: {dtype} {shape}" for name, dtype, shape in leaves) + "}" if leaves else "none"


class Stream:
    """One client stream, and since when the server has been waiting for its next message."""

    def __init__(self, context, task: asyncio.Task):
        self.context, self.task = context, task
        self.waiting_since = time.monotonic()  # the hello is awaited from the start
        self.dropped = False

    async def receive(self) -> bytes | None:
        """The next message, or None when the client closed the stream."""
        try:
            raw = await self.context.read()
        finally:
            self.waiting_since = float("inf")  # busy on our side: not the client's silence
        return None if raw is grpc.aio.EOF else raw

    async def send(self, message) -> None:
        """From here to its next message the stream waits on the client: to take our reply (gRPC's
        send waits while a client that stops reading has its window full), then to answer it."""
        self.waiting_since = time.monotonic()
        await self.context.write(message)

    def drop(self) -> None:
        self.dropped = True
        self.task.cancel()


class Session:
    """One client's envs: their unrolls, their LSTM state, and acting for them."""

    def __init__(self, pool: ActorPool, num_envs: int, buffers: list | None = None):
        self.inference = pool.inference
        self.core_state = pool.initial_state(num_envs)
        self.policy_inputs = (*pool.spec.leaf_keys, *POLICY_INPUTS)
        self.builder = RolloutBuilder(
            rollout_specs(pool.spec),
            num_envs,
            pool.settings.unroll_length,
            self.core_state,
            pool.settings.cut_at_reset,
            pool.emit,
            pool.settings.chunk_size,
            buffers,
        )
        self.discarded = False  # set when the client is refused: close() then hands nothing on
        self.newer_weights = pool.newer_weights
        self.waiting_steps = pool.waiting_steps

    def step(self, env_outputs: dict, written: Collection[str] = ()) -> np.ndarray:
        """Acts for the envs' outputs (from a thread: local.py's clients); returns their actions.
        written: the keys whose outputs are in the rows already (builder.add)."""
        inputs = self._inputs(env_outputs)
        arrays = self._answered(_inference(self.inference, inputs))
        # Only now, answered with finite outputs, does the step enter the unrolls (and maybe end one).
        ends = self.builder.t + 1 == self.builder.unroll_length
        self.builder.add(env_outputs, self.core_state, written)
        if ends and self.newer_weights is not None:
            # backend.synchronous: the finished unrolls are with the learner; the next one's first
            # action is chosen again, by weights newer than those that chose this one.
            self.newer_weights(int(arrays["policy_version"].max()))
            arrays = self._answered(_inference(self.inference, inputs))
        return self._acted(arrays)

    async def step_async(self, env_outputs: dict, written: Collection[str] = ()) -> np.ndarray:
        """step, from a coroutine on the serving loop: it awaits inference rather than waits for it."""
        if self.newer_weights is not None:  # backend.synchronous waits on the learner: off the loop
            step = functools.partial(self.step, env_outputs, written)
            return await asyncio.get_running_loop().run_in_executor(self.waiting_steps, step)
        inputs = self._inputs(env_outputs)
        arrays = self._answered(await _inference_async(self.inference, inputs))
        self.builder.add(env_outputs, self.core_state, written)
        return self._acted(arrays)

    def _inputs(self, env_outputs: dict) -> dict:
        inputs = {key: torch.from_numpy(env_outputs[key]) for key in self.policy_inputs}
        inputs.update({f"core_state_{i}": s for i, s in enumerate(self.core_state)})
        return inputs

    def _answered(self, outputs: dict) -> dict:
        """The policy's outputs as numpy arrays; a client whose envs get non-finite ones is refused."""
        arrays = {key: value.numpy() for key, value in outputs.items()}
        self._refuse_non_finite(arrays)
        return arrays

    def _acted(self, arrays: dict) -> np.ndarray:
        """Keeps the policy's outputs for the envs' next row, and their core state; their actions."""
        self.core_state = tuple(torch.from_numpy(arrays[f"core_state_{i}"]) for i in range(len(self.core_state)))
        self.builder.set_agent_outputs(arrays)
        return arrays["action"]

    def _refuse_non_finite(self, outputs: dict) -> None:
        finite = finite_rows(outputs)
        if finite.all():
            return
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"central inference gave non-finite outputs (NaN/inf) for envs {np.flatnonzero(~finite).tolist()} "
            "of this client, while it answers others: their observations are beyond what the model can take "
            "(the client is dropped, its unfinished unrolls discarded)",
        )

    def close(self) -> int:
        """Hands on the unfinished unrolls, or discards them; returns how many there were."""
        return self.builder.discard() if self.discarded else self.builder.flush()


def _inference(inference: DynamicBatcher, inputs: dict) -> dict:
    try:
        return inference(inputs)
    except BatcherClosed:
        raise
    except Exception as error:
        raise _failed(error) from error


async def _inference_async(inference: DynamicBatcher, inputs: dict) -> dict:
    try:
        return await inference.infer(inputs)
    except BatcherClosed:
        raise
    except Exception as error:
        raise _failed(error) from error


def _failed(error: Exception) -> InferenceFailed:
    return InferenceFailed(f"central inference failed: {type(error).__name__}: {error}")


def finite_rows(outputs: dict) -> np.ndarray:
    """[N] bool: the rows (envs) whose float outputs (policy parameters, baseline, Box action, core
    state; numpy arrays [N, ...]) are all finite."""
    rows = len(next(iter(outputs.values())))
    floats = [value for value in outputs.values() if value.dtype.kind == "f"]
    finite = np.ones(rows, bool)
    if all(np.isfinite(value).all() for value in floats):  # the common case: no per-row pass
        return finite
    for value in floats:
        finite &= np.isfinite(value.reshape(rows, -1)).all(axis=1)
    return finite
