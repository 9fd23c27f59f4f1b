"""EnvPool's engine (env/pool.py) gives the agent what envs.Environments (gymnasium's wrappers)
gives it, and env.engine (env/engines.py) picks it only where it does.

Atari, with one no-op at a reset and no sticky actions, both engines are deterministic ALE emulation
and every output is identical step by step: frames (max-pooled grayscale, OpenCV's INTER_AREA in
both), stacks starting with copies of a game's first frame, raw rewards, FIRE for an agent step
after a reset and after a lost life (Breakout), `done` on a lost life, `episode_end` and the whole
game's return. What cannot be identical, and why:
- No-op starts: each engine draws a reset's count, from 1 to noop_max, from its own generator
  (gymnasium: the env's np_random; EnvPool: a C++ mt19937 seeded when the pool is made); with
  noop_max=1 both press exactly one. EnvPool cannot press none (noop_max=0 is refused).
- Sticky actions: each ALE draws its repeats from its own generator (seeded from the reset's seed
  in gymnasium, from the pool's in EnvPool); both get repeat_action_probability, 0 here.
- The episode cap: ALE's 108,000 frames count no-op and FIRE frames, EnvPool's 27,000 agent steps
  count FIRE's steps, not no-ops: games that long end up to noop_max frames apart.
MuJoCo, with reset_noise_scale=0 (each engine draws the start's noise from its own generator): the
same start, then the same dynamics in two builds of MuJoCo (gymnasium's `mujoco` package and
EnvPool's own), a few 1e-15 apart at first; contacts amplify that over a few dozen steps (chaos, not
a bug), so observations are compared closely over the first steps, and ends where they stay equal.
"""

import numpy as np
import pytest
from omegaconf import OmegaConf

from torchbeast_hydra.agent.settings import MLPConfig
from torchbeast_hydra.env import engines, pool
from torchbeast_hydra.env.actions import ActionError, box_bounds
from torchbeast_hydra.env.native import AtariVectorEnvs, GymnasiumEnvs
from torchbeast_hydra.env.settings import AtariEnvConfig, Engine, EnvConfig
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.evaluation.evaluate import Rules
from torchbeast_hydra.evaluation.periodic import Player
from torchbeast_hydra.run.seeding import EVAL_SEED_BASE, actor_seed, eval_seed, rank_seed

from helpers import SMALL, rows, run_cli

needs_envpool = pytest.mark.skipif(not pool.installed(), reason='EnvPool is not installed (pip install ".[envpool]")')


def both(cfg: EnvConfig, num_envs: int, seed: int = 3) -> tuple[Environments, pool.EnvPoolEnvironments]:
    return Environments(cfg, num_envs, seed=seed), pool.EnvPoolEnvs(cfg)(num_envs, seed)


def atari(game: str, **settings) -> AtariEnvConfig:
    return AtariEnvConfig(id=f"ALE/{game}-v5", **{"noop_max": 1, "sticky_action_prob": 0.0, **settings})


@pytest.fixture
def without_envpool(monkeypatch):
    monkeypatch.setattr(pool, "installed", lambda: False)


def test_envpool_named_but_not_installed_is_refused_with_the_install_command(without_envpool):
    with pytest.raises(ConfigError, match=r"env.engine=envpool: EnvPool is not installed: pip install .*\[envpool\]"):
        engines.envs_maker(AtariEnvConfig(id="ALE/Pong-v5", engine=Engine.envpool))


@pytest.mark.parametrize(
    "env_id, episodic_life, engine",
    [
        ("ALE/Pong-v5", True, Engine.native),
        ("ALE/Breakout-v5", True, Engine.gymnasium),  # FIRE after a lost life: not the native env
        ("ALE/Breakout-v5", False, Engine.native),
        ("CartPole-v1", True, Engine.gymnasium),
    ],
)
def test_auto_without_envpool_keeps_todays_choice(without_envpool, env_id, episodic_life, engine):
    assert engines.engine_of(AtariEnvConfig(id=env_id, episodic_life=episodic_life)) is engine


