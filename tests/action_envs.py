"""Tiny envs with each kind of action space and a known optimum, for the action-space tests.

Each step rewards how many of the action's dimensions hit a fixed target (a mean in [0, 1]); an
episode lasts EPISODE steps, so the best return is EPISODE. Registered on import (env.imports).
"""

import gymnasium as gym
import numpy as np

EPISODE = 10


class TargetEnv(gym.Env):
    """Rewards the fraction of action dimensions equal (Box: within 0.25) to TARGET."""

    def __init__(self, action_space: gym.Space, target):
        self.action_space = action_space
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.target = np.asarray(target)
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self._obs(), {}

    def step(self, action):
        assert self.action_space.contains(action), action  # what the harness sends must fit the space
        self.steps += 1
        if isinstance(self.action_space, gym.spaces.Box):
            hits = np.abs(np.asarray(action) - self.target) < 0.25
        else:
            hits = np.asarray(action) == self.target
        return self._obs(), float(np.mean(hits)), self.steps >= EPISODE, False, {}

    def _obs(self):
        return np.array([self.steps / EPISODE, 1.0], np.float32)


gym.register("PickEach-v0", entry_point=lambda: TargetEnv(gym.spaces.MultiDiscrete([3, 4, 2]), [2, 0, 1]))
gym.register("PickBits-v0", entry_point=lambda: TargetEnv(gym.spaces.MultiBinary(4), [1, 0, 1, 1]))
gym.register("Reach-v0", entry_point=lambda: TargetEnv(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), [0.5, -0.5]))
gym.register("PickOne-v0", entry_point=lambda: TargetEnv(gym.spaces.Discrete(3, start=1), 3))
gym.register("Typing-v0", entry_point=lambda: TargetEnv(gym.spaces.Text(5), "hello"))
gym.register("Unbounded-v0", entry_point=lambda: TargetEnv(gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), 0))
