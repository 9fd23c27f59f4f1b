"""Environments: any gymnasium id, with TorchBeast's Atari preprocessing for ALE games.

The preprocessing's settings are declared once, in config.AtariPreprocessing (env.noop_max,
env.frame_skip, ...); `make_env` and `Environments` read them through config.atari_settings, as
vector_envs' native maker does, so both give the agent the same observations
(tests/test_atari_parity.py). Non-Atari ids ignore them.

`make_env` builds one gymnasium env. Your own envs: list the modules that register them in
`env.imports` (or use gymnasium's `module:EnvId` form for env.id); every process that makes envs
(the learner's probe, mono actors, poly clients here or on other machines) imports them first.

`Environments` steps a few envs in lockstep and reports what the actor needs each step as arrays
of shape [num_envs, ...], written in place (no per-step allocation): the rollout layout's env keys
(layout.py): frame, reward, done, episode_return, episode_step, last_action, episode_end.

Two notions of "end": `done` is what learning sees (a lost life counts when episodic_life is on);
`episode_end` marks the end of the whole game, where `episode_return` is the full game's return
(all lives), as papers report it.
"""

from __future__ import annotations

import difflib
import importlib
import math
from dataclasses import dataclass
from functools import cached_property

import gymnasium as gym
import numpy as np

from . import layout
from .actions import BOX, ActionSpec, action_spec, box_bounds, check, to_env
from .config import ConfigError, EnvConfig, atari_settings


def _register_ale() -> None:
    try:
        import ale_py

        gym.register_envs(ale_py)
    except ImportError:  # Atari is optional for non-Atari ids
        pass


_register_ale()


# The env families this package offers an extra for: the module that registers them -> the extra.
EXTRAS = dict(nle="nethack", minihack="minihack", minigrid="minigrid")
# Their ids' prefixes -> the module that registers them: typed without the env option
# (env.id=MiniGrid-DoorKey-6x6-v0 on the default env=pong), such an id is not registered yet.
FAMILY_PREFIXES = {"MiniGrid-": "minigrid", "BabyAI-": "minigrid", "MiniHack-": "minihack", "NetHack": "nle"}


def import_modules(modules, what: str = "env.imports") -> None:
    """Imports the modules that register a user's envs (their gym.register calls run once)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            extra = EXTRAS.get(module.split(".")[0])
            if extra and getattr(error, "name", None) == module.split(".")[0]:
                raise ConfigError(
                    f'{what}: {module!r} is not installed; install it with: pip install "torchbeast_hydra[{extra}]" '
                    f'(from a checkout: pip install ".[{extra}]").'
                ) from error
            raise ConfigError(
                f"{what}: cannot import {module!r} ({error}). Install it in this environment or put "
                "its directory on PYTHONPATH (on every machine that runs env clients)."
            ) from error


def find_spec(env_id: str, imports=()) -> gym.envs.registration.EnvSpec:
    """The registered spec of env_id, after importing `imports` and, for "module:EnvId", module."""
    import_modules(imports)
    module, sep, name = env_id.rpartition(":")
    if sep:
        import_modules([module], what=f"env.id={env_id!r}")
    try:
        return gym.spec(name)
    except gym.error.Error as error:
        raise _unknown_env_error(name, error, imports) from None


def is_atari(env_id: str, imports=()) -> bool:
    return _is_ale(find_spec(env_id, imports))


def _is_ale(spec: gym.envs.registration.EnvSpec) -> bool:
    return isinstance(spec.entry_point, str) and spec.entry_point.startswith("ale_py")


def _unknown_env_error(env_id: str, error: Exception, imports=()) -> ConfigError:
    for prefix, module in FAMILY_PREFIXES.items():
        if env_id.startswith(prefix) and module not in imports:
            option = EXTRAS[module]  # each family's env option is named after its extra
            return ConfigError(
                f"env.id={env_id!r} is one of env={option}'s ids; that option registers them and brings "
                f"their model: python -m torchbeast_hydra env={option} env.id={env_id} "
                f'(after pip install ".[{option}]").'
            )
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(
        f"env.id={env_id!r} is not a registered gymnasium environment ({error}).{hint} "
        "Your own envs: list the modules that register them in env.imports, or use env.id=module:EnvId. "
        "List ids with: python -c 'import gymnasium, ale_py; gymnasium.pprint_registry()'"
    )


class FireOnReset(gym.Wrapper):
    """Presses FIRE after a reset, for games that wait for it before play starts."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self.env.step(1)
        if terminated or truncated:
            obs, info = self.env.reset(**kwargs)
        return obs, info


