"""Seeds: the learner process's, and each acting process's env seeds."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """The learner process's seed: model initialisation, sampling in central inference, numpy."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def actor_seed(run_seed: int, actor: int, envs_per_actor: int) -> int:
    """The first env seed of the `actor`-th actor a run starts (restarts and reconnects count on),
    so that every env of every actor, replacement or client gets its own seed."""
    return run_seed * 1_000_003 + actor * envs_per_actor


# Rank r > 0 of a data-parallel run plays as if its run seed were seed + r * RANK_SEED_STRIDE: far
# from any seed a user picks, so no two ranks' (or runs') actors share an env seed; rank 0 keeps the
# run's seed, so rank 0 of N ranks plays what a one-rank run plays.
RANK_SEED_STRIDE = 2**32


def rank_seed(run_seed: int, rank: int) -> int:
    """The seed rank `rank` of a data-parallel run derives its actors' and sampling's seeds from."""
    return run_seed + rank * RANK_SEED_STRIDE


# Evaluation envs' seeds start here: far above any training env's (actor_seed stays below it for
# any run seed under 4.6e12: up to ~1,000 ranks), so evaluation never replays a training env's episodes.
EVAL_SEED_BASE = 2**62


def eval_seed(run_seed: int) -> int:
    """The evaluation env's seed: the same for every evaluation of a run (each plays the same starts)."""
    return EVAL_SEED_BASE + run_seed
