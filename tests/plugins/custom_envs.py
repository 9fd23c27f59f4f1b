"""A user's own envs, registered on import: what `env.imports=[custom_envs]` points the harness at."""

import gymnasium as gym
import numpy as np


class Corridor(gym.Env):
    """Walk right (action 1) to the end of a short corridor; each step right pays 1."""

    def __init__(self, length: int = 8):
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, (length,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.position = 0

    def _obs(self):
        obs = np.zeros(self.length, np.float32)
        obs[self.position] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position = 0
        return self._obs(), {}

    def step(self, action):
        moved = int(action) == 1
        self.position = min(self.position + moved, self.length - 1)
        return self._obs(), float(moved), self.position == self.length - 1, False, {}


class Broken(gym.Env):
    def __init__(self):
        raise ValueError("a bug in the user's env constructor")


gym.register("Corridor-v0", entry_point=Corridor, max_episode_steps=50)
gym.register("Broken-v0", entry_point=Broken)
