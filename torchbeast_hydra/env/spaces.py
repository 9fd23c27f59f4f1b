"""An env's spaces as this package sees them: the observation's leaves (each its own array on
every stage: buffers, the wire, the model) and the action space, gathered in one EnvSpec.

A Box (or other array) observation is one leaf, `frame`; a Dict/Tuple observation is a set of
named leaves (obs/glyphs, obs/inner/0), never flattened. `probe_env` builds the env once to learn
its spec (and to fail early on a bad id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import gymnasium as gym
import numpy as np

from torchbeast_hydra.env import layout
from torchbeast_hydra.env.actions import ActionSpec, action_spec
from torchbeast_hydra.env.make import make_env
from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.errors import ConfigError

# The spaces whose values are arrays, and so travel as leaves; Dict and Tuple nest them.
ARRAY_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiBinary, gym.spaces.MultiDiscrete)
FRAME = "frame"  # the key of an observation that is one array (Pong's frames, CartPole's vector)
OBS_PREFIX = "obs/"  # the keys of a Dict's or Tuple's leaves: obs/glyphs, obs/inner/0


@dataclass(frozen=True)
class Leaf:
    """One array of the observation: its key in the rollout, where it sits in the env's
    observation (Dict keys and Tuple indices), and its space (shape, dtype, value range)."""

    key: str
    path: tuple
    space: gym.Space

    @property
    def shape(self) -> tuple:
        return tuple(self.space.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.space.dtype)

    @cached_property
    def kind(self) -> str:
        """The array space this leaf's space is or derives from (a user's env may subclass them):
        "Box", "Discrete", "MultiBinary" or "MultiDiscrete"."""
        return next(cls.__name__ for cls in ARRAY_SPACES if isinstance(self.space, cls))

    @cached_property
    def integer_bounds(self) -> tuple | None:
        """(low, high), inclusive, of a Discrete or MultiDiscrete leaf, or of an integer Box narrower
        than its dtype (NetHack's glyph ids): values that index an embedding. None where every value
        of the dtype is in range (Atari's uint8 frames) or the leaf is not integer ids."""
        space = self.space
        if self.kind in ("Discrete", "MultiDiscrete"):
            low = np.asarray(space.start)
            return low, low + (space.n if self.kind == "Discrete" else space.nvec) - 1
        if self.kind != "Box" or self.dtype.kind not in "iu":
            return None
        info = np.iinfo(self.dtype)
        if (space.low <= info.min).all() and (space.high >= info.max).all():
            return None
        return space.low, space.high

    def of(self, obs):
        """This leaf's value in one observation of the env."""
        for part in self.path:
            obs = obs[part]
        return obs


@dataclass(frozen=True)
class EnvSpec:
    """What models and buffers need to know about an env: the observation's leaves (derived once,
    by observation_leaves) and its action space."""

    leaves: tuple
    actions: ActionSpec  # the action space (actions.py); an int n stands for Discrete(n)

    def __post_init__(self):
        if isinstance(self.actions, (int, np.integer)):
            object.__setattr__(self, "actions", ActionSpec.discrete(int(self.actions)))

    @cached_property
    def step_specs(self) -> dict:
        """The env keys' (per-step shape, dtype), layout.numpy_specs(self, ENV): computed once, since
        poly's server checks every step a client sends against them."""
        return layout.numpy_specs(self, layout.ENV)

    @classmethod
    def box(cls, shape: tuple, dtype, actions) -> EnvSpec:
        """The spec of an env whose observation is one Box (benchmarks and tests build these)."""
        dtype = np.dtype(dtype)
        low, high = (np.iinfo(dtype).min, np.iinfo(dtype).max) if dtype.kind in "ui" else (-np.inf, np.inf)
        return cls((Leaf(FRAME, (), gym.spaces.Box(low, high, tuple(shape), dtype)),), actions)

    @property
    def single(self) -> bool:
        """The observation is one array, `frame` (the fast path: no loops over leaves)."""
        return len(self.leaves) == 1 and self.leaves[0].key == FRAME

    @property
    def leaf_keys(self) -> tuple:
        """The rollout keys of the observation's leaves (frame, or obs/...); env.obs_keys is the
        config's selection of which leaves to keep, by path."""
        return tuple(leaf.key for leaf in self.leaves)

    @property
    def obs_shape(self):
        """A single array's shape; for Dict/Tuple observations, leaf key -> that leaf's space."""
        return self.leaves[0].shape if self.single else {leaf.key: leaf.space for leaf in self.leaves}

    @property
    def obs_bytes(self) -> int:
        """One env's observation, every leaf counted."""
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in self.leaves)


def observation_leaves(space: gym.Space, obs_keys=None, env_id: str = "?") -> tuple:
    """The observation's leaves, in the space's order; obs_keys (env.obs_keys) keeps only those
    named (leaf paths such as glyphs or inner/0, or a Dict's key to keep all below it)."""
    if isinstance(space, ARRAY_SPACES):
        found = [Leaf(FRAME, (), space)]
    else:
        found = list(_leaves(space, ()))
    if obs_keys is not None:
        found = _select(found, obs_keys, env_id)
    for leaf in found:
        if not isinstance(leaf.space, ARRAY_SPACES):
            raise ConfigError(
                f"env.id={env_id!r}: observation leaf {_name(leaf)!r} is a {type(leaf.space).__name__}, not an "
                "array (Box, Discrete, MultiBinary, MultiDiscrete); leave it out with env.obs_keys, e.g. "
                f"env.obs_keys=[{','.join(_name(x) for x in found if isinstance(x.space, ARRAY_SPACES))}]"
            )
    if not found:
        raise ConfigError(f"env.id={env_id!r}: env.obs_keys={list(obs_keys)} keeps no part of the observation.")
    return tuple(found)


def _leaves(space: gym.Space, path: tuple):
    if isinstance(space, gym.spaces.Dict):
        items = space.spaces.items()
    elif isinstance(space, gym.spaces.Tuple):
        items = enumerate(space.spaces)
    else:  # an array, or a space that is not one (Text, MiniGrid's MissionSpace): refused unless left out
        yield Leaf(OBS_PREFIX + "/".join(str(p) for p in path), path, space)
        return
    for key, part in items:
        yield from _leaves(part, (*path, key))


def _name(leaf: Leaf) -> str:
    return leaf.key.removeprefix(OBS_PREFIX)


def _select(found: list, obs_keys, env_id: str) -> list:
    wanted = [str(key).removeprefix(OBS_PREFIX) for key in obs_keys]
    names = [_name(leaf) for leaf in found]
    for key in wanted:
        if not any(name == key or name.startswith(key + "/") for name in names):
            raise ConfigError(
                f"env.obs_keys names {key!r}, which env.id={env_id!r}'s observation does not have; its leaves: {names}"
            )
    return [leaf for leaf, name in zip(found, names) if any(name == k or name.startswith(k + "/") for k in wanted)]


def env_spec(env: gym.Env, cfg: EnvConfig) -> EnvSpec:
    actions = action_spec(env.action_space, cfg.id)
    leaves = observation_leaves(env.observation_space, cfg.obs_keys, cfg.id)
    return EnvSpec(leaves, actions)


def probe_env(cfg: EnvConfig) -> EnvSpec:
    """Builds the env once, to fail early on a bad id and to learn its spaces."""
    env = make_env(cfg)
    try:
        return env_spec(env, cfg)
    finally:
        env.close()
