"""Many Atari envs stepped by ale-py's native AtariVectorEnv (a C++ thread pool), for env clients.

It reproduces envs.Environments for Atari ids: the same preprocessing done natively (noop
starts, frame skip with max-pooling, grayscale 84x84, a stack of 4, FIRE on reset), the same
outputs [num_envs, ...], `done` on a lost life with episodic_life while the game goes on, and
`episode_return` over the whole game. One thing it cannot do is press FIRE after a lost life
(Environments does, with episodic_life and fire_reset); games that need that (FIRE and lives,
e.g. Breakout) keep the gymnasium path, as does every non-Atari id and any env.make_kwargs.

`envs_maker(cfg)` picks the maker for an env config: this one where it applies, else
envs.Environments.
"""

from __future__ import annotations

import re

import numpy as np

from . import layout
from .config import EnvConfig
from .envs import Environments, EnvSpec, env_spec, is_atari, make_env, probe_env


def ale_game(env_id: str) -> str:
    """'ALE/SpaceInvaders-v5' -> 'space_invaders' (ale-py's ROM name)."""
    name = env_id.split("/")[-1].split("-")[0].removesuffix("NoFrameskip")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class GymnasiumEnvs:
    """envs.Environments, a few gymnasium envs stepped in lockstep."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.spec = probe_env(cfg)

    def __call__(self, num_envs: int, seed: int) -> Environments:
        return Environments(self.cfg, num_envs, seed=seed, episodic_life=self.cfg.episodic_life)


class AtariVectorEnvs:
    """Makes AtariVectorEnvironments for an Atari env config (see vector_env_applies)."""

    def __init__(self, cfg: EnvConfig, num_threads: int = 1):
        self.cfg = cfg
        self.num_threads = num_threads
        self.spec = probe_env(cfg)

    def __call__(self, num_envs: int, seed: int) -> "AtariVectorEnvironments":
        return AtariVectorEnvironments(self.cfg, self.spec, num_envs, seed, self.num_threads)


def _native(cfg: EnvConfig, num_envs: int, num_threads: int):
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(
        ale_game(cfg.id),
        num_envs,
        num_threads=num_threads,
        autoreset_mode="SameStep",
        repeat_action_probability=cfg.sticky_action_prob,
        full_action_space=cfg.full_action_space,
        img_height=cfg.screen_size,
        img_width=cfg.screen_size,
        grayscale=True,
        stack_num=cfg.frame_stack,
        frameskip=cfg.frame_skip,
        maxpool=True,
        noop_max=cfg.noop_max,
        episodic_life=False,
        life_loss_info=False,
        reward_clipping=False,
        use_fire_reset=cfg.fire_reset,
    )


def vector_env_applies(cfg: EnvConfig) -> bool:
    """Whether AtariVectorEnv reproduces Environments for this config (see the module docstring)."""
    if not is_atari(cfg.id) or cfg.make_kwargs:
        return False
    env = make_env(cfg)
    try:
        env.reset(seed=0)
        has_fire = "FIRE" in env.unwrapped.get_action_meanings()
        has_lives = env.unwrapped.ale.lives() > 0
        spec = env_spec(env, cfg.id)
    finally:
        env.close()
    if cfg.episodic_life and cfg.fire_reset and has_fire and has_lives:
        return False  # Environments presses FIRE after a lost life; the native env cannot
    try:
        native = _native(cfg, 1, 1)
    except Exception:  # a game or an option ale-py's vector env does not know
        return False
    try:
        same = bool(
            native.single_observation_space.shape == spec.obs_shape
            and spec.actions.nvec == (native.single_action_space.n,)
        )
    finally:
        native.close()
    return same


def envs_maker(cfg: EnvConfig, num_threads: int = 1):
    """The env maker for a client: AtariVectorEnvs where it applies, else GymnasiumEnvs."""
    return AtariVectorEnvs(cfg, num_threads) if vector_env_applies(cfg) else GymnasiumEnvs(cfg)


class AtariVectorEnvironments:
    """num_envs Atari games in one native vector env, with Environments' outputs and semantics."""

    def __init__(self, cfg: EnvConfig, spec: EnvSpec, num_envs: int, seed: int, num_threads: int):
        self.env = _native(cfg, num_envs, num_threads)
        self.spec = spec
        self.seed = seed
        self.episodic_life = cfg.episodic_life
        n = num_envs
        self.out = layout.env_outputs(spec, n)  # the rollout layout's env keys, as Environments has them
        self._return = np.zeros(n, np.float32)
        self._steps = np.zeros(n, np.int32)
        self._lives = np.zeros(n, np.int64)

    def __len__(self) -> int:
        return len(self.out["reward"])

    def initial(self) -> dict:
        obs, info = self.env.reset(seed=self.seed)
        self.out["frame"] = obs  # no copy: a client encodes each step before it takes the next
        self._lives[...] = info["lives"]
        self.out["done"][:] = True
        return self.out

    def step(self, actions: np.ndarray) -> dict:
        out = self.out
        out["last_action"][:] = actions
        obs, reward, terminated, truncated, info = self.env.step(np.asarray(actions, np.int64))
        lives = np.asarray(info["lives"], np.int64)
        game_over = terminated | truncated
        # A lost life shows as fewer lives while the game goes on (after a game over they are refilled).
        life_lost = (lives < self._lives) & ~game_over if self.episodic_life else np.zeros_like(game_over)
        self._lives[...] = lives
        self._return += reward
        self._steps += 1
        out["reward"][...] = reward
        out["done"][...] = game_over | life_lost
        out["episode_end"][...] = game_over
        out["episode_return"][...] = self._return
        out["episode_step"][...] = self._steps
        self._return[game_over] = 0.0
        self._steps[game_over] = 0
        out["frame"] = obs  # SameStep autoreset: an ended game's first frame of the next
        return out

    def close(self) -> None:
        self.env.close()
