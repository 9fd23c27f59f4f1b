"""ale-py's native AtariVectorEnv behind Environments' contract: same outputs, same life-loss
semantics (done on a lost life, whole-game returns), and only where it reproduces our envs."""

import numpy as np
import pytest

from torchbeast_hydra.env.engines import envs_maker
from torchbeast_hydra.env.native import AtariVectorEnvs, GymnasiumEnvs, ale_game, vector_env_applies
from torchbeast_hydra.env.settings import AtariEnvConfig, Engine, EnvConfig
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.errors import ConfigError


def test_game_names_follow_ale_py():
    assert ale_game("ALE/SpaceInvaders-v5") == "space_invaders"
    assert ale_game("PongNoFrameskip-v4") == "pong"


@pytest.mark.parametrize(
    "env_id, episodic_life, applies",
    [
        ("ALE/Pong-v5", True, True),  # no lives
        ("ALE/MsPacman-v5", True, True),  # lives, but no FIRE
        ("ALE/Breakout-v5", True, False),  # FIRE after a lost life: only Environments does it
        ("ALE/Breakout-v5", False, True),
        ("CartPole-v1", True, False),
    ],
)
def test_the_native_env_is_used_only_where_it_reproduces_ours(env_id, episodic_life, applies):
    cfg = AtariEnvConfig(id=env_id, episodic_life=episodic_life, engine=Engine.native)
    assert vector_env_applies(cfg) is applies
    if applies:
        assert isinstance(envs_maker(cfg), AtariVectorEnvs)
    else:
        with pytest.raises(ConfigError, match="env.engine=native: "):
            envs_maker(cfg)
        cfg.engine = Engine.gymnasium
        assert isinstance(envs_maker(cfg), GymnasiumEnvs)


def test_outputs_match_environments_in_keys_shapes_and_dtypes():
    cfg = EnvConfig(id="ALE/Pong-v5")
    ours, native = Environments(cfg, 2, seed=1), AtariVectorEnvs(cfg)(2, seed=1)
    try:
        a, b = ours.initial(), native.initial()
        assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
        assert b["done"].all() and b["frame"].any()
        out = native.step(np.array([0, 3]))
        assert out["last_action"].tolist() == [0, 3] and out["episode_step"].tolist() == [1, 1]
    finally:
        ours.close()
        native.close()


def test_a_lost_life_is_done_but_not_the_end_and_returns_span_the_whole_game():
    envs = AtariVectorEnvs(EnvConfig(id="ALE/MsPacman-v5"))(2, seed=5)
    envs.initial()
    rng = np.random.default_rng(0)
    returns, life_losses = np.zeros(2), 0
    try:
        for _ in range(5000):
            out = envs.step(rng.integers(0, envs.spec.actions.nvec[0], 2))
            returns += out["reward"]
            lost = out["done"] & ~out["episode_end"]
            life_losses += lost.sum()
            if out["episode_end"].any():
                i = int(np.flatnonzero(out["episode_end"])[0])
                assert out["episode_return"][i] == returns[i]  # every life's rewards
                assert life_losses >= 2  # MsPacman has 3 lives: lost lives came before the end
                break
        else:
            pytest.fail("no game ended in 5000 steps")
        envs.step(np.zeros(2, np.int64))
        assert envs.out["episode_step"][i] == 1  # a new game started at the end
    finally:
        envs.close()
