"""Poly's pipeline without env or model cost, for `throughput.py pipeline`.

Env client processes step a zero-cost env (the same frames every step) through the real client
code; the ActorPool server answers with a trivial policy in its dynamic batches and assembles the
unrolls; a learner takes batches as they come (stacks them, as the real learner does) without the
math, or the real learner (`backend.role=learner`) does. Each measure_* returns the same figures.
The clients reach the server over gRPC, or (measure_null's transport="shared_memory") as role=all's
local clients do, through shared memory (local.py).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import cli_command, cpu_seconds, mean_of, process_tree, steady_rate, steps_per_update

from torchbeast_hydra.logs.metrics import read_rows

BENCHMARKS = Path(__file__).resolve().parent
PROBE_CONF = BENCHMARKS / "conf"  # the probes' own config options (model=trivial_frames)

# shape, dtype and number of actions of the frames the zero-cost env sends; float64: a MuJoCo-sized
# vector (Humanoid-v5's 348) in float64, which the server checks against float32's range
OBS = dict(pong=((4, 84, 84), "uint8", 6), cartpole=((4,), "float32", 2), float64=((348,), "float64", 6))


class FixedFrames:
    """A zero-cost env maker for EnvClient: the same frames every step. Episodes never end, or, with
    episode_steps, end after a length drawn around it (half to one and a half times), so that envs
    fall out of step as real ones do (each env's unrolls then end at steps of their own)."""

    def __init__(self, obs_shape: tuple, obs_dtype: str, num_actions: int, episode_steps: int = 0):
        from torchbeast_hydra.env.spaces import EnvSpec

        self.spec = EnvSpec.box(tuple(obs_shape), np.dtype(obs_dtype), num_actions)
        self.episode_steps = episode_steps

    def __call__(self, num_envs: int, seed: int):
        return _Fixed(self.spec, num_envs, self.episode_steps, seed)


class _Fixed:
    def __init__(self, spec, n: int, episode_steps: int = 0, seed: int = 0):
        from torchbeast_hydra.env import layout

        self.out = layout.env_outputs(spec, n)  # the env keys, as real envs have them
        self.out["frame"][:] = 7
        self.out["done"][:] = False
        self.episode_steps = episode_steps
        self.rng = np.random.default_rng(seed)
        self.lengths = self._lengths(n)

    def _lengths(self, n: int) -> np.ndarray:
        return self.rng.integers(self.episode_steps // 2, self.episode_steps * 3 // 2 + 1, n)

    def initial(self) -> dict:
        return self.out

    def step(self, actions) -> dict:
        self.out["last_action"][:] = actions
        self.out["episode_step"] += 1
        if self.episode_steps:
            ended = self.out["episode_step"] >= self.lengths
            self.out["done"][:] = self.out["episode_end"][:] = ended
            self.out["episode_step"][ended] = 0
            self.lengths[ended] = self._lengths(int(ended.sum()))
        return self.out

    def close(self) -> None:
        pass


def trivial_policy(num_actions: int):
    import torch

    def policy(inputs: dict) -> dict:
        n = inputs["frame"].shape[0]
        return dict(
            action=torch.zeros(n, dtype=torch.int64),
            policy_logits=torch.zeros(n, num_actions),
            baseline=torch.zeros(n),
            policy_version=torch.zeros(n, dtype=torch.int64),  # the rollout layout's: the acting weights' version
        )

    return policy


class NullLearner:
    """The learner side of poly without the math: the server, central inference, batch stacking."""

    def __init__(self, maker: FixedFrames, args, shards: int = 1, grpc: bool = True):
        """grpc: serve gRPC clients (else only local clients, started with start_local_clients)."""
        import torch

        from torchbeast_hydra.backends.poly import wire
        from torchbeast_hydra.backends.poly.batcher import DynamicBatcher
        from torchbeast_hydra.backends.poly.rollouts import RolloutQueue
        from torchbeast_hydra.backends.poly.server import ActorPool, ServerSettings
        from torchbeast_hydra.backends.poly.serving import make_server
        from torchbeast_hydra.backends.poly.shards import ShardedServer, ShardPlan

        self.args = args
        self.token = secrets.token_urlsafe(16)
        self.rollouts = RolloutQueue(args.learner_queue_size)
        settings = ServerSettings(
            env_id="FixedFrames",
            unroll_length=args.unroll_length,
            chunk_size=args.batch_size,
            cut_at_reset=True,
            seed=0,
            max_envs_per_client=max(args.envs),
            max_clients=max(args.clients),
            client_idle_timeout_s=60.0,
        )
        self.max_bytes = wire.max_message_bytes(maker.spec, max(args.envs))
        self.steps = 0
        self.batches = 0
        self.gather_s = 0.0
        self.sharded = None
        self.server = self.inference = None
        self._thread = threading.Thread(target=self._learn, daemon=True)
        if shards > 1:  # the server's work in shard processes, central inference here
            plan = ShardPlan(
                spec=maker.spec,
                settings=settings,
                token=self.token,
                max_message_bytes=self.max_bytes,
                max_batch_size=args.max_batch_size,
                batch_timeout_s=args.batch_timeout_ms / 1000,
                initial_state=(),
            )
            policy = trivial_policy(maker.spec.actions.nvec[0])
            self.sharded = self.pool = ShardedServer(plan, shards, "127.0.0.1:0", policy, self.rollouts)
            self.address = f"127.0.0.1:{self.sharded.start()}"
            self._thread.start()
            return
        self.inference = DynamicBatcher(
            trivial_policy(maker.spec.actions.nvec[0]),
            args.max_batch_size,
            args.batch_timeout_ms / 1000,
            producers=lambda: self.pool.connected,
            setup=lambda: torch.set_num_threads(1),
            name="inference",
        )
        self.pool = ActorPool(
            maker.spec,
            settings,
            token=self.token,
            inference=self.inference,
            initial_state=lambda n: (),
            emit=self._enqueue,
        )
        if grpc:
            self.server, port = make_server(self.pool, "127.0.0.1:0", self.max_bytes)
            self.address = f"127.0.0.1:{port}"
            self.server.start()
        self._thread.start()

    @property
    def stopping(self) -> threading.Event:
        return (self.sharded or self.pool).stopping

    def shard_pids(self) -> list:
        return [p.pid for p in self.sharded.processes.processes.values()] if self.sharded else []

    def not_server_threads(self) -> list:
        """This process's threads that are not the server's: central inference, the null learner, the
        main thread (the benchmark's own); all the rest of the process's CPU (gRPC's own threads, the
        event loop or handler threads, the watchdog, the shards' receiver) is the server's."""
        inference = self.sharded.threads[0] if self.sharded else self.inference._thread
        return [inference, self._thread, threading.main_thread()]

    def take_inference_stats(self) -> list:
        return (self.sharded.central if self.sharded else self.inference).take_stats()

    def _enqueue(self, rollouts, core_state, release=None) -> None:
        self.rollouts.put(rollouts, core_state, self.stopping, release, scarce=False)

    _enqueue.takes_buffers = True  # as the backend's: sessions lend whole chunks (rollouts.py)

    def _learn(self) -> None:
        while True:
            got = self.rollouts.get_batch(self.args.batch_size, self.stopping.is_set)
            if got is None:
                return
            self.steps += int(got[0]["mask"][1:].sum())
            self.gather_s += self.rollouts.assembly_s
            self.batches += 1

    def stop(self) -> None:
        if self.sharded is not None:
            self.sharded.stop(finished=True)
            self._thread.join()
            return
        self.pool.stop(finished=True)
        deadline = time.monotonic() + 5
        while self.pool.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        self.inference.close()
        if self.server is not None:
            self.server.stop(grace=1.0).wait()
        self._thread.join()


def start_clients(
    maker, address: str, token: str, clients: int, envs: int, max_bytes: int, newest_frames: bool = True
) -> list:
    import torch.multiprocessing as mp

    from torchbeast_hydra.backends.poly.client import Connection, client_main
    from torchbeast_hydra.env.settings import EnvConfig

    ctx = mp.get_context("spawn")
    processes = [
        ctx.Process(
            target=client_main,
            daemon=True,
            args=(
                EnvConfig(id="FixedFrames"),
                Connection(address, token, 60, max_bytes, newest_frames),
                envs,
                True,
                maker,
            ),
        )
        for _ in range(clients)
    ]
    for process in processes:
        process.start()
    return processes


def start_local_clients(maker, pool, clients: int, envs: int) -> list:
    """Clients on shared memory (role=all's, backend.local_transport=shared_memory), each with the
    pool's thread that serves it."""
    import torch.multiprocessing as mp

    from torchbeast_hydra.backends.poly import local

    ctx = mp.get_context("spawn")
    return [local.start_client(pool, ctx, envs, maker, index) for index in range(clients)]


def wait_for_clients(pool, processes: list, timeout: float = 120.0) -> None:
    """Until every client has connected: the warm-up counts from there, not from their start (a
    loaded machine takes seconds to spawn them and import torch)."""
    deadline = time.monotonic() + timeout
    while pool.connected < len(processes):
        if time.monotonic() > deadline or not all(process.is_alive() for process in processes):
            raise RuntimeError(f"{pool.connected} of {len(processes)} env clients connected (see their errors above)")
        time.sleep(0.05)


def measure_null(
    maker, args, clients: int, envs: int, shards: int = 1, newest_frames: bool = True, transport: str = "grpc"
) -> dict:
    local = transport == "shared_memory"
    if local and shards > 1:
        raise ValueError("the benchmark's local clients are served by the learner's process: --shards 1")
    learner = NullLearner(maker, args, shards, grpc=not local)
    if local:
        processes = start_local_clients(maker, learner.pool, clients, envs)
    else:
        processes = start_clients(
            maker, learner.address, learner.token, clients, envs, learner.max_bytes, newest_frames
        )
    try:
        wait_for_clients(learner.pool, processes)
        time.sleep(args.warmup)
        pids, shard_pids = process_tree(os.getpid()), learner.shard_pids()
        learner.take_inference_stats()
        learner.pool.take_step_stats()
        steps0, gather0 = learner.steps, learner.gather_s
        cpu0, own0, started = cpu_seconds(pids), cpu_seconds([os.getpid()]), time.perf_counter()
        others0, whole0 = thread_seconds(learner.not_server_threads()), time.process_time()
        shards0 = {pid: cpu_seconds([pid]) for pid in shard_pids}
        time.sleep(args.seconds)
        steps, elapsed = learner.steps - steps0, time.perf_counter() - started
        cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds([os.getpid()]) - own0
        others, whole = thread_seconds(learner.not_server_threads()) - others0, time.process_time() - whole0
        each_shard = [cpu_seconds([pid]) - shards0[pid] for pid in shard_pids]
        gather = learner.gather_s - gather0
        inference = learner.take_inference_stats()
        server_us = learner.pool.take_step_stats()
    finally:
        learner.stop()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    per_step = 1e6 / max(steps, 1)
    return dict(
        sps=steps / elapsed,
        cpu_us=cpu * per_step,
        learner_cpu_us=own * per_step,
        shards_cpu_us=sum(each_shard) * per_step,
        # What the busiest of the server's processes allows, each holding one GIL (its CPU per env-step
        # of all clients: 1e6 / that is the rate at which it would fill one core).
        # (0 where no CPU tick was counted: a window too short on a loaded machine)
        ceiling=1e6 / busiest if (busiest := max([own, *each_shard]) * per_step) else 0.0,
        gather_us=1e6 * gather / max(steps, 1),
        inference_batch=np.mean([size for size, _, _ in inference]) if inference else 0.0,
        # central inference's host work (its thread's CPU for each batch), per env-step it answered
        inference_host_us=1e6 * sum(cpu for _, _, cpu in inference) / max(sum(size for size, _, _ in inference), 1),
        server_us=server_us,
        # Every CPU second the server spends, whatever thread spends it: the learner process's but for
        # central inference, the learner and the main thread, and the shard processes' (all of them).
        server_all_us=(whole - others + sum(each_shard)) * per_step,
    )


def thread_seconds(threads: list) -> float:
    """CPU seconds these threads (of this process) have used so far."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) for thread in threads)


def measure_cli(maker, args, clients: int, envs: int, newest_frames: bool = True) -> dict:
    """The real learner (role=learner, with the given overrides) fed by zero-cost clients."""
    from torchbeast_hydra.backends.poly import wire

    token = secrets.token_urlsafe(16)
    max_bytes = wire.max_message_bytes(maker.spec, max(envs, 256))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = cli_command(
            run_dir,
            [
                "backend=poly",
                "backend.role=learner",
                "total_steps=1000000000",
                "checkpoint_interval_s=100000",
                f"backend.max_envs_per_client={max(envs, 256)}",
                # the null learner's settings, so that the two modes differ only in the learner
                f"batch_size={args.batch_size}",
                f"unroll_length={args.unroll_length}",
                f"backend.max_batch_size={args.max_batch_size}",
                f"backend.batch_timeout_ms={args.batch_timeout_ms}",
                f"backend.learner_queue_size={args.learner_queue_size}",
                *args.overrides,
            ],
            flags=(f"--config-dir={PROBE_CONF}",),  # model=trivial_frames: a trivial policy the real learner runs
        )
        launched = time.monotonic()  # the run's clock (logs.csv's time_s) starts after this
        learner = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, TORCHBEAST_TOKEN=token, PYTHONPATH=_with_benchmarks_on_path()),
        )
        processes = []
        try:
            address_file = run_dir / "actorpool_address"
            deadline = time.monotonic() + 120
            while not address_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            address = address_file.read_text().strip()
            processes = start_clients(maker, address, token, clients, envs, max_bytes, newest_frames)
            # The steps/s, like the CPU window, count from the clients' start plus the warm-up (the
            # learner's clock started after `launched`: the rows read all lie past that point).
            clients_at = time.monotonic() - launched
            time.sleep(args.warmup)
            pids = process_tree(os.getpid())
            cpu0, own0 = cpu_seconds(pids), cpu_seconds([learner.pid])
            time.sleep(args.seconds)
            cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds([learner.pid]) - own0
            rows, sps = steady_rate(read_rows(run_dir), clients_at + args.warmup)
        finally:
            learner.terminate()
            learner.wait(timeout=60)
            for process in processes:
                process.kill()
                process.join()
    if sps is None:
        sys.exit("too few learner updates after the warm-up; raise --seconds")
    # CPU was measured over --seconds, the steps over the logged rows in it: scale to the same span.
    measured = max(sps * args.seconds, 1)
    per_update = steps_per_update(rows)
    return dict(
        sps=sps,
        cpu_us=1e6 * cpu / measured,
        learner_cpu_us=1e6 * own / measured,
        gather_us=1000 * (mean_of(rows, "gather_ms") or 0) / per_update,
        inference_batch=mean_of(rows, "inference_batch_size") or 0.0,
        server_us=mean_of(rows, "server_us_per_step"),
        inference_host_us=mean_of(rows, "inference_host_us_per_step"),
        update_us=1000 * (mean_of(rows, "update_ms") or 0) / per_update,
        queue=mean_of(rows, "learner_queue_size"),
    )


def _with_benchmarks_on_path() -> str:
    """PYTHONPATH with benchmarks/ first: the learner imports the probes' model (_probe_models)."""
    return os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
