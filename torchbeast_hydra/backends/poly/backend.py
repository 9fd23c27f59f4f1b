"""The PolyBeast backend: the ActorPool server, central inference and local env clients feed the
shared training loop (backends.loop.Backend).

role=all   server + learner + backend.num_actors local env client processes
role=learner  server + learner; env clients connect from other machines
role=env   env client processes only (run_env_clients), connecting to backend.address
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import statistics
import sys
import threading
import time

import grpc
import torch
from omegaconf import OmegaConf

from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.backends.loop import Backend
from torchbeast_hydra.backends.poly import local, wire
from torchbeast_hydra.backends.poly.batcher import DynamicBatcher
from torchbeast_hydra.backends.poly.client import (
    FINISHED,
    REFUSED,
    SERVER_FAILED,
    UNREACHABLE,
    Connection,
    client_main,
)
from torchbeast_hydra.backends.poly.rollouts import RolloutQueue
from torchbeast_hydra.backends.poly.server import ActorPool, ServerSettings, finite_rows
from torchbeast_hydra.backends.poly.serving import make_server
from torchbeast_hydra.backends.poly.settings import LocalTransport, PolyRole, split_address
from torchbeast_hydra.backends.poly.shards import LocalClients, ShardedServer, ShardPlan, auto_shards
from torchbeast_hydra.env.engines import envs_maker
from torchbeast_hydra.env.spaces import probe_env
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning import accel
from torchbeast_hydra.logs.metrics import measured
from torchbeast_hydra.run.devices import set_gil_switch_interval, usable_cores
from torchbeast_hydra.run.signals import StopOnSignals
from torchbeast_hydra.run.supervision import ActorProcesses, process_context
from torchbeast_hydra.run.training_run import TrainingRun

log = logging.getLogger(__name__)

TOKEN_ENV_VAR = "TORCHBEAST_TOKEN"
ADDRESS_FILE = "actorpool_address"  # in the learner's run dir


def resolve_token(backend) -> str:
    """backend.token, else $TORCHBEAST_TOKEN; role=all (all on this machine) may make its own."""
    token = backend.token or os.environ.get(TOKEN_ENV_VAR)
    if token:
        return token
    if PolyRole(backend.role) is PolyRole.all:
        return secrets.token_urlsafe(24)
    raise ConfigError(
        f"backend.role={PolyRole(backend.role).value} needs the shared token clients present: "
        f"export {TOKEN_ENV_VAR}=<secret> on the learner and on every env machine "
        "(e.g. from `python -c 'import secrets; print(secrets.token_urlsafe())'`)."
    )


def client_envs(cfg):
    """(env config, envs maker) for a machine's env clients: each steps its envs on its share of
    the cores (the C++ engines' threads: env.engine)."""
    env_cfg = OmegaConf.to_object(cfg.env)
    threads = max(1, usable_cores() // cfg.backend.num_actors)
    return env_cfg, envs_maker(env_cfg, threads, vector_env=cfg.backend.vector_env)


def local_clients(cfg, address: str, token: str, max_message_bytes: int) -> ActorProcesses:
    """Env client processes on this machine speaking gRPC (role=env, and role=all with
    backend.local_transport=grpc), replaced when they die."""
    backend = cfg.backend
    ctx = process_context()
    env_cfg, make_envs = client_envs(cfg)
    connection = Connection(address, token, backend.connect_timeout_s, max_message_bytes, backend.newest_frames)
    kwargs = dict(env_cfg=env_cfg, connection=connection, num_envs=backend.envs_per_actor, make_envs=make_envs)
    kwargs.update(ignore_sigint=True)  # the parent handles Ctrl-C

    def start(index: int, number: int):  # env seeds come from the server (per connection)
        process = ctx.Process(target=client_main, kwargs=kwargs, name=f"env-client-{index}", daemon=True)
        process.start()
        return process

    return client_processes(start, backend)


def shared_memory_clients(cfg, pool: ActorPool) -> ActorProcesses:
    """role=all's env client processes over shared memory (local.py), replaced when they die."""
    ctx = process_context()
    _, make_envs = client_envs(cfg)
    num_envs = cfg.backend.envs_per_actor
    return client_processes(
        lambda index, number: local.start_client(pool, ctx, num_envs, make_envs, index), cfg.backend
    )


def client_processes(start, backend) -> ActorProcesses:
    return ActorProcesses(
        start,
        backend.num_actors,
        backend.max_actor_restarts,
        what="Env client",
        final=(FINISHED, UNREACHABLE),  # nothing a restart would fix
        fatal={
            REFUSED: "the learner refused env client {index}; see its log above.",
            SERVER_FAILED: "serving env client {index} failed in the learner; see the traceback above.",
        },
    )


def server_shards(backend) -> int:
    """backend.server_shards, or (0) from what the server serves: one process for role=all's own
    clients on shared memory, one shard per 4 cores (shards.auto_shards) for gRPC clients.
    backend.synchronous keeps the server in the learner's process (its sessions wait on the
    learner's weights there)."""
    if backend.synchronous:
        return 1
    if backend.server_shards:
        return backend.server_shards
    if PolyRole(backend.role) is not PolyRole.all:
        return auto_shards(usable_cores())
    if LocalTransport(backend.local_transport) is LocalTransport.shared_memory:
        # Local clients write their own unroll rows (~10-13 core-us an env-step of server work):
        # one process keeps up, and a shard's extra hop only delays replies. 16 cores, H200, 15
        # clients: 12,310 steps/s in one process, 9,876 with 2 shards, 8,521 with 4 (performance.md).
        return 1
    return min(auto_shards(usable_cores()), backend.num_actors)


class PolyBeast(Backend):
    """Rollouts assembled by the ActorPool server from its clients' steps, with central inference."""

    def __init__(self, cfg, run: TrainingRun):
        super().__init__(cfg, run, make_model(cfg.model, run.spec, initialise=False).to(run.device))
        backend = cfg.backend
        self.token = resolve_token(backend)
        self.device = run.device
        on_gpu = run.device.type == "cuda"
        self.rollouts = RolloutQueue(backend.learner_queue_size, pin=on_gpu)
        self.central = CentralInference(self.policy, self.weights_lock, self.publisher, run.device, self.bf16_acting)
        self.max_message_bytes = wire.max_message_bytes(run.spec, backend.max_envs_per_client)
        self.server = None
        self.clients = None
        self.address = None  # HOST:PORT once serving
        settings = ServerSettings.from_config(cfg, float_limit=self.float_limit)
        self.shards = server_shards(backend)
        self.pool = self.inference = self.sharded = None
        self.replaced_switch_interval = None  # Python's own, while start() sets the configured one
        if self.shards > 1:
            self.sharded = self._sharded_server(settings)
            return
        self.inference = DynamicBatcher(
            self.central,
            backend.max_batch_size,
            backend.batch_timeout_ms / 1000,
            producers=lambda: self.pool.connected,
            name="inference",
            setup=lambda: torch.set_num_threads(backend.inference_torch_threads),
            on_error=self._inference_failed,
            pin=on_gpu,
        )
        self.pool = ActorPool(
            run.spec,
            settings,
            token=self.token,
            inference=self.inference,
            initial_state=self._initial_state,
            emit=self._enqueue,
            newer_weights=self._newer_weights if backend.synchronous else None,
        )

    def _sharded_server(self, settings: ServerSettings) -> ShardedServer:
        """backend.server_shards > 1: the server's work in shard processes (shards.py)."""
        backend, shards = self.cfg.backend, self.shards
        plan = ShardPlan(
            spec=self.run.spec,
            settings=dataclasses.replace(settings, max_clients=-(-backend.max_clients // shards)),
            token=self.token,
            max_message_bytes=self.max_message_bytes,
            max_batch_size=backend.max_batch_size,
            batch_timeout_s=backend.batch_timeout_ms / 1000,
            initial_state=self._initial_state(1),
            gil_switch_interval_ms=backend.gil_switch_interval_ms,
        )
        local = None
        role, transport = PolyRole(backend.role), LocalTransport(backend.local_transport)
        if role is PolyRole.all and transport is LocalTransport.shared_memory:
            _, make_envs = client_envs(self.cfg)
            indices = tuple(range(backend.num_actors))
            local = LocalClients(indices, backend.envs_per_actor, make_envs, backend.max_actor_restarts)
        return ShardedServer(
            plan,
            shards,
            backend.address,
            self.central,
            self.rollouts,
            local=local,
            pin=self.device.type == "cuda",
            on_error=self._inference_failed,
            max_restarts=backend.max_actor_restarts,
            setup=lambda: torch.set_num_threads(backend.inference_torch_threads),
        )

    @property
    def serving(self):
        """What serves the clients: the ActorPool in this process, or the shards."""
        return self.sharded if self.sharded is not None else self.pool

    # -- acting ------------------------------------------------------------------------------

    def _initial_state(self, num_envs: int) -> tuple:
        """Fresh core state for num_envs envs, batch first: [num_envs, ...], on the CPU (the server's)."""
        return tuple(s.transpose(0, 1).contiguous() for s in self.policy.initial_state(num_envs, device="cpu"))

    def _inference_failed(self, error: BaseException) -> None:
        """Inference raised: the run stops with the error (its callers' streams end meanwhile)."""
        if not self.run.stop_requested.is_set():
            log.error("Central inference failed: %s: %s", type(error).__name__, error)
        self.fail(error)

    def _newer_weights(self, version: int) -> None:
        """backend.synchronous: a session waits at its unrolls' end for weights newer than version."""
        self.publisher.wait_for_newer(version, self.pool.stopping)

    def _enqueue(self, rollouts: dict, core_state: tuple, release=None) -> None:
        """Hands rollouts to the learner; waits while its queue is full (back-pressure). release: the
        rollouts are a session's rows, lent (RolloutBuilder), to be given back once taken."""
        self.rollouts.put(rollouts, core_state, self.pool.stopping, release, scarce=False)

    _enqueue.takes_buffers = True  # sessions lend their rows whole (rollouts.RolloutBuilder)

    # -- what Backend asks for ---------------------------------------------------------------

    def start(self) -> None:
        self.replaced_switch_interval = set_gil_switch_interval(self.cfg.backend.gil_switch_interval_ms)
        if self.sharded is not None:
            self._start_shards()
            if PolyRole(self.cfg.backend.role) is PolyRole.all and self.sharded.local is None:
                address = f"127.0.0.1:{self.sharded.port}"
                self.clients = local_clients(self.cfg, address, self.token, self.max_message_bytes)
                self.clients.start()
            return
        self.server, port = self._start_server()
        backend = self.cfg.backend
        if PolyRole(backend.role) is PolyRole.all:
            if LocalTransport(backend.local_transport) is LocalTransport.shared_memory:
                self.clients = shared_memory_clients(self.cfg, self.pool)
            else:
                self.clients = local_clients(self.cfg, f"127.0.0.1:{port}", self.token, self.max_message_bytes)
            self.clients.start()

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)
        if self.sharded is not None:
            self.sharded.supervise(replace=not self.run.stopping)
        if self.clients is not None:
            self.clients.supervise(replace=not self.run.stopping)

    def next_batch(self):
        got = self.rollouts.get_batch(self.cfg.batch_size, lambda: self.run.done)
        if got is None:
            return None
        batches = (self.inference or self.sharded.central).take_stats()
        sizes, seconds, cpu = zip(*batches) if batches else ((), (), ())
        observed = dict(
            learner_queue_size=self.rollouts.qsize(),
            gather_ms=round(1000 * self.rollouts.assembly_s, 3),
            server_us_per_step=measured(self.serving.take_step_stats()),
            inference_batch_size=round(statistics.fmean(sizes), 2) if sizes else "",
            inference_ms=round(1000 * statistics.fmean(seconds), 3) if seconds else "",
            inference_host_us_per_step=round(1e6 * sum(cpu) / sum(sizes), 2) if sizes else "",
            connected_clients=self.serving.connected,
        )
        return (*got, observed)

    def describe(self) -> dict:
        backend = self.cfg.backend
        gil = backend.gil_switch_interval_ms
        if self.clients is not None or (self.sharded is not None and self.sharded.local is not None):
            envs = backend.num_actors * backend.envs_per_actor
            acting = (
                f"{backend.num_actors} local env clients x {backend.envs_per_actor} envs = {envs} envs, "
                f"over {LocalTransport(backend.local_transport).value.replace('_', ' ')}"
            )
        else:
            acting = "env clients connect from other machines (backend.role=env)"
        return dict(
            backend=f"poly (role={PolyRole(backend.role).value}), ActorPool server on {self.address}"
            + (f" in {self.shards} shard processes" if self.sharded is not None else ""),
            acting=f"{acting}; central inference on {self.device.type}, up to {backend.max_batch_size} envs a batch"
            + (f"; GIL switch interval {gil:g} ms" if gil else ""),
        )

    def local_actor_processes(self) -> int:
        return self.cfg.backend.num_actors if PolyRole(self.cfg.backend.role) is PolyRole.all else 0

    def progress(self) -> str:
        return f" Clients {self.serving.connected}, learner queue {self.rollouts.qsize()}."

    def _start_shards(self) -> None:
        try:
            port = self.sharded.start()
        except RuntimeError as error:
            raise ConfigError(
                f"backend.address={self.cfg.backend.address}: {error}; is another learner using that port?"
            ) from None
        self._announce(port)

    def _start_server(self) -> tuple[grpc.Server, int]:
        backend = self.cfg.backend
        try:
            server, port = make_server(self.pool, backend.address, self.max_message_bytes)
        except RuntimeError as error:
            raise ConfigError(
                f"cannot listen on backend.address={backend.address} ({error}); is another learner using that port?"
            ) from None
        server.start()
        self._announce(port)
        return server, port

    def _announce(self, port: int) -> None:
        """Writes the address file clients may read, and says where clients connect."""
        host, _ = split_address(self.cfg.backend.address)
        # Each data-parallel rank serves its own env clients: rank r > 0 names its file .rankR.
        name = ADDRESS_FILE if self.run.is_main else f"{ADDRESS_FILE}.rank{self.run.ranks.rank}"
        write_address_file(self.run.run_dir / name, host, port)
        self.address = f"{host}:{port}"
        log.info(
            "ActorPool listening on %s:%d (%s). Env clients: backend=poly backend.role=env "
            "backend.address=HOST:%d with the same %s.",
            host,
            port,
            "loopback only" if host in ("127.0.0.1", "localhost", "[::1]") else "reachable from other machines",
            port,
            TOKEN_ENV_VAR,
        )

    def shut_down(self) -> None:
        """Ends the clients' streams at their next step, then stops serving. Remote clients exit
        only if training is complete; otherwise they wait to reconnect to a restarted learner."""
        complete = self.run.complete
        if self.replaced_switch_interval is not None:  # a multirun's next job starts with Python's own
            sys.setswitchinterval(self.replaced_switch_interval)
        if self.sharded is not None:
            self.sharded.stop(finished=complete or PolyRole(self.cfg.backend.role) is PolyRole.all)
            if self.clients is not None:
                self.clients.stop(timeout=10.0)
            return
        reason = "training finished" if complete else "the learner was stopped; its run resumes when started again"
        self.pool.stop(finished=complete or self.clients is not None, reason=reason)
        deadline = time.monotonic() + 5.0
        while self.pool.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        self.inference.close()
        if self.server is not None:
            self.server.stop(grace=1.0).wait()
        if self.clients is not None:
            self.clients.stop(timeout=10.0)


class BrokenModel(RuntimeError):
    """The acting policy is broken (non-finite weights, or non-finite outputs whatever the envs): the run stops."""


class CentralInference:
    """The acting policy evaluated on a dynamic batch of envs from every client (the batcher's fn).

    Envs (rows) whose outputs are not finite get placeholder actions, and their clients' sessions
    drop them (server.py): one client's extreme observations must not end training for the others.
    A batch fails, and with it the run, only when the model itself is broken: its weights (or
    running statistics) are not finite, or its outputs are not finite for every env of the batch
    and for a recent batch it answered in full too (a lone client's batch says nothing of the model).
    """

    # How often a batch answered in full is copied aside for that test. A copy, since a batch may be
    # views of a local client's shared memory, which its next step overwrites; not every batch's, so
    # that no step pays for it.
    KEEP_ANSWERED_S = 1.0

    def __init__(self, policy, weights_lock, publisher, device: torch.device, bf16: bool = False):
        self.policy = policy
        self.bf16 = bf16  # the policy's pass under bf16 autocast (accel.acts_in_bf16)
        self.weights_lock = weights_lock
        self.publisher = publisher
        # On a GPU, inference has its own stream: it never queues behind the learner's update.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device
        self.answered = None  # a recent batch whose outputs were finite for every env (a copy)
        self.answered_at = -float("inf")

    def __call__(self, inputs: dict) -> dict:
        """inputs [N, ...] -> actions and policy outputs [N, ...], on the CPU."""
        result = self._forward(inputs)
        finite = finite_rows({key: value.numpy() for key, value in result.items()})
        if finite.all():
            self._keep_answered(inputs)
        else:
            self._stop_if_broken(finite)
        return result

    def _keep_answered(self, inputs: dict) -> None:
        now = time.monotonic()
        if now - self.answered_at >= self.KEEP_ANSWERED_S:
            self.answered = {key: value.clone() for key, value in inputs.items()}
            self.answered_at = now

    def _stop_if_broken(self, finite) -> None:
        broken = self._non_finite_weights()
        if broken:
            names = ", ".join(broken[:4]) + (", ..." if len(broken) > 4 else "")
            raise BrokenModel(f"central inference: the model's weights are not finite ({names}); no client caused it")
        if finite.any() or self.answered is None:
            return
        again = self._forward(self.answered)
        if not finite_rows({key: value.numpy() for key, value in again.items()}).all():
            raise BrokenModel(
                f"central inference: the model's outputs are not finite for any of a batch's {len(finite)} envs, "
                "nor now for a recent batch it answered in full; its weights are finite but must overflow float32"
            )

    def _non_finite_weights(self) -> list:
        """The names of the policy's parameters and buffers holding NaN or inf, read as inference reads them."""
        with self.weights_lock, self._on_stream():
            if self.stream is not None:
                self.publisher.wait_for_weights(self.stream)
            state = self.policy.state_dict()
            return [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]

    def _version(self) -> int:
        """The acting weights' version (WeightPublisher.version; 0 without a publisher: a fixed policy)."""
        return 0 if self.publisher is None else int(self.publisher.version)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _act(self, env_outputs: dict, core_state: tuple):
        """The policy's pass, with actions sampled from its parameters made finite: a NaN row would make
        a Box sample raise for the whole batch (its client is dropped instead; its action is never sent)."""
        with accel.autocast(self.bf16, self.device):
            outputs, core_state = self.policy(env_outputs, core_state, action="none")
        params = torch.nan_to_num(outputs["policy_logits"], nan=0.0, posinf=0.0, neginf=0.0)
        T, B = params.shape[:2]
        outputs["action"] = self.policy.dist.sample(params).view(T, B, *self.policy.actions.step_shape)
        return outputs, core_state

    def _forward(self, inputs: dict) -> dict:
        if self.stream is not None:
            return self._forward_on_gpu(inputs)
        states = sorted(key for key in inputs if key.startswith("core_state_"))
        env_outputs = {key: inputs[key].unsqueeze(0) for key in inputs if key not in states}
        core_state = tuple(inputs[key].transpose(0, 1) for key in states)  # the model makes it contiguous
        with torch.no_grad(), self.weights_lock:
            version = self._version()
            outputs, core_state = self._act(env_outputs, core_state)
        result = {key: value[0] for key, value in outputs.items()}
        result["policy_version"] = torch.full(result["baseline"].shape, version, dtype=torch.int64)
        for i, state in enumerate(core_state):
            result[f"core_state_{i}"] = state.transpose(0, 1)
        return result

    def _forward_on_gpu(self, inputs: dict) -> dict:
        """As _forward, on inference's own stream: inputs come pinned (the batcher assembles them so),
        copies both ways are asynchronous, and only this stream is waited for."""
        device, stream = self.device, self.stream
        states = sorted(key for key in inputs if key.startswith("core_state_"))
        with torch.cuda.stream(stream), torch.no_grad():
            moved = {key: value.to(device, non_blocking=True) for key, value in inputs.items()}
            env_outputs = {key: moved[key].unsqueeze(0) for key in moved if key not in states}
            core_state = tuple(moved[key].transpose(0, 1) for key in states)
            with self.weights_lock:  # held to queue the work; the publisher orders its copy by events
                self.publisher.wait_for_weights(stream)
                version = self._version()  # the weights this stream reads, once the copy is done
                outputs, core_state = self._act(env_outputs, core_state)
                done = torch.cuda.Event()
                done.record(stream)
                self.publisher.inference_done = done
            # Non-blocking copies to the host land in pinned memory; the synchronize below waits for them.
            result = {key: value[0].to("cpu", non_blocking=True) for key, value in outputs.items()}
            for i, state in enumerate(core_state):
                result[f"core_state_{i}"] = state.transpose(0, 1).to("cpu", non_blocking=True)
        stream.synchronize()
        result["policy_version"] = torch.full(result["baseline"].shape, version, dtype=torch.int64)
        return result


def write_address_file(path, host: str, port: int) -> None:
    """Where clients can reach this learner (atomically): for backend.address=file:PATH."""
    if host in ("0.0.0.0", "[::]", "::"):
        host = socket.getfqdn()  # listening on every interface: advertise this machine's name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{host}:{port}\n")
    os.replace(tmp, path)


def train(cfg, run: TrainingRun) -> None:
    PolyBeast(cfg, run).train()


def run_env_clients(cfg) -> int:
    """role=env: start backend.num_actors client processes and wait for them; returns an exit code."""
    backend = cfg.backend
    token = resolve_token(backend)
    spec = probe_env(cfg.env)
    max_bytes = wire.max_message_bytes(spec, backend.max_envs_per_client)
    clients = local_clients(cfg, backend.address, token, max_bytes)
    stop = threading.Event()
    log.info(
        "Starting %d env clients (%d envs each) for the learner at %s.",
        backend.num_actors,
        backend.envs_per_actor,
        backend.address,
    )
    with StopOnSignals(stop):
        clients.start()
        try:
            while clients.running and not stop.is_set():
                time.sleep(0.2)
                clients.supervise(replace=not stop.is_set())
        finally:
            for process in clients.processes.values():
                if process.is_alive():
                    process.terminate()
            clients.stop(timeout=5.0)
    codes = clients.exit_codes + [p.exitcode for p in clients.processes.values()]
    return 0 if stop.is_set() or all(code == FINISHED for code in codes) else 1