def test_the_native_engine_named_where_it_cannot_reproduce_the_config_is_refused():
    with pytest.raises(ConfigError, match="env.engine=native: the game needs FIRE after a lost life"):
        engines.engine_of(AtariEnvConfig(id="ALE/Breakout-v5", engine=Engine.native))
    assert engines.engine_of(AtariEnvConfig(id="ALE/Breakout-v5", engine="gymnasium")) is Engine.gymnasium


@needs_envpool
@pytest.mark.parametrize(
    "cfg, engine",
    [
        (AtariEnvConfig(id="ALE/Pong-v5"), Engine.native),  # ale-py's vector env: faster a core here
        (AtariEnvConfig(id="ALE/Breakout-v5"), Engine.envpool),  # FIRE after a lost life: not native, EnvPool
        (AtariEnvConfig(id="ALE/Breakout-v5", noop_max=0), Engine.gymnasium),  # EnvPool always presses a no-op
        (AtariEnvConfig(id="ALE/Pong-v5", make_kwargs={"mode": 1}), Engine.gymnasium),
        (EnvConfig(id="HalfCheetah-v5"), Engine.envpool),
        (EnvConfig(id="Ant-v5"), Engine.gymnasium),  # steps apart from gymnasium's: EnvPool only when named
        (EnvConfig(id="Hopper-v4", make_kwargs={"reset_noise_scale": 0.0}), Engine.envpool),
        (EnvConfig(id="Hopper-v5", make_kwargs={"width": 64}), Engine.gymnasium),
        (EnvConfig(id="CartPole-v1"), Engine.gymnasium),
    ],
)
def test_auto_picks_the_fastest_engine_that_reproduces_the_config(cfg, engine):
    assert engines.engine_of(cfg) is engine
    maker = engines.envs_maker(cfg)
    makers = {Engine.envpool: pool.EnvPoolEnvs, Engine.native: AtariVectorEnvs, Engine.gymnasium: GymnasiumEnvs}
    assert isinstance(maker, makers[engine])
    assert engines.engine_of(cfg, vector_env=False) is Engine.gymnasium  # backend.vector_env=false


@needs_envpool
@pytest.mark.parametrize(
    "cfg, reason",
    [
        (AtariEnvConfig(id="ALE/Pong-v5", noop_max=0), "env.noop_max must be >= 1"),
        (AtariEnvConfig(id="ALE/Pong-v5", make_kwargs={"mode": 1}), "env.make_kwargs are ALE's arguments"),
        (EnvConfig(id="Hopper-v5", make_kwargs={"width": 64}), r"does not take env.make_kwargs \['width'\]"),
        (EnvConfig(id="CartPole-v1"), "neither an Atari nor a MuJoCo id"),
    ],
)
def test_envpool_named_where_it_cannot_reproduce_the_config_is_refused_with_the_reason(cfg, reason):
    cfg.engine = Engine.envpool
    with pytest.raises(ConfigError, match=f"env.engine=envpool: .*{reason}"):
        engines.envs_maker(cfg)


@needs_envpool
@pytest.mark.parametrize(
    "game, steps",
    [
        ("Pong", 300),  # rewards of +-1, no lives
        ("SpaceInvaders", 300),  # rewards above 1, lives
        ("Breakout", 600),  # FIRE on reset and after each lost life; games end and restart
        ("MsPacman", 600),  # lives, then game over: episode_end and a new game
    ],
)
def test_atari_outputs_are_identical_step_by_step(game, steps):
    ours, pooled = both(atari(game), 2)
    rng = np.random.default_rng(0)
    rewards, life_losses, game_overs = [], 0, 0
    try:
        a, b = ours.initial(), pooled.initial()
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at reset")
        for step in range(1, steps + 1):
            actions = rng.integers(0, ours.spec.actions.nvec[0], 2)
            a, b = ours.step(actions), pooled.step(actions)
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at step {step}")
            rewards.extend(a["reward"])
            life_losses += int((a["done"] & ~a["episode_end"]).sum())
            game_overs += int(a["episode_end"].sum())
    finally:
        ours.close()
        pooled.close()
    rewards = np.abs(rewards)
    assert rewards.max() >= 1
    if game == "SpaceInvaders":
        assert rewards.max() > 1  # neither engine clips
    if game != "Pong":
        assert life_losses >= 1  # done while the game goes on
    if game in ("Breakout", "MsPacman"):
        assert game_overs >= 1


