"""What every backend shares: actor processes, each stepping a few envs together, sized to the
machine when left at 0 (auto: each backend's auto_actors). Each backend's own schema, checks and
sizes: mono/settings.py, poly/settings.py, listed in registry.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from torchbeast_hydra.errors import require
from torchbeast_hydra.run.devices import usable_cores


@dataclass
class BackendConfig:
    """What both backends share: actor processes, each stepping a few envs together."""

    name: str = MISSING
    # mono: acting processes; poly: env client processes (role=all and role=env).
    # 0: auto (each backend's auto_actors): mono an actor per core but one, poly a client per 4 cores; at least 2.
    num_actors: int = 0
    # Envs per actor, stepped together: evaluated as one batch (mono) or sent as one message (poly).
    # 0: auto (each backend's auto_actors): mono 16 envs in all (at least 4 each), poly 4 per core
    # a client gets (at least 16).
    envs_per_actor: int = 0
    # Intra-op threads per learner thread; 0: auto (a CPU learner: the cores this process may use,
    # but one in bf16 where the actor processes fill the cores, tried against the cores once the
    # run shows which side waits, run/thread_trial.py; a GPU learner: a few, for its host-side copies).
    learner_torch_threads: int = 0
    # Learner updates between copies of the weights to the acting policy (mono's actors, poly's
    # inference). 1: after every update. On a GPU the copy never makes the learner wait.
    publish_interval: int = 1
    # Rollouts with a step acted by weights more than this many learner updates old are not learned
    # from (masked out, counted in logs.csv's dropped_stale_rollouts); null: off. logs.csv's
    # policy_lag_mean / policy_lag_max show the lag either way.
    max_policy_lag: Optional[int] = None
    # Every update learns only from steps acted by the learner's current weights (policy lag 0):
    # the weights are published after every update, actors (mono) and sessions (poly) start each
    # unroll only with weights newer than their last unroll's, and what is still older is dropped
    # as with max_policy_lag=0. Needs publish_interval=1, at least batch_size envs, and on poly
    # role=all with cut_at_reset=false; mono uses one learner thread.
    synchronous: bool = False
    max_actor_restarts: int = 10  # a run whose actors keep dying stops with an error
    # env.engine=auto may pick a C++ engine for actors (mono) and env clients (poly): EnvPool or
    # ale-py's native AtariVectorEnv where they reproduce env.vector.Environments (env/engines.py): the
    # same preprocessing in C++, ~30% less CPU a step. false: auto means the gymnasium envs.
    vector_env: bool = True


# The fork server that acting processes are forked from (run/supervision.py): Python, torch,
# gymnasium and ale-py imported, pages they all share, counted once beside their own private
# memory (each backend's settings). Calibrated on private pages (USS), which other processes on
# the machine cannot change as they change PSS: 2026-11-30, a spawned actor or env client had
# 142-156 MB of its own, a forked one 8-10 MB beside the server's shared ~160 MB.
FORK_SERVER_BYTES = 160 * 1024**2
MIN_ENVS = 16  # envs in all, at least: the Pong defaults' (and their learning curves') count


def resolve_auto(backend, auto_actors) -> None:
    """Replaces num_actors / envs_per_actor left at 0 (auto) with the backend's own sizes for this
    machine (its auto_actors(cores), registry.py), in place: on the resolved copy that
    config.validate returns, never on the user's config."""
    if backend.num_actors == 0 or backend.envs_per_actor == 0:
        actors, envs = auto_actors(usable_cores())
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
    require(
        backend.max_policy_lag is None or backend.max_policy_lag >= 0,
        "backend.max_policy_lag must be >= 0 (learner updates) or null (off).",
    )
    if backend.synchronous:
        require(
            backend.publish_interval == 1,
            "backend.synchronous=true publishes after every update: set backend.publish_interval=1.",
        )
        envs = backend.num_actors * backend.envs_per_actor
        require(
            envs >= cfg.batch_size,
            f"backend.synchronous=true needs at least batch_size={cfg.batch_size} envs acting (each waits for "
            f"new weights after an unroll): raise backend.num_actors x backend.envs_per_actor (now {envs}) "
            "or lower batch_size.",
        )
