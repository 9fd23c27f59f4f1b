"""A few envs stepped in lockstep, reporting what the actor needs each step as arrays of shape
[num_envs, ...], written in place (no per-step allocation): the rollout layout's env keys
(layout.py): frame (or the obs/ leaves), reward, done, episode_return, episode_step, last_action,
episode_end.

Two notions of "end": `done` is what learning sees (a lost life counts when episodic_life is on);
`episode_end` marks the end of the whole game, where `episode_return` is the full game's return
(all lives), as papers report it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from torchbeast_hydra.env import layout
from torchbeast_hydra.env.actions import BOX, box_bounds, check, to_env
from torchbeast_hydra.env.make import is_atari, make_env
from torchbeast_hydra.env.settings import EnvConfig, atari_settings
from torchbeast_hydra.env.spaces import FRAME, env_spec


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

    @property
    def time_limit(self) -> int | None:
        """The env's own cap on an episode's steps (gymnasium's TimeLimit: CartPole-v1's 500), or None."""
        spec = self.envs[0].spec
        return spec.max_episode_steps if spec is not None else None

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
