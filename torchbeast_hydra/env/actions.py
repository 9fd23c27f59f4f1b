"""An env's action space as the harness sees it: which kind, the array an action is, and its checks.

`ActionSpec` (from `action_spec(space)`) is numpy-only, so env clients need no torch. Every kind's
action travels as one array per env: a Discrete action is an int64 scalar; a MultiDiscrete,
MultiBinary or Box action is a flat vector of the space's size (int64, int64, float32), reshaped
to the space's shape only when it is handed to the env (`to_env`). distributions.py maps a spec
to the policy's distribution.

Box actions are stored as sampled (unclipped): the log-probability the policy gradient and V-trace
use is that of the sample; the bounds are applied where the action enters the env, and the env's
last_action (what the model is shown next) is the action the env took, within the bounds: so poly's
server can refuse a last_action outside them, as it does a Discrete one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from torchbeast_hydra.errors import ConfigError

DISCRETE, MULTI_DISCRETE, MULTI_BINARY, BOX = "discrete", "multi_discrete", "multi_binary", "box"


class ActionError(ValueError):
    """Actions that do not fit the space (out of range, NaN, wrong shape); the text says which."""


@dataclass(frozen=True)
class ActionSpec:
    """What the policy, the buffers and the wire need to know about an action space."""

    kind: str  # DISCRETE, MULTI_DISCRETE, MULTI_BINARY or BOX
    shape: tuple = ()  # the env's action shape (the space's)
    nvec: tuple = ()  # categorical kinds: the number of choices of each (flattened) dimension
    start: tuple = ()  # categorical kinds: the env's first value of each dimension (gymnasium's start)
    low: tuple = ()  # BOX: the bounds of each flattened dimension
    high: tuple = ()
    env_dtype: str = "int64"  # what env.step is given

    @classmethod
    def discrete(cls, n: int) -> ActionSpec:
        return cls(DISCRETE, (), (int(n),), (0,))

    @property
    def size(self) -> int:
        """Dimensions of one action (1 for Discrete)."""
        return math.prod(self.shape)

    @property
    def step_shape(self) -> tuple:
        """Per-step shape of the action in rollouts and on the wire: () for Discrete, else (size,)."""
        return () if self.kind == DISCRETE else (self.size,)

    @property
    def num_params(self) -> int:
        """The size of the policy's distribution parameters (distributions.py): logits per choice
        (Discrete, MultiDiscrete), one logit per dimension (MultiBinary), mean and log std (Box)."""
        if self.kind == MULTI_BINARY:
            return self.size
        return 2 * self.size if self.kind == BOX else sum(self.nvec)

    @property
    def dtype(self) -> str:
        return "float32" if self.kind == BOX else "int64"

    def describe(self) -> str:
        if self.kind == DISCRETE:
            return f"Discrete({self.nvec[0]})"
        if self.kind == MULTI_DISCRETE:
            return f"MultiDiscrete({list(self.nvec)})"
        if self.kind == MULTI_BINARY:
            return f"MultiBinary({list(self.shape)})"
        return f"Box({list(self.shape)}, [{min(self.low):g}, {max(self.high):g}])"

    def signature(self) -> dict:
        """What a checkpoint's actions must match to resume (resume.env_signature)."""
        return dict(
            kind=self.kind, shape=list(self.shape), nvec=list(self.nvec), low=list(self.low), high=list(self.high)
        )


def action_spec(space: gym.Space, env_id: str) -> ActionSpec:
    """The spec of a supported action space; any other is refused with what to do."""
    if isinstance(space, gym.spaces.Discrete):
        return ActionSpec(DISCRETE, (), (int(space.n),), (int(space.start),))
    if isinstance(space, gym.spaces.MultiDiscrete):
        return ActionSpec(
            MULTI_DISCRETE,
            tuple(space.shape),
            tuple(int(n) for n in space.nvec.ravel()),
            tuple(int(s) for s in np.broadcast_to(getattr(space, "start", 0), space.shape).ravel()),
        )
    if isinstance(space, gym.spaces.MultiBinary):
        shape = tuple(int(n) for n in np.atleast_1d(space.shape))
        return ActionSpec(MULTI_BINARY, shape, (2,) * math.prod(shape), (0,) * math.prod(shape), env_dtype="int8")
    if isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating) and space.is_bounded("both"):
        return ActionSpec(
            BOX,
            tuple(space.shape),
            low=tuple(float(x) for x in space.low.ravel()),
            high=tuple(float(x) for x in space.high.ravel()),
            env_dtype=np.dtype(space.dtype).name,
        )
    raise ConfigError(
        f"env.id={env_id!r} has action space {space}, which is not supported: use an env (or a wrapper) "
        "with a Discrete, MultiDiscrete, MultiBinary or float Box action space; a Box needs finite bounds "
        "(a wrapper can set action_space to the range the env accepts)."
    )


def box_bounds(spec: ActionSpec) -> tuple[np.ndarray, np.ndarray]:
    """A Box space's low and high per flattened dimension, in the actions' dtype (float32)."""
    return np.asarray(spec.low, np.float32), np.asarray(spec.high, np.float32)


def random_actions(spec: ActionSpec, rng: np.random.Generator, num_envs: int) -> np.ndarray:
    """Uniformly random actions [num_envs, *step_shape], as the model gives them (categorical kinds:
    indices from 0; Box: within its bounds)."""
    shape = (num_envs, *spec.step_shape)
    if spec.kind == BOX:
        low, high = box_bounds(spec)
        return rng.uniform(low, high, (num_envs, spec.size)).astype(np.float32).reshape(shape)
    return rng.integers(0, spec.nvec, (num_envs, spec.size)).reshape(shape)


def check(spec: ActionSpec, actions: np.ndarray, what: str = "actions", taken: bool = False) -> None:
    """Raises ActionError unless actions [N, *step_shape] are values of the space. Box: finite, and
    within the bounds if taken (actions an env took, e.g. last_action; sampled ones may stray past them)."""
    if spec.kind == BOX:
        finite = np.isfinite(actions)
        if not finite.all():
            raise ActionError(f"{what} are not finite (NaN/inf) for envs {bad_rows(finite)}")
        if taken:
            low, high = box_bounds(spec)
            inside = (actions >= low) & (actions <= high)
            if not inside.all():
                raise ActionError(f"{what} outside the action space {spec.describe()} for envs {bad_rows(inside)}")
        return
    nvec = np.asarray(spec.nvec).reshape(spec.step_shape)
    inside = (actions >= 0) & (actions < nvec)
    if not inside.all():  # the rows, not the values: a client's 256 envs would make a text too long to send
        raise ActionError(f"{what} outside the action space {spec.describe()} for envs {bad_rows(inside)}")


def bad_rows(good: np.ndarray) -> list:
    """The envs (rows) where some entry of the boolean array is False."""
    return np.flatnonzero(~good.reshape(len(good), -1).all(axis=1)).tolist()


def to_env(spec: ActionSpec):
    """A function: one env's action (a row of the rollout's action array) -> what its env.step takes."""
    if spec.kind == DISCRETE:
        start = spec.start[0]
        return (lambda a: int(a)) if start == 0 else (lambda a: int(a) + start)
    if spec.kind == BOX:
        low, high = box_bounds(spec)
        return lambda a: np.clip(a, low, high).astype(spec.env_dtype).reshape(spec.shape)
    start = np.asarray(spec.start, np.int64)
    return lambda a: (a + start).astype(spec.env_dtype).reshape(spec.shape)
