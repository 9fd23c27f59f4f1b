"""Test mode plays as the agent was trained and scores whole games (evaluate.play, in process)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.evaluation.evaluate import Rules, _append_row, eval_env_config, play, protocol
from torchbeast_hydra.run.seeding import eval_seed

from helpers import compose_config, csv_dicts, run_cli


class FixedPolicy(torch.nn.Module):
    """Always the same action; remembers what it was shown (a stand-in for a trained model)."""

    def __init__(self, action: int):
        super().__init__()
        self.action = action
        self.seen = []

    def initial_state(self, batch_size=1):
        return ()

    def forward(self, inputs, core_state=(), action="greedy"):
        self.seen.append({key: value.clone() for key, value in inputs.items()})
        return dict(action=torch.full((1, 1), self.action)), core_state


class Rally(gym.Env):
    """A rally no one wins while action 0 is played: action 1 ends the game with a point. An argmax
    policy stuck on 0 plays it forever, as a greedy Pong policy can on a deterministic emulator."""

    action_space = gym.spaces.Discrete(2)
    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), float(action == 1), action == 1, False, {}


gym.register("Rally-v0", entry_point=Rally)


def breakout_eval_envs(*overrides):
    cfg = compose_config(["mode=test", *overrides])
    state = dict(config=dict(env=dict(id="ALE/Breakout-v5"), model={}))
    env_cfg = eval_env_config(cfg, state)
    return env_cfg, Environments(env_cfg, 1, seed=0)


def test_a_policy_that_never_fires_still_finishes_breakout_games():
    # Trained with episodic life, the agent never had to press FIRE after losing a life; test mode
    # must do it for it, as training did, or the ball is never served again and the game stalls.
    _, envs = breakout_eval_envs()
    policy = FixedPolicy(action=0)  # NOOP
    returns, lengths = play(policy, envs, Rules(episodes=1))
    envs.close()
    assert lengths[0] < 5_000  # over by game over (all five lives), not by the cap
    dones = [bool(step["done"][0, 0]) for step in policy.seen]
    assert sum(dones[1:]) == 4  # each of the first four lost lives ends an episode for the model


def test_sticky_actions_for_evaluation_only():
    env_cfg, envs = breakout_eval_envs("test.sticky_action_prob=0.25")
    ale = envs.envs[0].unwrapped.ale
    assert env_cfg.sticky_action_prob == 0.25
    assert ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
    envs.close()
    env_cfg, envs = breakout_eval_envs()
    assert envs.envs[0].unwrapped.ale.getFloat("repeat_action_probability") == 0.0
    envs.close()


def test_a_cut_game_is_not_replayed():
    envs = Environments(EnvConfig(id="CartPole-v1"), 1, seed=0)
    policy = FixedPolicy(action=0)
    returns, lengths = play(policy, envs, Rules(episodes=3, max_episode_steps=3))
    envs.close()
    assert lengths == [3, 3, 3] and returns == [3.0, 3.0, 3.0]
    starts = [step["frame"][0, 0].numpy() for step in policy.seen if step["done"][0, 0]]
    assert len(starts) == 3
    assert not np.allclose(starts[0], starts[1]) and not np.allclose(starts[1], starts[2])


def test_epsilon_greedy_play_ends_a_rally_that_greedy_play_never_ends():
    envs = Environments(EnvConfig(id="Rally-v0"), 1, seed=0)
    returns, lengths = play(FixedPolicy(action=0), envs, Rules(episodes=3, max_episode_steps=200))
    assert returns == [0.0] * 3 and lengths == [200] * 3  # cut at the cap, every game
    rules = Rules(episodes=20, max_episode_steps=200, epsilon=0.1)
    runs = [play(FixedPolicy(action=0), envs, rules, seed) for seed in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2], "the random actions follow the seed"
    returns, lengths = runs[0]
    # A random action is 1 half the time: a game lasts ~20 steps (0.05 a step), none reaches the cap.
    assert returns == [1.0] * 20 and max(lengths) < 200 and 10 < np.mean(lengths) < 40
    # Sampled play is left as it is (epsilon is for argmax play), so it stays stuck too.
    assert play(FixedPolicy(action=0), envs, Rules(1, 50, greedy=False, epsilon=1.0)) == ([0.0], [50])
    envs.close()


def test_eval_csv_keeps_old_rows_when_columns_are_added(tmp_path):
    path = tmp_path / "eval.csv"
    _append_row(path, dict(step=1, mean_return=2.0))
    _append_row(path, dict(step=2, mean_return=3.0, sticky_action_prob=0.25))
    rows = csv_dicts(path)
    assert [row["step"] for row in rows] == ["1", "2"]
    assert rows[0]["sticky_action_prob"] == "" and rows[1]["sticky_action_prob"] == "0.25"


# mode=test of the session's tiny run, played once (tests/conftest.py's tiny_test_run): two games, each
# recorded, with no display or desktop session; the tests below each check one thing of it.


def test_test_mode_leaves_the_trained_run_dir_as_it_was(tiny_run, tiny_test_run):
    assert tiny_test_run.after == tiny_test_run.before, "the trained run's dir is only read"
    assert not (tiny_run / "videos").exists()


def test_test_mode_writes_into_its_own_run_dir(tiny_run, tiny_test_run):
    test_dir, result = tiny_test_run.dir, tiny_test_run.result
    assert (test_dir / "trained_run").resolve() == tiny_run.resolve()
    (row,) = csv_dicts(test_dir / "eval.csv")
    assert int(row["episodes"]) == 2 and float(row["std_return"]) >= 0
    assert float(row["mean_return"]) > 0  # CartPole pays each step the pole stays up
    # CartPole-v1's own 500-step limit cuts its games, not test.max_episode_steps (27,000, Atari's).
    assert row["max_episode_steps"] == "500" and row["greedy"] == "True" and row["epsilon"] == "0.0"
    assert row["trained_run"] == str(tiny_run.resolve())
    assert int(row["seed"]) == eval_seed(1)  # an evaluation env's seed (the default seed=1), no training env's
    # The summary goes through logging: to the console and to the test run's log file.
    summary = f"Mean return over 2 episodes: {float(row['mean_return']):.2f} ± "
    assert summary in result.stdout
    log = (test_dir / "torchbeast.log").read_text()
    assert summary in log and str(tiny_run.resolve()) in log


def test_video_recording_is_quiet_without_a_display_or_session(tiny_test_run):
    videos = list((tiny_test_run.dir / "videos").glob("*.mp4"))
    assert len(videos) == 2, videos  # one video a game (not one for the reset after the last)
    assert all(video.stat().st_size > 1000 for video in videos)
    assert "error" not in (tiny_test_run.result.stdout + tiny_test_run.result.stderr).lower()


def test_test_mode_started_in_a_trained_run_dir_plays_it(tiny_run_copy):
    run_cli(tiny_run_copy, "experiment=cartpole", "mode=test", "test.num_episodes=1")
    final, test = csv_dicts(tiny_run_copy / "eval.csv")  # training's final evaluation, then the test's
    assert final["final"] == "True" and test["final"] == ""
    assert int(test["episodes"]) == 1 and not (tiny_run_copy / "trained_run").exists()


def test_test_mode_without_a_trained_run_says_to_set_load_dir(tmp_path):
    result = run_cli(tmp_path / "eval", "experiment=cartpole", "mode=test", check=False)
    assert result.returncode == 2 and "set load_dir=RUN_DIR" in result.stdout + result.stderr


def test_a_job_dir_of_a_sweep_is_a_load_dir_as_the_launcher_named_it():
    from torchbeast_hydra.__main__ import quote_paths

    assert (
        quote_paths("load_dir=out/sweep/env.id=CartPole-v1,seed=1") == "load_dir='out/sweep/env.id=CartPole-v1,seed=1'"
    )
    assert quote_paths("load_dir=outputs/2026-11-25/10-00-00") == "load_dir=outputs/2026-11-25/10-00-00"
    assert quote_paths("load_dir='a=b'") == "load_dir='a=b'"  # quoted already
    assert quote_paths("seed=1") == "seed=1"


def test_test_mode_takes_a_job_dir_or_a_whole_sweep(tiny_sweep, tmp_path):
    jobs = sorted(p.name for p in tiny_sweep.iterdir() if (p / "checkpoint.pt").exists())
    assert len(jobs) == 4
    test = ["experiment=cartpole", "mode=test", "test.num_episodes=1"]
    job = "optim.learning_rate=0.001,seed=1"
    run_cli(tmp_path / "one", *test, f"load_dir={tiny_sweep}/{job}")  # unquoted, as the launcher named it
    assert (tmp_path / "one" / "trained_run").resolve() == (tiny_sweep / job).resolve()
    run_cli(tmp_path / "all", *test, f"load_dir={tiny_sweep}")
    for job in jobs:
        (row,) = csv_dicts(tmp_path / "all" / job / "eval.csv")
        assert row["trained_run"] == str((tiny_sweep / job).resolve()) and int(row["episodes"]) == 1


def test_protocol_records_the_cap_that_cuts_the_games():
    """eval.csv's max_episode_steps is where games end: CartPole-v1's own 500-step limit, not
    test.max_episode_steps (ALE's 27,000), unless that comes first."""
    envs = Environments(EnvConfig(id="CartPole-v1"), 1, seed=0)
    try:
        cfg = EnvConfig(id="CartPole-v1")
        assert protocol(cfg, envs, Rules(episodes=1))["max_episode_steps"] == 500
        assert protocol(cfg, envs, Rules(episodes=1, max_episode_steps=50))["max_episode_steps"] == 50
    finally:
        envs.close()
