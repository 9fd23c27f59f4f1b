import sys

import numpy as np
import pytest

from torchbeast_hydra.env.make import is_atari, make_env
from torchbeast_hydra.env.settings import AtariEnvConfig, EnvConfig
from torchbeast_hydra.env.spaces import probe_env
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.errors import ConfigError


def test_atari_preprocessing_matches_torchbeast():
    spec = probe_env(EnvConfig(id="ALE/Pong-v5"))
    assert spec.obs_shape == (4, 84, 84)
    assert spec.leaves[0].dtype == np.uint8
    assert spec.actions.nvec[0] == 6  # minimal action set


def test_sticky_actions_are_off_by_default_and_configurable():
    for prob in (0.0, 0.25):
        env = make_env(AtariEnvConfig(id="ALE/Pong-v5", sticky_action_prob=prob))
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(prob)
        env.close()


def test_non_atari_ids_get_no_atari_wrappers():
    assert not is_atari("CartPole-v1")
    spec = probe_env(EnvConfig(id="CartPole-v1"))
    assert spec.obs_shape == (4,) and spec.actions.nvec[0] == 2


def test_unknown_env_id_suggests_close_matches():
    with pytest.raises(ConfigError, match="ALE/Pong-v5"):
        probe_env(EnvConfig(id="ALE/Pongg-v5"))
    with pytest.raises(ConfigError, match="not a registered gymnasium environment"):
        probe_env(EnvConfig(id="NoSuchEnvironment-v0"))


def test_a_family_id_without_its_env_option_names_the_option():
    # The first try: a MiniGrid id on the default env, whose imports do not register it.
    with pytest.raises(ConfigError, match=r"env=minigrid's ids.*env=minigrid env.id=MiniGrid-NoSuchTask-v0"):
        probe_env(EnvConfig(id="MiniGrid-NoSuchTask-v0"))
    with pytest.raises(ConfigError, match=r"env=nethack env.id=NetHackNoSuchTask-v0 .*pip install \"\.\[nethack\]\""):
        probe_env(EnvConfig(id="NetHackNoSuchTask-v0"))
    pytest.importorskip("minigrid")
    # With the family's module imported, an unknown id of it gets the usual close matches.
    with pytest.raises(ConfigError, match="Did you mean MiniGrid-DoorKey-6x6-v0"):
        probe_env(EnvConfig(id="MiniGrid-DoorKey-6x7-v0", imports=["minigrid"]))


def test_box2d_tasks_make_with_the_extra_and_name_it_without(monkeypatch):
    pytest.importorskip("Box2D")
    spec = probe_env(EnvConfig(id="LunarLander-v3"))
    assert spec.obs_shape == (8,) and spec.actions.nvec[0] == 4
    # Without Box2D, gymnasium's advice (swig, then gymnasium[box2d]) gives way to our extra.
    monkeypatch.setitem(sys.modules, "Box2D", None)
    for module in [m for m in sys.modules if m.startswith("gymnasium.envs.box2d")]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ConfigError, match=r'LunarLander-v3.*the box2d extra: pip install "torchbeast_hydra\[box2d\]"'):
        make_env(EnvConfig(id="LunarLander-v3"))


def test_bounded_box_actions_are_accepted_and_clipped_at_the_env():
    spec = probe_env(EnvConfig(id="Pendulum-v1"))
    assert spec.actions.kind == "box" and spec.actions.step_shape == (1,) and spec.actions.high == (2.0,)
    envs = Environments(EnvConfig(id="Pendulum-v1"), 2, seed=0)
    envs.initial()
    out = envs.step(np.array([[100.0], [-0.5]], np.float32))
    assert out["last_action"].tolist() == [[2.0], [-0.5]]  # what the env took (the rollout's action is the sample)
    assert envs.envs[0].unwrapped.last_u == 2.0  # what the env was given: clipped to its bound
    with pytest.raises(ValueError, match=r"not finite .* envs \[1\]"):
        envs.step(np.array([[0.0], [np.nan]], np.float32))
    envs.close()


def test_episodic_life_ends_learning_episodes_but_logs_full_game_return():
    envs = Environments(EnvConfig(id="ALE/Breakout-v5"), 1, seed=3)
    envs.initial()
    rng = np.random.default_rng(0)
    dones, total_reward = 0, 0.0
    for _ in range(20_000):
        out = envs.step(rng.integers(0, envs.spec.actions.nvec[0], size=1))
        total_reward += out["reward"][0]
        dones += int(out["done"][0])
        if out["episode_end"][0]:
            break
    assert out["episode_end"][0], "a random Breakout game should end within 20k steps"
    assert dones == 5  # one per life: Breakout has five
    assert out["episode_return"][0] == pytest.approx(total_reward)
    # After the game ends, the next game starts from zero.
    out = envs.step(np.zeros(1, np.int64))
    assert out["episode_step"][0] == 1 and out["episode_return"][0] == out["reward"][0]
    envs.close()


def test_environments_step_in_lockstep_with_preallocated_outputs():
    envs = Environments(EnvConfig(id="CartPole-v1"), 3, seed=0)
    first = envs.initial()
    assert first["done"].all() and first["frame"].shape == (3, 4)
    frame_buffer = first["frame"]
    out = envs.step(np.array([0, 1, 0]))
    assert out["frame"] is frame_buffer  # written in place: no per-step allocation
    assert (out["last_action"] == [0, 1, 0]).all()
    assert (out["episode_step"] == 1).all() and not out["done"].any()
    envs.close()


def test_seeds_make_env_outputs_reproducible():
    def trajectory():
        envs = Environments(EnvConfig(id="ALE/Pong-v5"), 1, seed=7)
        frames = [envs.initial()["frame"].copy()]
        for action in [1, 2, 3, 0, 2] * 4:
            frames.append(envs.step(np.array([action]))["frame"].copy())
        envs.close()
        return np.stack(frames)

    assert np.array_equal(trajectory(), trajectory())
