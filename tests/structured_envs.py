"""A test env whose observation nests every array space in Dict and Tuple, with a Text leaf beside
them; registered as Structured-v0 (import this module through env.imports)."""

import gymnasium as gym
import numpy as np

SPACE = gym.spaces.Dict(
    {
        "image": gym.spaces.Box(0, 255, (5, 5, 3), np.uint8),
        "position": gym.spaces.Discrete(6, start=1),
        "inner": gym.spaces.Tuple(
            (gym.spaces.MultiBinary(3), gym.spaces.MultiDiscrete([2, 3]), gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
        ),
        "note": gym.spaces.Text(8),
    }
)
KEPT = ["image", "position", "inner"]  # env.obs_keys that leaves out the Text


class Structured(gym.Env):
    """Walk right to cell 6; the observation says where in every leaf. Moving right pays 1."""

    observation_space = SPACE
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cell = 1
        return self._obs(), {}

    def step(self, action):
        self.cell = min(self.cell + int(action), 6)
        return self._obs(), float(action), self.cell == 6, False, {}

    def _obs(self):
        c = self.cell
        return {
            "image": np.full((5, 5, 3), 40 * c, np.uint8),
            "position": c,
            "inner": (
                np.array([c % 2, 1, 0], np.int8),
                np.array([c % 2, c % 3], np.int64),
                np.array([c / 6, -c / 6], np.float32),
            ),
            "note": "x" * c,
        }


gym.register("Structured-v0", entry_point=Structured, max_episode_steps=30)
