"""Many Atari envs stepped by ale-py's native AtariVectorEnv (a C++ thread pool), for env clients.

It reproduces envs.Environments for Atari ids: the same preprocessing done natively, from the
same settings (config.atari_settings, through native_kwargs: no-op starts, frame skip with
max-pooling, grayscale screen_size^2 frames, a stack of frame_stack that starts with copies of a
game's first frame, FIRE on reset, sticky actions), the same outputs [num_envs, ...] with raw
rewards (the learner clips), `done` on a lost life with episodic_life while the game goes on,
and `episode_return` over the whole game. tests/test_atari_parity.py compares the two step by
step: identical without no-op starts and FIRE on reset; its docstring says why those two differ
(random no-op counts from other generators; FIRE lasts one frame here, one agent step there).
One thing it cannot do is press FIRE after a lost life (Environments does, with episodic_life
and fire_reset); games that need that (FIRE and lives, e.g. Breakout) keep the gymnasium path,
as does every non-Atari id and any env.make_kwargs.

env/engines.py picks the engine for an env config (env.engine).
"""

from __future__ import annotations

import re

import numpy as np

from torchbeast_hydra.env import layout
from torchbeast_hydra.env.make import is_atari, make_env
from torchbeast_hydra.env.settings import EnvConfig, atari_settings
from torchbeast_hydra.env.spaces import EnvSpec, env_spec, probe_env
from torchbeast_hydra.env.vector import Environments


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
        return Environments(self.cfg, num_envs, seed=seed)


class AtariVectorEnvs:
    """Makes AtariVectorEnvironments for an Atari env config (see vector_env_applies)."""

    def __init__(self, cfg: EnvConfig, num_threads: int = 1):
        self.cfg = cfg
        self.num_threads = num_threads
        self.spec = probe_env(cfg)

    def __call__(self, num_envs: int, seed: int) -> "AtariVectorEnvironments":
        return AtariVectorEnvironments(self.cfg, self.spec, num_envs, seed, self.num_threads)


def native_kwargs(cfg: EnvConfig) -> dict:
    """AtariVectorEnv's preprocessing arguments for an env config: envs.make_env's, natively."""
    atari = atari_settings(cfg)
    return dict(
        repeat_action_probability=atari.sticky_action_prob,
        full_action_space=atari.full_action_space,
        img_height=atari.screen_size,
        img_width=atari.screen_size,
        grayscale=True,
        stack_num=atari.frame_stack,
        frameskip=atari.frame_skip,
        maxpool=True,
        noop_max=atari.noop_max,
        episodic_life=False,  # a lost life is `done` here (AtariVectorEnvironments), never a reset
        life_loss_info=False,
        reward_clipping=False,  # raw rewards, as Environments gives them: the learner clips
        use_fire_reset=atari.fire_reset,
    )


def _native(cfg: EnvConfig, num_envs: int, num_threads: int):
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(
        ale_game(cfg.id), num_envs, num_threads=num_threads, autoreset_mode="SameStep", **native_kwargs(cfg)
    )


def refusal(cfg: EnvConfig) -> str | None:
    """Why AtariVectorEnv cannot reproduce Environments for this config (see the module
    docstring), or None where it can."""
    if not is_atari(cfg.id, cfg.imports):
        return f"env.id={cfg.id!r} is not an Atari id; ale-py's vector env runs Atari games only"
    if cfg.make_kwargs:
        return "ale-py's vector env does not take env.make_kwargs"
    env = make_env(cfg)
    try:
        env.reset(seed=0)
        has_fire = "FIRE" in env.unwrapped.get_action_meanings()
        has_lives = env.unwrapped.ale.lives() > 0
        spec = env_spec(env, cfg)
    finally:
        env.close()
    atari = atari_settings(cfg)
    if atari.episodic_life and atari.fire_reset and has_fire and has_lives:
        return (
            "the game needs FIRE after a lost life (env.episodic_life, env.fire_reset), "
            "which ale-py's vector env cannot press"
        )
    try:
        native = _native(cfg, 1, 1)
    except Exception as error:  # a game or an option ale-py's vector env does not know
        return f"ale-py's vector env cannot make it ({error})"
    try:
        same = bool(
            spec.single
            and native.single_observation_space.shape == spec.obs_shape
            and spec.actions.nvec == (native.single_action_space.n,)
        )
    finally:
        native.close()
    return None if same else "ale-py's vector env gives other observation or action spaces"


def vector_env_applies(cfg: EnvConfig) -> bool:
    """Whether AtariVectorEnv reproduces Environments for this config (see the module docstring)."""
    return refusal(cfg) is None


def _pad_with_first_frame(frames: np.ndarray, steps: np.ndarray) -> None:
    """Fills the stack slots before a game's first frame with that frame, in place, as gymnasium's
    FrameStackObservation (and TorchBeast's FrameStack) do; ale-py 0.12 leaves them zero.

    frames: [num_envs, frame_stack, H, W]; steps: agent steps since each env's game started.
    """
    stack = frames.shape[1]
    for i in np.flatnonzero(steps < stack - 1):  # only games a few steps old
        first = stack - 1 - steps[i]
        frames[i, :first] = frames[i, first]


class AtariVectorEnvironments:
    """num_envs Atari games in one native vector env, with Environments' outputs and semantics."""

    def __init__(self, cfg: EnvConfig, spec: EnvSpec, num_envs: int, seed: int, num_threads: int):
        self.env = _native(cfg, num_envs, num_threads)
        self.spec = spec
        self.seed = seed
        self.episodic_life = atari_settings(cfg).episodic_life
        n = num_envs
        self.out = layout.env_outputs(spec, n)  # the rollout layout's env keys, as Environments has them
        self._return = np.zeros(n, np.float32)
        self._steps = np.zeros(n, np.int32)
        self._lives = np.zeros(n, np.int64)

    def __len__(self) -> int:
        return len(self.out["reward"])

    def initial(self) -> dict:
        obs, info = self.env.reset(seed=self.seed)
        self._steps[...] = 0
        _pad_with_first_frame(obs, self._steps)
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
        _pad_with_first_frame(obs, self._steps)
        out["frame"] = obs  # SameStep autoreset: an ended game's first frame of the next
        return out

    def close(self) -> None:
        self.env.close()
