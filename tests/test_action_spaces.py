"""Each action space trained end to end on both backends, to its known optimum: tests/action_envs.py's
envs reward each action dimension that hits a target, so greedy play of a trained policy scores
the best return, EPISODE. And a resume with another action space is refused, naming both."""

import pytest

from torchbeast_hydra.run import checkpoint

from action_envs import EPISODE
from helpers import TESTS, cli_env_with_path, resume_refusal, rows, run_cli

pytestmark = pytest.mark.slow

ENV = cli_env_with_path(TESTS)
BASE = ["experiment=cartpole", "env.imports=[action_envs]", "logger.wandb.mode=disabled", "logger.log_interval_s=1"]


def mean_return(run_dir) -> float:
    return float([row for row in rows(run_dir) if row["mean_episode_return"] is not None][-1]["mean_episode_return"])


@pytest.mark.parametrize(
    "env_id, backend",
    [("PickEach-v0", "mono"), ("PickBits-v0", "poly"), ("Reach-v0", "mono"), ("Reach-v0", "poly")],
)
def test_each_action_space_learns_its_optimum(tmp_path, env_id, backend):
    run_dir = tmp_path / "run"
    steps = 40_000 if env_id == "Reach-v0" else 20_000  # the Gaussian's mean homes in more slowly
    run_cli(run_dir, *BASE, f"env.id={env_id}", f"backend={backend}", f"total_steps={steps}", env=ENV, timeout=300)
    if env_id == "PickEach-v0":  # MultiDiscrete: even sampled play is near the optimum (random: ~3.6)
        assert mean_return(run_dir) >= 0.9 * EPISODE
    result = run_cli(run_dir, *BASE, f"env.id={env_id}", "mode=test", "test.num_episodes=3", env=ENV)
    greedy = float(result.stdout.split("Mean return over 3 episodes: ")[1].split()[0])
    # Greedy play: the categorical kinds' modes hit every target; the Gaussian's mean is within
    # reach of both targets at most steps (random play: ~2; asynchronous training varies run to run).
    assert greedy == EPISODE if env_id != "Reach-v0" else greedy >= 0.7 * EPISODE


def test_a_resume_with_another_action_space_is_refused_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(run_dir, *BASE, "env.id=PickEach-v0", "total_steps=640", env=ENV)
    assert checkpoint.load(checkpoint.path_in(run_dir))["env"]["actions"]["nvec"] == [3, 4, 2]
    refusal = resume_refusal(run_dir, *BASE, "env.id=PickBits-v0", "total_steps=1280")  # in process
    assert "'kind': 'multi_discrete'" in refusal and "'kind': 'multi_binary'" in refusal