@needs_envpool
def test_atari_settings_reach_envpool():
    cfg = atari("Pong", frame_skip=3, screen_size=64, frame_stack=2, full_action_space=True)
    envs = pool.EnvPoolEnvs(cfg)(1, 0)
    try:
        config = envs.env.config
        assert (config["frame_skip"], config["img_height"], config["stack_num"]) == (3, 64, 2)
        assert config["max_episode_steps"] == 36_000  # ALE/Pong-v5's 108,000 frames
        assert not config["reward_clip"] and not config["episodic_life"]
        assert envs.initial()["frame"].shape == (1, 2, 64, 64)
        assert envs.env.action_space.n == envs.spec.actions.nvec[0] == 18  # the full action set
    finally:
        envs.close()


@needs_envpool
def test_each_initial_starts_the_same_seeded_games_and_restart_a_new_one():
    envs = pool.EnvPoolEnvs(AtariEnvConfig(id="ALE/MsPacman-v5", noop_max=30))(3, seed=7)
    actions = np.random.default_rng(0).integers(0, envs.spec.actions.nvec[0], (40, 3))
    try:
        runs = []
        for _ in range(2):  # as an evaluation plays: initial(), then steps, each time
            frames = [envs.initial()["frame"].copy()]
            frames += [envs.step(a)["frame"].copy() for a in actions]
            runs.append(np.stack(frames))
        np.testing.assert_array_equal(runs[0], runs[1])
        envs.restart(1)
        assert envs.out["done"][1] and not envs.out["episode_end"][1]
        assert envs.step(actions[0])["episode_step"].tolist() == [41, 1, 41]
    finally:
        envs.close()


def mujoco(env_id: str) -> EnvConfig:
    return EnvConfig(id=env_id, make_kwargs={"reset_noise_scale": 0.0})


# v4's pendulums take no reset_noise_scale: their starts are random in each engine's own way.
SAME_STARTS = [f"{task}-v5" for task in pool.TRACKED_MUJOCO] + [
    f"{task}-v4" for task in pool.TRACKED_MUJOCO if "Pendulum" not in task
]


@needs_envpool
@pytest.mark.parametrize("env_id", SAME_STARTS)
def test_mujoco_starts_and_steps_as_gymnasium(env_id):
    ours, pooled = both(mujoco(env_id), 2)
    rng = np.random.default_rng(0)
    low, high = box_bounds(ours.spec.actions)
    try:
        a, b = ours.initial(), pooled.initial()
        assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
        np.testing.assert_array_equal(a["frame"], b["frame"])
        for step in range(1, 21):  # before contacts amplify the builds' differences
            actions = rng.uniform(1.5 * low, 1.5 * high, (2, *ours.spec.actions.step_shape)).astype(np.float32)
            a, b = ours.step(actions), pooled.step(actions)
            np.testing.assert_allclose(a["frame"], b["frame"], atol=1e-9, err_msg=f"step {step}")
            np.testing.assert_allclose(a["reward"], b["reward"], atol=1e-5, err_msg=f"step {step}")
            np.testing.assert_allclose(a["episode_return"], b["episode_return"], atol=1e-4)
            for key in ("done", "episode_end", "episode_step", "last_action"):
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at step {step}")
        assert (low <= b["last_action"]).all() and (b["last_action"] <= high).all()  # clipped, as in Environments
    finally:
        ours.close()
        pooled.close()


@needs_envpool
@pytest.mark.parametrize("env_id, steps", [("HalfCheetah-v5", 1001), ("Hopper-v5", 300)])
def test_mujoco_episodes_end_as_in_gymnasium(env_id, steps):
    """HalfCheetah at its 1,000-step limit; Hopper where it falls (unhealthy), as gymnasium's."""
    ours, pooled = both(mujoco(env_id), 2)
    rng = np.random.default_rng(0)
    ends = []
    try:
        ours.initial(), pooled.initial()
        for _ in range(steps):
            actions = rng.uniform(-1, 1, (2, *ours.spec.actions.step_shape)).astype(np.float32)
            a, b = ours.step(actions), pooled.step(actions)
            np.testing.assert_array_equal(a["episode_end"], b["episode_end"])
            np.testing.assert_array_equal(a["episode_step"], b["episode_step"])
            ends.extend(np.flatnonzero(b["episode_end"]))
        assert ends
        np.testing.assert_allclose(a["frame"], b["frame"], atol=1e-9)  # a new start just after the cap
    finally:
        ours.close()
        pooled.close()


