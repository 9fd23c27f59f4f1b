"""The rollout layout, declared once: every key a rollout row holds, its per-step shape and dtype.

Env outputs (envs.Environments), mono's shared buffers, the wire format's Step (poly/wire.py) and
the learner's batches all derive from `LAYOUT`. A rollout is [T+1, ...] per key; see learner.py
for what the rows mean.

Shapes and dtypes may name the env's spaces: OBS (the observation), ACTION (an action's per-step
shape or dtype: () int64 for Discrete, (D,) for the other kinds, see actions.py) and PARAMS (the
size of the policy's distribution parameters, see distributions.py). The `frame` entry stands for
the observation: an env whose observation is one array keeps the key `frame`; a Dict/Tuple
observation has one key per leaf in its place (obs/glyphs, obs/blstats, ...: envs.EnvSpec.leaves),
each with its own shape and dtype. Adding a key here adds it everywhere; who writes it says where
its values come from: the env (sent by poly clients), the acting policy, or the backend (the mask).

What V-trace needs from the behaviour policy is the action it took and its distribution's
parameters (`policy_logits`: logits for the categorical kinds, mean and log std for Box), from
which the learner computes the behaviour's log-probability of the action (and a KL term could
compare whole distributions).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

OBS = "obs"  # the env's observation shape, or its dtype
ACTION = "action"  # an action's per-step shape, or its dtype
PARAMS = "params"  # the number of the action distribution's parameters

ENV, AGENT, BACKEND = "env", "agent", "backend"  # who writes a key


class Field(NamedTuple):
    shape: tuple | str  # per step: a tuple (entries may be PARAMS), or OBS or ACTION
    dtype: str  # a numpy dtype name, or OBS or ACTION
    writer: str  # ENV, AGENT or BACKEND


LAYOUT = {
    # Written by the env each step (and sent by poly clients, in this order).
    "frame": Field(OBS, OBS, ENV),
    "reward": Field((), "float32", ENV),
    "done": Field((), "bool", ENV),  # an episode ended for learning (a lost life counts)
    "episode_return": Field((), "float32", ENV),
    "episode_step": Field((), "int32", ENV),
    "last_action": Field(ACTION, ACTION, ENV),
    "episode_end": Field((), "bool", ENV),  # the whole game ended: episode_return is final
    # Written by the acting policy, in the row of the env output its action answers.
    "action": Field(ACTION, ACTION, AGENT),  # Box: as sampled, before clipping to the bounds
    "policy_logits": Field((PARAMS,), "float32", AGENT),  # the distribution's parameters
    "baseline": Field((), "float32", AGENT),
    # The acting weights' version: the learner updates they reflect (WeightPublisher.version); the
    # learner's update count minus it is the step's policy lag (learning/policy_lag.py).
    "policy_version": Field((), "int64", AGENT),
    # Written by the backend: real steps (partial rollouts are padded).
    "mask": Field((), "bool", BACKEND),
}

# The largest float magnitude the model computes with in float32 (accel.float_limit: lower under bf16
# autocast): a finite float64 observation beyond it becomes inf in the model, then NaN.
FLOAT32_LIMIT = float(np.finfo(np.float32).max)

ENV_KEYS = tuple(key for key, f in LAYOUT.items() if f.writer == ENV)
AGENT_KEYS = tuple(key for key, f in LAYOUT.items() if f.writer == AGENT)


def numpy_specs(spec, writer: str | None = None) -> dict:
    """key -> (per-step shape, numpy dtype) for an env's spec (envs.EnvSpec); one writer's keys, or all."""
    out = {}
    for key, f in LAYOUT.items():
        if writer is not None and f.writer != writer:
            continue
        if f.shape == OBS:  # the observation's leaves, in its place
            out.update({leaf.key: (leaf.shape, leaf.dtype) for leaf in spec.leaves})
            continue
        if f.shape == ACTION:
            shape = spec.actions.step_shape
        else:
            shape = tuple(spec.actions.num_params if d == PARAMS else d for d in f.shape)
        out[key] = (shape, np.dtype(spec.actions.dtype) if f.dtype == ACTION else np.dtype(f.dtype))
    return out


def fits_limit(array: np.ndarray, limit: float) -> bool:
    """Whether every value of a float array is finite and at most limit in magnitude: the check of
    every step, so one pass and no temporaries (NaN fails the comparisons, as inf does)."""
    if np.finfo(array.dtype).max <= limit:  # float32 under float32: nothing finite exceeds it
        return bool(np.isfinite(array).all())
    if array.dtype.kind == "c" or not array.size:
        return bool(within_limit(array, limit).all())
    return bool(-limit <= array.min() and array.max() <= limit)


def within_limit(array: np.ndarray, limit: float) -> np.ndarray:
    """Elementwise fits_limit, for where a check failed: which values (and so which envs)."""
    if np.finfo(array.dtype).max <= limit:
        return np.isfinite(array)
    return np.abs(array) <= limit


def env_keys(spec) -> tuple:
    """The env keys of this env's rollouts: ENV_KEYS with the observation's leaves for `frame`."""
    return tuple(numpy_specs(spec, ENV))


def env_outputs(spec, num_envs: int) -> dict:
    """The env keys' arrays for num_envs envs, [num_envs, ...], as they stand before the first
    step: every env starting an episode (done)."""
    out = {key: np.zeros((num_envs, *shape), dtype) for key, (shape, dtype) in numpy_specs(spec, ENV).items()}
    out["done"][:] = True
    return out


def rollout_specs(spec) -> dict:
    """key -> (per-step shape, torch dtype): the learner's and the buffers' view of the layout."""
    import torch  # here, not at the top: env client processes use this module and never need torch

    return {
        key: (shape, torch.from_numpy(np.zeros(0, dtype)).dtype) for key, (shape, dtype) in numpy_specs(spec).items()
    }


def zero_rollouts(spec, unroll_length: int, count: int) -> dict:
    """Zeroed tensors [T+1, count, ...] for every rollout key, each unroll marked whole (mask):
    mono's buffers before their share_memory_(), and the batches benchmarks time or size."""
    import torch

    rollouts = {
        key: torch.zeros((unroll_length + 1, count, *shape), dtype=dtype)
        for key, (shape, dtype) in rollout_specs(spec).items()
    }
    rollouts["mask"].fill_(True)
    return rollouts
