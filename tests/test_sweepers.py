"""Hydra sweepers optimise what a job returns (eval.objective; here `train`: a tiny run's greedy final
evaluations all score alike, its training returns do not), and mode=test's evaluation."""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR, run
from torchbeast_hydra.evaluation import evaluate
from torchbeast_hydra.logs.metrics import read_rows

from helpers import TINY, run_sweep


def job_return(job_dir):
    """What a finished training job returns with eval.objective=train: the mean of its last 100
    episode returns (logs.csv)."""
    returns = [r for row in read_rows(job_dir) for r in row["episode_returns"]][-100:]
    return sum(returns) / len(returns)


@pytest.mark.slow
def test_optuna_preset_maximises_the_returned_mean_return(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep,
        *TINY,
        "backend.num_actors=1",
        "eval.objective=train",
        "hydra/sweeper=lr_entropy",
        "hydra.sweeper.n_trials=2",
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = [d for d in sweep.iterdir() if d.is_dir() and (d / "logs.csv").exists()]
    assert len(jobs) == 2
    returns = {job: job_return(job) for job in jobs}
    assert len(set(returns.values())) == 2, "two different settings, two different returns"

    results = OmegaConf.load(sweep / "optimization_results.yaml")
    best = max(returns, key=returns.get)
    assert math.isclose(results.best_value, returns[best], rel_tol=1e-9)
    params = dict(item.split("=", 1) for item in OmegaConf.load(best / ".hydra" / "overrides.yaml"))
    assert set(results.best_params) == {"optim.learning_rate", "vtrace.entropy_cost"}
    for key, value in results.best_params.items():
        assert math.isclose(float(params[key]), value), key
        assert 1e-4 <= value <= (3e-3 if key.startswith("optim") else 0.05)


def test_mode_test_returns_the_mean_evaluation_return(tiny_run, tmp_path, monkeypatch):
    threads_while_playing = []
    real_play = evaluate.play

    def play(*args, **kwargs):
        threads_while_playing.append(torch.get_num_threads())
        return real_play(*args, **kwargs)

    monkeypatch.setattr(evaluate, "play", play)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "config", [*TINY, "mode=test", f"load_dir={tiny_run}", "test.num_episodes=3"], return_hydra_config=True
        )
    cfg.hydra.runtime.output_dir = str(tmp_path / "test")
    HydraConfig.instance().set_config(cfg)
    try:
        value = run(cfg)
    finally:
        HydraConfig.instance().cfg = None  # later tests run outside any Hydra job
        restored, _ = torch.get_num_threads(), torch.set_num_threads(threads)
    # One thread while playing (a busy machine's spin-waits), the caller's count back after.
    assert threads_while_playing == [1] and restored == 2
    with open(tmp_path / "test" / "eval.csv") as f:
        logged = float(f.read().splitlines()[-1].split(",")[2])  # step,episodes,mean_return,...
    assert value == pytest.approx(logged, abs=0.01) and value >= 8  # CartPole lasts 8+ steps