@needs_envpool
def test_nonfinite_box_actions_are_refused():
    envs = pool.EnvPoolEnvs(EnvConfig(id="Hopper-v5"))(2, 0)
    try:
        envs.initial()
        with pytest.raises(ActionError):
            envs.step(np.array([[0.0, np.nan, 0.0], [0.0, 0.0, 0.0]], np.float32))
    finally:
        envs.close()


@needs_envpool
@pytest.mark.parametrize("cfg", [EnvConfig(id="Hopper-v4"), AtariEnvConfig(id="ALE/Breakout-v5")])
def test_evaluation_and_far_actor_seeds_start_envpool_pools(cfg):
    """Evaluation's seeds (2**62 + the run's) and actors' of ranks past the first lie past EnvPool's int32."""
    starts = []
    for seed in (eval_seed(1), eval_seed(1), eval_seed(2), actor_seed(rank_seed(1, 1), 0, 2)):
        envs = engines.evaluation_envs(cfg, 1, seed) if seed >= EVAL_SEED_BASE else pool.EnvPoolEnvs(cfg)(2, seed)
        assert isinstance(envs, pool.EnvPoolEnvironments)
        try:
            starts.append(envs.initial()["frame"][0].copy())
        finally:
            envs.close()
    assert np.array_equal(starts[0], starts[1])  # a run's evaluations play the same starts
    if cfg.id == "Hopper-v4":  # its starts are drawn from the seed (Atari's may all be the same)
        assert not np.array_equal(starts[0], starts[2])  # another run's seed, other starts
    assert pool.pool_seed(5, 2) == 5  # a seed that fits is EnvPool's as it is


@needs_envpool
def test_a_periodic_evaluation_plays_on_envpool_with_gymnasiums_protocol():
    cfg = EnvConfig(id="Hopper-v4")
    model_cfg = OmegaConf.structured(MLPConfig())
    rules = Rules(episodes=2, max_episode_steps=27_000, greedy=True)
    results = []
    for engine in (Engine.auto, Engine.gymnasium):  # auto: EnvPool for Hopper
        cfg.engine = engine
        player = Player(model_cfg, cfg, eval_seed(1))
        try:
            results.append(player.play(player.model.state_dict(), rules))
        finally:
            player.close()
    pooled, gym = results
    assert isinstance(pooled["mean_return"], float) and pooled["episodes"] == 2
    protocol_keys = ("greedy", "epsilon", "sticky_action_prob", "max_episode_steps", "episodic_life", "noop_max")
    assert {k: pooled[k] for k in protocol_keys} == {k: gym[k] for k in protocol_keys}
    assert pooled["max_episode_steps"] == 1000  # Hopper's own cap, not the rule's 27,000


@needs_envpool
def test_evaluations_play_on_envpool_where_it_trains_and_videos_on_gymnasium():
    cfg = AtariEnvConfig(id="ALE/Breakout-v5")  # auto: EnvPool
    envs = engines.evaluation_envs(cfg, 1, seed=0)
    assert isinstance(envs, pool.EnvPoolEnvironments)
    envs.close()
    assert isinstance(engines.evaluation_envs(cfg, 1, 0, render_mode="rgb_array"), Environments)
    cfg.engine = Engine.gymnasium
    assert isinstance(engines.evaluation_envs(cfg, 1, 0), Environments)
    pong = AtariEnvConfig(id="ALE/Pong-v5")  # auto: ale-py's vector env, which cannot restart an env
    assert isinstance(engines.evaluation_envs(pong, 1, 0), Environments)


@needs_envpool
@pytest.mark.parametrize("backend", ["backend=mono", "backend=poly"])  # poly's clients over shared memory
def test_a_breakout_run_steps_envpool_in_the_acting_processes(tmp_path, backend):
    run_dir = tmp_path / "run"
    run_cli(run_dir, backend, "env=breakout", "env.engine=envpool", "total_steps=256", *SMALL, timeout=300)
    assert int(rows(run_dir)[-1]["step"]) >= 256
