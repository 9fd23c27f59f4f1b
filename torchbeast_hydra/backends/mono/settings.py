"""MonoBeast's settings: shared-memory rollout buffers and learner threads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchbeast_hydra.backends.settings import FORK_SERVER_BYTES, MIN_ENVS, BackendConfig
from torchbeast_hydra.errors import require

MiB = 1024**2
# An actor process's own memory (its policy at work), beside the fork server's (FORK_SERVER_BYTES).
ACTOR_PROCESS_BYTES = 24 * MiB


@dataclass
class MonoConfig(BackendConfig):
    """MonoBeast: actor processes step envs and run a CPU copy of the policy; rollouts travel
    through shared-memory buffers to learner threads."""

    name: str = "mono"
    # Rollout buffers in shared memory; null: 2 x envs, and at least batch_size + envs (num_buffers()).
    num_buffers: Optional[int] = None
    num_learner_threads: int = 2  # threads that batch rollouts and run learner steps (one step at a time)
    # An env's float observation beyond what the model computes with (a float64 1e300, inf) stops the run
    # naming it; true: clipped to that range instead, counted in logs.csv's clipped_obs (NaN still stops).
    clip_obs_to_model_range: bool = False


def num_buffers(cfg) -> int:
    """Rollout buffers for mono: explicit, or enough for every env plus a batch in flight."""
    backend = cfg.backend
    if backend.num_buffers is not None:
        return backend.num_buffers
    num_envs = backend.num_actors * backend.envs_per_actor
    return max(2 * num_envs, cfg.batch_size + num_envs)


def check(cfg) -> None:
    """mono's slice: enough rollout buffers for the batch and the envs in flight."""
    backend = cfg.backend
    require(backend.num_learner_threads >= 1, "backend.num_learner_threads must be at least 1.")
    buffers = num_buffers(cfg)
    require(
        cfg.batch_size <= buffers,
        f"batch_size={cfg.batch_size} is larger than backend.num_buffers={buffers}: "
        f"raise backend.num_buffers (or leave it null) or lower batch_size.",
    )
    # Actors get envs_per_actor buffers at a time, while the learner may hold batch_size-1.
    needed = cfg.batch_size + backend.envs_per_actor - 1
    require(
        buffers >= needed,
        f"backend.num_buffers={buffers} can deadlock with batch_size={cfg.batch_size}, "
        f"backend.envs_per_actor={backend.envs_per_actor}: use at least {needed}.",
    )


def auto_actors(cores: int) -> tuple[int, int]:
    """(num_actors, envs_per_actor) for a machine with this many cores: an actor per core but one
    (the learner process's batching and Python need a core), at least 2, with MIN_ENVS envs in all
    and at least 4 each: each actor evaluates its envs as one batch, and a batch of 8 costs a third
    less a step than 4 (2 cores: 2 x 8, not 4 x 4: +9%; docs/performance.md)."""
    actors = max(2, cores - 1)
    return actors, max(4, -(-MIN_ENVS // actors))


def memory(cfg, unroll_bytes: int, envs_bytes: int, weight_bytes: int) -> dict:
    """What mono keeps in RAM beside the learner (backends/memory.py): the shared rollout buffers,
    the actor processes with their envs (envs_bytes) and their shared copy of the weights."""
    acting = FORK_SERVER_BYTES + cfg.backend.num_actors * ACTOR_PROCESS_BYTES + envs_bytes
    return {"rollout buffers": num_buffers(cfg) * unroll_bytes, "actors": acting + weight_bytes}
