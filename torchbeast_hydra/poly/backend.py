"""The PolyBeast run: the ActorPool server, central inference, the learner thread, local clients.

role=all   server + learner + backend.num_actors local env client processes
role=learner  server + learner; env clients connect from other machines
role=env   env client processes only (run_env_clients), connecting to backend.address
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import statistics
import threading
import time
from concurrent import futures

import grpc
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from ..config import ConfigError, PolyRole, split_address
from ..envs import probe_env
from ..models import make_model
from ..training import StopOnSignals, TrainingRun, to_device
from . import wire
from .batcher import DynamicBatcher
from .client import FINISHED, REFUSED, UNREACHABLE, channel_options, client_main
from .rollouts import stack_rollouts
from .server import ActorPool

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


class LocalClients:
    """Env client processes on this machine, replaced when they die (up to a limit)."""

    def __init__(self, cfg, address: str, token: str, max_message_bytes: int, ignore_sigint: bool):
        backend = cfg.backend
        self.ctx = mp.get_context("spawn")
        self.args = (OmegaConf.to_object(cfg.env), address, token, backend.envs_per_actor,
                     backend.connect_timeout_s, max_message_bytes, ignore_sigint)
        self.count = backend.num_actors
        self.max_restarts = backend.max_actor_restarts
        self.restarts = 0
        self.processes = {}
        self.exit_codes = []  # of clients that ended for good

    def start(self) -> None:
        for index in range(self.count):
            self._start(index)

    def _start(self, index: int) -> None:
        process = self.ctx.Process(target=client_main, args=self.args, name=f"env-client-{index}", daemon=True)
        process.start()
        self.processes[index] = process

    def supervise(self, training: bool) -> None:
        """Replaces clients that died while training goes on; raises when they keep dying."""
        for index, process in list(self.processes.items()):
            if process.is_alive():
                continue
            process.join()
            code = process.exitcode
            if code in (FINISHED, UNREACHABLE) or not training:  # nothing a restart would fix
                self.exit_codes.append(code)
                del self.processes[index]
                continue
            if code == REFUSED:
                raise RuntimeError(f"the learner refused env client {index}; see its log above.")
            self.restarts += 1
            log.error("Env client %d (pid %s) exited with code %s; starting a replacement (%d/%d).",
                      index, process.pid, code, self.restarts, self.max_restarts)
            if self.restarts > self.max_restarts:
                raise RuntimeError(
                    f"env clients died {self.restarts} times (last exit code {code}); see the log above. "
                    "Raise backend.max_actor_restarts if crashes are expected.")
            self._start(index)

    @property
    def running(self) -> bool:
        return any(process.is_alive() for process in self.processes.values())

    def stop(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join()


class PolyBeast:
    """Runs a TrainingRun fed by the ActorPool server."""

    def __init__(self, cfg, run: TrainingRun):
        self.cfg = cfg
        self.run = run
        backend = cfg.backend
        self.token = resolve_token(backend)
        self.device = run.device
        self.model = make_model(cfg.model, run.spec).to(self.device)
        self.model.eval()
        self.weights_lock = threading.Lock()
        self._sync_weights()
        self.rollouts = queue.Queue(maxsize=backend.learner_queue_size)
        self.inference = DynamicBatcher(self._infer, backend.max_batch_size, backend.batch_timeout_ms / 1000,
                                        producers=lambda: self.pool.connected, name="inference",
                                        setup=lambda: torch.set_num_threads(backend.inference_torch_threads))
        self.pool = ActorPool(
            run.spec, cfg.env.id, self.inference, self._initial_state, self._enqueue, self.token,
            cfg.unroll_length, backend.cut_at_reset, backend.max_envs_per_client, cfg.seed)
        self.max_message_bytes = wire.max_message_bytes(run.spec.obs_shape, run.spec.obs_dtype,
                                                        backend.max_envs_per_client)
        self._errors = []

    # -- acting ------------------------------------------------------------------------------

    def _initial_state(self, num_envs: int) -> tuple:
        """Fresh core state for num_envs envs, batch first: [num_envs, ...]."""
        return tuple(s.transpose(0, 1).contiguous() for s in self.model.initial_state(num_envs))

    def _infer(self, inputs: dict) -> dict:
        """Central inference on a dynamic batch: inputs [N, ...] -> actions and policy outputs [N, ...]."""
        device = self.device
        states = sorted(key for key in inputs if key.startswith("core_state_"))
        env_outputs = {key: inputs[key].to(device).unsqueeze(0) for key in inputs if key not in states}
        core_state = tuple(inputs[key].to(device).transpose(0, 1) for key in states)
        with torch.no_grad(), self.weights_lock:
            outputs, core_state = self.model(env_outputs, core_state)
        result = {key: value[0].cpu() for key, value in outputs.items()}
        for i, state in enumerate(core_state):
            result[f"core_state_{i}"] = state.transpose(0, 1).cpu()
        return result

    def _enqueue(self, rollout: dict, core_state: tuple) -> None:
        """Hands a rollout to the learner; waits while its queue is full (back-pressure)."""
        while not self.pool.stopping.is_set():
            try:
                self.rollouts.put((rollout, core_state), timeout=0.5)
                return
            except queue.Full:
                continue

    # -- learning ----------------------------------------------------------------------------

    def _sync_weights(self) -> None:
        with torch.no_grad(), self.weights_lock:
            for target, source in zip(self.model.state_dict().values(),
                                      self.run.learner.model.state_dict().values()):
                target.copy_(source)

    def _get_batch(self):
        items = []
        while len(items) < self.cfg.batch_size:
            if self.run.done:
                return None
            try:
                items.append(self.rollouts.get(timeout=0.2))
            except queue.Empty:
                continue
        return to_device(*stack_rollouts(items), self.device)

    def _learn(self) -> None:
        torch.set_num_threads(self.cfg.backend.learner_torch_threads or os.cpu_count())  # per thread
        try:
            while not self.run.done:
                got = self._get_batch()
                if got is None:
                    return
                batches = self.inference.take_stats()
                sizes, seconds = zip(*batches) if batches else ((), ())
                observed = dict(
                    learner_queue_size=self.rollouts.qsize(),
                    inference_batch_size=round(statistics.fmean(sizes), 2) if sizes else "",
                    inference_ms=round(1000 * statistics.fmean(seconds), 3) if seconds else "",
                    connected_clients=self.pool.connected,
                )
                self.run.update(*got, observed)
                self._sync_weights()
        except BaseException as error:  # surfaced by the main thread
            self._errors.append(error)
            self.run.stop_requested.set()

    # -- the run -----------------------------------------------------------------------------

    def _start_server(self) -> tuple[grpc.Server, int]:
        backend = self.cfg.backend
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=backend.max_clients + 2, thread_name_prefix="actorpool"),
            handlers=[self.pool.handler()],
            options=channel_options(self.max_message_bytes),
            maximum_concurrent_rpcs=backend.max_clients,
        )
        try:
            port = server.add_insecure_port(backend.address)
        except RuntimeError as error:
            raise ConfigError(f"cannot listen on backend.address={backend.address} ({error}); "
                              "is another learner using that port?") from None
        server.start()
        host, _ = split_address(backend.address)
        write_address_file(self.run.run_dir / ADDRESS_FILE, host, port)
        log.info("ActorPool listening on %s:%d (%s). Env clients: backend=poly backend.role=env "
                 "backend.address=HOST:%d with the same %s.", host, port,
                 "loopback only" if host in ("127.0.0.1", "localhost", "[::1]") else "reachable from other machines",
                 port, TOKEN_ENV_VAR)
        return server, port

    def train(self) -> None:
        cfg, run, backend = self.cfg, self.run, self.cfg.backend
        learner = threading.Thread(target=self._learn, name="learner", daemon=True)
        clients = None
        with StopOnSignals(run.stop_requested) as run.stopped_by:
            server, port = self._start_server()
            try:
                if PolyRole(backend.role) is PolyRole.all:
                    clients = LocalClients(cfg, f"127.0.0.1:{port}", self.token, self.max_message_bytes,
                                           ignore_sigint=True)
                    clients.start()
                learner.start()
                last_log = time.monotonic()
                while not run.done:
                    time.sleep(0.2)
                    if clients is not None:
                        clients.supervise(training=not run.done)
                    if time.monotonic() - last_log >= cfg.logger.log_interval_s:
                        log.info("%s Clients %d, learner queue %d.", run.stats.progress_line(),
                                 self.pool.connected, self.rollouts.qsize())
                        last_log = time.monotonic()
                    run.maybe_checkpoint()
            finally:
                run.stop_requested.set()
                self._shut_down(server, clients)
                if learner.is_alive():
                    learner.join()
                run.save_checkpoint()
            if self._errors:
                raise self._errors[0]
        log.info("Finished: %s", run.stats.progress_line())

    def _shut_down(self, server: grpc.Server, clients: LocalClients | None) -> None:
        """Ends the clients' streams at their next step, then stops serving. Remote clients exit
        only if training is complete; otherwise they wait to reconnect to a restarted learner."""
        complete = self.run.stats.step >= self.cfg.total_steps
        self.pool.stop(finished=complete or clients is not None)
        deadline = time.monotonic() + 5.0
        while self.pool.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        self.inference.close()
        server.stop(grace=1.0).wait()
        if clients is not None:
            clients.stop()


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
    max_bytes = wire.max_message_bytes(spec.obs_shape, spec.obs_dtype, backend.max_envs_per_client)
    clients = LocalClients(cfg, backend.address, token, max_bytes, ignore_sigint=True)
    stop = threading.Event()
    log.info("Starting %d env clients (%d envs each) for the learner at %s.",
             backend.num_actors, backend.envs_per_actor, backend.address)
    with StopOnSignals(stop):
        clients.start()
        try:
            while clients.running and not stop.is_set():
                time.sleep(0.2)
                clients.supervise(training=not stop.is_set())
        finally:
            for process in clients.processes.values():
                if process.is_alive():
                    process.terminate()
            clients.stop(timeout=5.0)
    codes = clients.exit_codes + [p.exitcode for p in clients.processes.values()]
    return 0 if stop.is_set() or all(code == FINISHED for code in codes) else 1
