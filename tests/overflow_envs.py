"""A control-like test env (float64 observations, Box actions in [-3, 3], as MuJoCo's
InvertedPendulum-v5) whose simulator blows up now and then: at the 5th step of every episode one
observation entry is 1e300, finite in float64 and far beyond float32's range. Registered on import
as Overflowing-v0 (env.imports=[overflow_envs])."""

import gymnasium as gym
import numpy as np

BLOW_UP_STEP, EPISODE, VALUE = 5, 10, 1e300


class Overflowing(gym.Env):
    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)
    action_space = gym.spaces.Box(-3.0, 3.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self._obs(), {}

    def step(self, action):
        self.steps += 1
        return self._obs(), 1.0, self.steps >= EPISODE, False, {}

    def _obs(self):
        obs = np.full(4, self.steps / EPISODE)
        if self.steps == BLOW_UP_STEP:
            obs[2] = VALUE
        return obs


gym.register("Overflowing-v0", entry_point=Overflowing)