def make_env(cfg: EnvConfig, render_mode: str | None = None) -> gym.Env:
    """One gymnasium env for cfg.id; Atari ids get TorchBeast's preprocessing."""
    spec = find_spec(cfg.id, cfg.imports)
    kwargs = dict(cfg.make_kwargs)
    if render_mode is not None:  # only when asked: a user's env need not take the argument
        kwargs["render_mode"] = render_mode
    atari = atari_settings(cfg) if _is_ale(spec) else None
    if atari is not None:
        # Frame skipping and max-pooling happen in AtariPreprocessing, so the raw env must not skip.
        kwargs.update(
            frameskip=1,
            repeat_action_probability=atari.sticky_action_prob,
            full_action_space=atari.full_action_space,
        )
    try:
        env = gym.make(spec, **kwargs)
    except gym.error.DependencyNotInstalled as error:
        if "mujoco" in str(error).lower():
            raise ConfigError(
                f'env.id={cfg.id!r} is a MuJoCo task: pip install "torchbeast_hydra[mujoco]" '
                '(in a checkout: pip install ".[mujoco]").'
            ) from None
        raise ConfigError(f"could not create env.id={cfg.id!r}: {error}") from None
    except gym.error.Error as error:
        raise ConfigError(f"could not create env.id={cfg.id!r}: {error}") from None
    except Exception as error:  # e.g. a missing ROM, an unknown keyword, a bug in your env
        # Chained, so that the error's traceback (inside your env, say) follows this line in the log.
        raise ConfigError(
            f"could not create env.id={cfg.id!r}: {type(error).__name__}: {error}. "
            "Check env.id and env.make_kwargs (the traceback follows); Atari ROMs ship with ale-py>=0.9."
        ) from error
    if atari is not None:
        env = gym.wrappers.AtariPreprocessing(
            env,
            noop_max=atari.noop_max,
            frame_skip=atari.frame_skip,
            screen_size=atari.screen_size,
            terminal_on_life_loss=False,  # handled by Environments, without resetting the game
            grayscale_obs=True,
            scale_obs=False,  # uint8 frames: 4x less memory in buffers and on the wire
        )
        if atari.fire_reset and "FIRE" in env.unwrapped.get_action_meanings():
            env = FireOnReset(env)
        env = gym.wrappers.FrameStackObservation(env, atari.frame_stack)
    return env


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
    def obs_keys(self) -> tuple:
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


class Environments:
    """A few envs stepped in lockstep; outputs are preallocated arrays [num_envs, ...].

    Life losses (Atari ids, env.episodic_life): `done` while the game goes on, and FIRE pressed
    after one where the game needs it (env.fire_reset), as at a reset.
    """

    def __init__(self, cfg: EnvConfig, num_envs: int, seed: int, render_mode: str | None = None):
        self.envs = [make_env(cfg, render_mode) for _ in range(num_envs)]
        self.spec = env_spec(self.envs[0], cfg)
        self.seeds = [seed + i for i in range(num_envs)]
        atari = atari_settings(cfg)
        self.episodic_life = atari.episodic_life and is_atari(cfg.id, cfg.imports)
        self.fire_after_life_loss = (
            self.episodic_life and atari.fire_reset and "FIRE" in self.envs[0].unwrapped.get_action_meanings()
        )
        n = num_envs
        self.out = layout.env_outputs(self.spec, n)  # the rollout layout's env keys, one row per env
        self._to_env = to_env(self.spec.actions)  # a rollout's action -> env.step's (Box: clipped to bounds)
        self._check_finite = self.spec.actions.kind == BOX  # sampled categories are always in range
        # last_action is what the envs took: a Box action clipped to the bounds (poly's server refuses others).
        self._bounds = box_bounds(self.spec.actions) if self.spec.actions.kind == BOX else None
        self._frame = self.out[FRAME] if self.spec.single else None
        self._return = np.zeros(n, np.float32)
        self._steps = np.zeros(n, np.int32)
        self._lives = np.zeros(n, np.int64)

    def __len__(self) -> int:
        return len(self.envs)

    def initial(self) -> dict:
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=self.seeds[i])
            self._write_obs(i, obs)
            self._lives[i] = self._read_lives(env)
        self.out["done"][:] = True  # the first step starts an episode, like any reset
        return self.out

    def step(self, actions: np.ndarray) -> dict:
        """actions [num_envs, *spec.actions.step_shape]; Box actions non-finite raise actions.ActionError."""
        if self._check_finite:
            check(self.spec.actions, actions, "the policy's actions")
        out = self.out
        if self._bounds is not None:
            np.clip(actions, *self._bounds, out=out["last_action"])
        else:
            out["last_action"][:] = actions
        for i, env in enumerate(self.envs):
            action = self._to_env(actions[i])
            obs, reward, terminated, truncated, _ = env.step(action)
            self._return[i] += reward
            self._steps[i] += 1
            game_over = terminated or truncated
            life_lost = False
            if self.episodic_life and not game_over:
                lives = self._read_lives(env)
                life_lost = lives < self._lives[i]
                self._lives[i] = lives
                if life_lost and self.fire_after_life_loss:
                    obs, extra, terminated, truncated, _ = env.step(1)
                    self._return[i] += extra
                    reward += extra
                    game_over = terminated or truncated
            out["reward"][i] = reward
            out["done"][i] = game_over or life_lost
            out["episode_end"][i] = game_over
            out["episode_return"][i] = self._return[i]
            out["episode_step"][i] = self._steps[i]
            if game_over:
                obs, _ = env.reset()
                self._lives[i] = self._read_lives(env)
                self._return[i] = 0.0
                self._steps[i] = 0
            self._write_obs(i, obs)
        return out

    def restart(self, i: int) -> None:
        """Abandons env i's game and starts a new one (unseeded: not a replay of the first)."""
        obs, _ = self.envs[i].reset()
        self._lives[i] = self._read_lives(self.envs[i])
        self._return[i] = 0.0
        self._steps[i] = 0
        self._write_obs(i, obs)
        self.out["done"][i] = True
        self.out["episode_end"][i] = False

    def _write_obs(self, i: int, obs) -> None:
        if self._frame is not None:  # one array: no loop over leaves
            self._frame[i] = obs
            return
        for leaf in self.spec.leaves:
            self.out[leaf.key][i] = leaf.of(obs)

    @staticmethod
    def _read_lives(env: gym.Env) -> int:
        ale = getattr(env.unwrapped, "ale", None)
        return ale.lives() if ale is not None else 0

    def close(self) -> None:
        for env in self.envs:
            env.close()
