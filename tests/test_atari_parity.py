"""The two Atari env makers give the agent the same thing for the same env config: env.vector.Environments
(gymnasium wrappers: mono actors, evaluation, plain poly clients) and env.native's
AtariVectorEnvironments (ale-py's native AtariVectorEnv: poly clients).

With no-op starts and FIRE on reset off and no sticky actions both are deterministic ALE emulation,
and every output is identical step by step: frames (max-pooled grayscale, resized by OpenCV's
INTER_AREA in both: not a pixel apart), stacks (a new game's stack holds copies of its first frame
in both), raw rewards, `done` on a lost life, `episode_end` and the whole game's return.

Where they cannot be identical, and what is compared instead:
- No-op starts: each env draws its count from its own random generator (gymnasium: the env's
  np_random; ale-py: a C++ mt19937), and ale-py 0.12 draws from [0, noop_max - 1] where gymnasium
  draws from [1, noop_max]. Both get env.noop_max, and both start games at varied frames.
- FIRE on reset: ale-py presses FIRE for one emulator frame (in place of a no-op), Environments for
  one agent step (frame_skip frames, as TorchBeast's FireResetEnv): their games run frame_skip - 1
  frames apart. Both get env.fire_reset, and in both it serves Breakout's ball.
- Sticky actions: each ALE draws its repeats from its own generator; both get the same
  repeat_action_probability.
"""

import gymnasium as gym
import numpy as np
import pytest

from torchbeast_hydra.env.make import make_env
from torchbeast_hydra.env.native import AtariVectorEnvironments, AtariVectorEnvs, _native, native_kwargs
from torchbeast_hydra.env.settings import AtariEnvConfig
from torchbeast_hydra.env.vector import Environments


def both(cfg: AtariEnvConfig, num_envs: int, seed: int = 3) -> tuple[Environments, AtariVectorEnvironments]:
    return Environments(cfg, num_envs, seed=seed), AtariVectorEnvs(cfg)(num_envs, seed=seed)


def wrapper(env: gym.Env, kind: type) -> gym.Wrapper:
    while not isinstance(env, kind):
        env = env.env
    return env


def test_both_makers_get_the_same_settings():
    cfg = AtariEnvConfig(
        id="ALE/Pong-v5",
        noop_max=7,
        frame_skip=3,
        screen_size=64,
        frame_stack=2,
        sticky_action_prob=0.25,
        full_action_space=True,
    )
    env, native = make_env(cfg), _native(cfg, 1, 1)
    try:
        kwargs = native_kwargs(cfg)
        preprocessing = wrapper(env, gym.wrappers.AtariPreprocessing)
        assert preprocessing.noop_max == kwargs["noop_max"] == 7
        assert preprocessing.frame_skip == kwargs["frameskip"] == 3
        assert wrapper(env, gym.wrappers.FrameStackObservation).stack_size == kwargs["stack_num"] == 2
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
        assert kwargs["repeat_action_probability"] == 0.25
        assert not kwargs["reward_clipping"]  # raw rewards: the learner clips, once
        space = native.single_observation_space
        assert (env.observation_space.shape, env.observation_space.dtype) == (space.shape, space.dtype)
        assert space.shape == (2, 64, 64) and space.dtype == np.uint8
        assert env.action_space.n == native.single_action_space.n == 18  # the full action set
    finally:
        env.close()
        native.close()


@pytest.mark.parametrize(
    "game, steps",
    [
        ("Pong", 300),  # rewards of +-1, no lives
        ("SpaceInvaders", 300),  # rewards above 1, lives
        ("Seaquest", 300),  # rewards above 1, lives
        ("MsPacman", 600),  # lives, then game over: episode_end and a new game
    ],
)
def test_outputs_are_identical_step_by_step(game, steps):
    cfg = AtariEnvConfig(id=f"ALE/{game}-v5", noop_max=0, fire_reset=False, sticky_action_prob=0.0)
    ours, native = both(cfg, 2)
    rng = np.random.default_rng(0)
    rewards, life_losses, game_overs = [], 0, 0
    try:
        a, b = ours.initial(), native.initial()
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at reset")
        for step in range(1, steps + 1):
            before = a["frame"].copy()
            actions = rng.integers(0, ours.spec.actions.nvec[0], 2)
            a, b = ours.step(actions), native.step(actions)
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at step {step}")
            going_on = ~a["episode_end"]
            # The stack shifts by one frame a step (a new game starts its own).
            np.testing.assert_array_equal(a["frame"][going_on, :-1], before[going_on, 1:])
            rewards.extend(a["reward"])
            life_losses += int((a["done"] & going_on).sum())
            game_overs += int(a["episode_end"].sum())
    finally:
        ours.close()
        native.close()
    rewards = np.abs(rewards)
    assert rewards.max() >= 1
    if game in ("SpaceInvaders", "Seaquest"):
        assert rewards.max() > 1  # neither maker clips
    if game != "Pong":
        assert life_losses >= 1  # done while the game goes on
    if game == "MsPacman":
        assert game_overs >= 1


def first_frame_numbers(cfg: AtariEnvConfig, num_envs: int) -> tuple[list, list]:
    """The emulator frames each maker's games start at (no-ops, and FIRE where pressed)."""
    ours = Environments(cfg, num_envs, seed=1)
    native = _native(cfg, num_envs, 1)
    try:
        ours.initial()
        _, info = native.reset(seed=1)
        return [env.unwrapped.ale.getEpisodeFrameNumber() for env in ours.envs], list(info["episode_frame_number"])
    finally:
        ours.close()
        native.close()


def test_noop_starts_vary_where_games_begin_in_both():
    cfg = AtariEnvConfig(id="ALE/Pong-v5", fire_reset=False, noop_max=0)
    assert first_frame_numbers(cfg, 2) == ([0, 0], [0, 0])
    cfg.noop_max = 30
    ours, native = first_frame_numbers(cfg, 6)
    assert all(1 <= frame <= 30 for frame in ours) and all(0 <= frame <= 30 for frame in native)
    assert len(set(ours)) > 2 and len(set(native)) > 2


@pytest.mark.parametrize("fire_reset", [True, False])
def test_fire_on_reset_serves_breakouts_ball_in_both(fire_reset):
    # A policy that never presses FIRE loses a life only if the ball was served.
    cfg = AtariEnvConfig(id="ALE/Breakout-v5", noop_max=0, fire_reset=fire_reset)
    first_life_lost = []
    for envs in both(cfg, 1):
        envs.initial()
        steps = [step for step in range(300) if envs.step(np.zeros(1, np.int64))["done"][0]]
        envs.close()
        first_life_lost.append(steps[0] if steps else None)
    if fire_reset:
        ours, native = first_life_lost
        assert ours is not None and native is not None and abs(ours - native) <= 1
    else:
        assert first_life_lost == [None, None]
