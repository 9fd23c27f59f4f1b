"""The env client: steps a few envs and asks the learner's ActorPool for their actions.

Connections are client-initiated only, so clients may sit behind NAT. A client waits up to
backend.connect_timeout_s for a learner that is not up (or has gone away) and reconnects when
it returns; it exits 0 when the learner says training has finished.

    python -m torchbeast_hydra backend=poly backend.role=env backend.address=HOST:PORT
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.frame_stacks import StackSender, stackable
from torchbeast_hydra.backends.poly.settings import ADDRESS_FILE_PREFIX
from torchbeast_hydra.env.native import GymnasiumEnvs
from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.env.spaces import EnvSpec

log = logging.getLogger(__name__)

# Exit codes of a client process. SERVER_FAILED: a local client's serving thread in the learner
# failed (a bug of ours, not the client's), so no one answers it any more.
FINISHED, REFUSED, UNREACHABLE, SERVER_FAILED = 0, 2, 3, 4

# A refusal the client cannot fix by retrying: wrong token, env or message.
PERMANENT = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
}


class ClientRefused(RuntimeError):
    pass


class LearnerFull(ConnectionError):
    """The learner has backend.max_clients already: worth retrying, as a lost connection is."""


class EnvsMaker(Protocol):
    """Makes a client's envs: an object with initial() and step(actions) returning the outputs
    [num_envs, ...] (env.vector.Environments' contract), and close()."""

    spec: EnvSpec

    def __call__(self, num_envs: int, seed: int): ...


@dataclass(frozen=True)
class Connection:
    """How a client reaches its learner."""

    address: str  # HOST:PORT, or file:PATH to read it from (written by the learner)
    token: str  # the shared secret the server checks
    connect_timeout_s: float  # how long to wait for a learner that is not up (yet)
    max_message_bytes: int  # the gRPC message limit both sides use (wire.max_message_bytes)
    # A stack of frames goes one frame at a time where it can (frame_stacks.py; backend.newest_frames).
    newest_frames: bool = True


class EnvClient:
    def __init__(self, env_cfg: EnvConfig, connection: Connection, num_envs: int, make_envs: EnvsMaker | None = None):
        self.env_cfg = env_cfg
        self.connection = connection
        self.address = connection.address
        self.connect_timeout_s = connection.connect_timeout_s
        self.num_envs = num_envs
        self.make_envs = make_envs or GymnasiumEnvs(env_cfg)
        self.spec = self.make_envs.spec
        self.envs = None  # made at the first welcome, seeded by the server
        self.outputs = None
        self.welcomed = False  # in the session now running (or last ended)
        self.stacks = None  # the session's frame_stacks.StackSender, where the frames are stacks

    def run(self) -> int:
        """Serves the learner until it finishes; returns the process exit code."""
        deadline = time.monotonic() + self.connect_timeout_s
        backoff = 0.1
        full_warned = False
        try:
            while True:
                try:
                    reason = self._session()
                    log.info("The learner ended this client's session (%s); exiting.", reason)
                    return FINISHED
                except ClientRefused as refused:
                    log.error("The learner at %s refused this client: %s", self.address, refused)
                    return REFUSED
                except ConnectionError as lost:
                    if isinstance(lost, LearnerFull) and not full_warned:
                        log.warning("The learner at %s is full (%s); retrying.", self.address, lost)
                        full_warned = True
                    if self.welcomed:  # a session that served the learner was lost: wait afresh for it, once
                        deadline = time.monotonic() + self.connect_timeout_s
                    if time.monotonic() > deadline:
                        log.error(
                            "No learner at %s for %.0f s (%s); giving up (backend.connect_timeout_s).",
                            self.address,
                            self.connect_timeout_s,
                            lost,
                        )
                        return UNREACHABLE
                    time.sleep(backoff)
                    backoff = min(2 * backoff, 2.0)
        finally:
            if self.envs is not None:
                self.envs.close()

    def _resolve_address(self) -> str:
        """HOST:PORT, or read from the learner's address file (re-read on every connect: a
        restarted learner may serve on another port)."""
        if not self.address.startswith(ADDRESS_FILE_PREFIX):
            return self.address
        path = Path(self.address[len(ADDRESS_FILE_PREFIX) :])
        try:
            return path.read_text().strip()
        except OSError:
            raise ConnectionError(f"no address file at {path} yet") from None

    def _session(self) -> str:
        """One connection: hello, then a step per answer until the learner ends it; returns why."""
        self.welcomed = False
        self.stacks = StackSender() if self.connection.newest_frames and stackable(self.spec) else None
        address = self._resolve_address()
        with grpc.insecure_channel(address, options=wire.channel_options(self.connection.max_message_bytes)) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=2.0)
            except grpc.FutureTimeoutError:
                raise ConnectionError("cannot connect") from None
            connect = channel.stream_stream(
                wire.CONNECT, request_serializer=None, response_deserializer=wire.ServerMessage.FromString
            )
            outgoing = queue.SimpleQueue()
            responses = connect(iter(outgoing.get, None), metadata=((wire.TOKEN_METADATA_KEY, self.connection.token),))
            try:
                outgoing.put(self._hello())
                return self._serve(responses, outgoing)
            except grpc.RpcError as error:
                if error.code() in PERMANENT:
                    raise ClientRefused(f"{error.code().name}: {error.details()}") from None
                lost = LearnerFull if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED else ConnectionError
                raise lost(f"{error.code().name}: {error.details()}") from None
            finally:
                outgoing.put(None)  # ends the request stream
                responses.cancel()

    def _serve(self, responses, outgoing) -> str:
        for message in responses:
            kind = message.WhichOneof("kind")
            if kind == "welcome":
                self.welcomed = True
                if self.envs is None:
                    self.envs = self.make_envs(self.num_envs, message.welcome.seed)
                    self.outputs = self.envs.initial()
                # After a reconnect the envs carry on where they were; the server starts fresh unrolls.
            elif kind == "actions":
                try:
                    actions = wire.decode_actions(message.actions, self.num_envs, self.spec.actions)
                except wire.WireError as error:
                    raise ClientRefused(f"the learner sent actions that do not fit this env's space: {error}") from None
                self.outputs = self.envs.step(actions)
            elif kind == "finished":
                return message.finished.reason or "training finished"
            else:
                raise ConnectionError("the learner sent an empty message")
            outgoing.put(wire.encode_step(self.outputs, self.spec.leaf_keys, self.stacks))
        raise ConnectionError("the learner closed the stream")

    def _hello(self) -> bytes:
        return wire.encode_hello(self.spec, self.env_cfg.id, self.num_envs)


def client_main(
    env_cfg: EnvConfig, connection: Connection, num_envs: int, ignore_sigint: bool, make_envs: EnvsMaker | None = None
) -> None:
    """A client process's entry point (spawned by role=all or role=env)."""
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # SLURM signals the whole job; the parent handles it
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][client][%(levelname)s] - %(message)s")
    client = EnvClient(env_cfg, connection, num_envs, make_envs)
    sys.exit(client.run())
