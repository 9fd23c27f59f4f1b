"""What both backends share: actor processes, each stepping a few envs together, sized to the
machine when left at 0 (auto). Each backend's own schema and checks: mono/settings.py,
poly/settings.py."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from torchbeast_hydra.errors import require
from torchbeast_hydra.run.devices import usable_cores


@dataclass
class BackendConfig:
    """What both backends share: actor processes, each stepping a few envs together."""

    name: str = MISSING
    # mono: acting processes; poly: env client processes (role=all and role=env).
    # 0: auto (auto_actors): mono an actor per core but one, poly a client per 4 cores; at least 2.
    num_actors: int = 0
    # Envs per actor, stepped together: evaluated as one batch (mono) or sent as one message (poly).
    # 0: auto (auto_actors): mono 16 envs in all (at least 4 each), poly 4 per core a client gets (at least 16).
    envs_per_actor: int = 0
    # Intra-op threads per learner thread; 0: auto (a CPU learner: the cores this process may use,
    # but one in bf16 where the actor processes fill the cores, tried against the cores once the
    # run shows which side waits, run/thread_trial.py; a GPU learner: a few, for its host-side copies).
    learner_torch_threads: int = 0
    # Learner updates between copies of the weights to the acting policy (mono's actors, poly's
    # inference). 1: after every update. On a GPU the copy never makes the learner wait.
    publish_interval: int = 1
    max_actor_restarts: int = 10  # a run whose actors keep dying stops with an error
    # env.engine=auto may pick a C++ engine for actors (mono) and env clients (poly): EnvPool or
    # ale-py's native AtariVectorEnv where they reproduce envs.Environments (env/engines.py): the
    # same preprocessing in C++, ~30% less CPU a step. false: auto means the gymnasium envs.
    vector_env: bool = True


MIN_ENVS = 16  # envs in all, at least: the Pong defaults' (and their learning curves') count


def auto_actors(backend: str, cores: int) -> tuple[int, int]:
    """(num_actors, envs_per_actor) sized to a machine with this many cores (docs/performance.md
    has the measurements behind them).

    mono: an actor per core but one (the learner process's batching and Python need a core), at
    least 2, with MIN_ENVS envs in all and at least 4 each: each actor evaluates its envs as one
    batch, and a batch of 8 costs a third less a step than 4 (2 cores: 2 x 8, not 4 x 4: +9%).
    poly: a client per 4 cores, at least 2 (each steps its envs on cores // clients native
    threads, Atari), with 4 envs per thread in each message and at least 16: many envs per message
    keeps the server's per-message cost small (2 cores: 2 x 16, not 4 x 4: +35%).
    """
    if backend == "poly":
        clients = max(2, cores // 4)
        return clients, max(16, 4 * (cores // clients))
    actors = max(2, cores - 1)
    return actors, max(4, -(-MIN_ENVS // actors))


def resolve_auto(backend) -> None:
    """Replaces num_actors / envs_per_actor left at 0 (auto) with auto_actors' sizes, in place (on
    the resolved copy that config.validate returns, never on the user's config)."""
    if backend.num_actors == 0 or backend.envs_per_actor == 0:
        actors, envs = auto_actors(backend.name, usable_cores())
        if backend.num_actors == 0:
            backend.num_actors = actors
        if backend.envs_per_actor == 0:
            backend.envs_per_actor = envs


def check(cfg) -> None:
    """What every backend's slice must hold (after resolve_auto)."""
    backend = cfg.backend
    require(backend.max_actor_restarts >= 0, "backend.max_actor_restarts must be >= 0.")
    require(backend.learner_torch_threads >= 0, "backend.learner_torch_threads must be >= 0 (0: auto).")
    require(backend.publish_interval >= 1, "backend.publish_interval must be at least 1 (updates).")
    require(backend.num_actors >= 1, "backend.num_actors must be at least 1 (or 0: auto).")
    require(backend.envs_per_actor >= 1, "backend.envs_per_actor must be at least 1 (or 0: auto).")
