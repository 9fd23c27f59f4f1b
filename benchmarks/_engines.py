"""The raw env rate of each engine (env.engine: gymnasium, native, envpool): envs stepped with
random actions through the engine's envs (the outputs mono's actors and poly's clients read),
no policy, no learner. throughput.py's `envs` mode prints it.

Each measurement runs in its own processes (spawned: a clean interpreter each), --processes of
them at once, each stepping --num-envs envs on --threads threads (the C++ engines' thread pools;
gymnasium's envs step in the calling thread). It counts the steps, the wall time and the CPU time
of the whole process (the engines' threads included), so that steps per CPU-second (the rate a
core gives) stays comparable when other work shares the machine, and the wall rate shows what the
processes gave together.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

import numpy as np

WARMUP_S = 0.5
ACTION_ROWS = 256  # random actions drawn once, cycled: the draw is not the engine's cost


@dataclass
class Rate:
    steps: int
    wall_s: float  # the slowest process's
    cpu_s: float  # all processes together

    @property
    def per_second(self) -> float:
        return self.steps / self.wall_s

    @property
    def per_core(self) -> float:
        return self.steps / self.cpu_s


def _config(env_id: str, engine: str):
    from torchbeast_hydra.env.settings import AtariEnvConfig, EnvConfig

    # The Atari defaults (env=pong's preprocessing) for Atari ids; other ids ignore them.
    schema = AtariEnvConfig if env_id.startswith("ALE/") else EnvConfig
    return schema(id=env_id, engine=engine)


def refusal(env_id: str, engine: str) -> str | None:
    """Why the engine cannot run env_id's config (env/engines.py), or None."""
    from torchbeast_hydra.env import engines
    from torchbeast_hydra.errors import ConfigError

    try:
        engines.engine_of(_config(env_id, engine))
    except ConfigError as error:
        return str(error)
    return None


def _worker(env_id: str, engine: str, num_envs: int, threads: int, seconds: float, seed: int, start, results) -> None:
    from torchbeast_hydra.env.actions import random_actions
    from torchbeast_hydra.env.engines import envs_maker

    envs = envs_maker(_config(env_id, engine), threads)(num_envs, seed)
    rng = np.random.default_rng(seed)
    actions = np.stack([random_actions(envs.spec.actions, rng, num_envs) for _ in range(ACTION_ROWS)])
    envs.initial()
    start.wait()  # every process measures at once
    deadline = time.perf_counter() + WARMUP_S
    steps = 0
    while time.perf_counter() < deadline:
        envs.step(actions[steps % ACTION_ROWS])
        steps += 1
    wall0, cpu0, steps = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - wall0 < seconds:
        envs.step(actions[steps % ACTION_ROWS])
        steps += 1
    results.put((steps * num_envs, time.perf_counter() - wall0, time.process_time() - cpu0))
    envs.close()


def measure(env_id: str, engine: str, num_envs: int, threads: int, processes: int, seconds: float) -> Rate:
    """One measurement: processes x num_envs envs of env_id on the engine, for seconds."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(processes), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(env_id, engine, num_envs, threads, seconds, i * num_envs, start, results))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    got = [results.get(timeout=seconds + 300) for _ in workers]
    for worker in workers:
        worker.join()
    return Rate(sum(g[0] for g in got), max(g[1] for g in got), sum(g[2] for g in got))
