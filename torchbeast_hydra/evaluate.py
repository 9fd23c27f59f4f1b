"""Test mode: play a trained run's checkpoint for N episodes and report the returns."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

import gymnasium as gym
import torch
from omegaconf import OmegaConf

from . import checkpoint
from .config import ConfigError, EnvConfig
from .envs import Environments
from .models import make_model, saved_model_config
from .wandb_log import WandbLog

log = logging.getLogger(__name__)


def evaluate(cfg, run_dir: Path) -> dict:
    """Loads run_dir's checkpoint and plays cfg.test.num_episodes full games; returns the figures."""
    state = checkpoint.load(checkpoint.path_in(run_dir))
    # The trained run's env and model, whatever this invocation's defaults say.
    env_cfg = OmegaConf.merge(OmegaConf.structured(EnvConfig), state["config"]["env"])
    model_cfg = saved_model_config(state["config"]["model"])
    record = cfg.test.record_video
    envs = Environments(
        OmegaConf.to_object(env_cfg), 1, seed=cfg.seed, episodic_life=False, render_mode="rgb_array" if record else None
    )
    if record:
        envs.envs[0] = _record_video(envs.envs[0], run_dir / "videos")
    model = make_model(model_cfg, envs.spec)
    model.load_state_dict(state["learner"]["model"])
    model.eval()
    torch.manual_seed(cfg.seed)

    returns, lengths = [], []
    env_output = {key: torch.from_numpy(array).unsqueeze(0) for key, array in envs.initial().items()}
    core_state = model.initial_state(1)
    steps = 0
    started = time.monotonic()
    action = "greedy" if cfg.test.greedy else "sample"
    while len(returns) < cfg.test.num_episodes:
        with torch.no_grad():
            agent_output, core_state = model(env_output, core_state, action=action)
        envs.step(agent_output["action"][0].numpy())
        steps += 1
        timed_out = steps >= cfg.test.max_episode_steps
        if envs.out["episode_end"][0] or timed_out:
            returns.append(float(envs.out["episode_return"][0]))
            lengths.append(int(envs.out["episode_step"][0]))
            log.info(
                "Episode %d: return %.1f in %d steps%s.",
                len(returns),
                returns[-1],
                lengths[-1],
                " (cut at test.max_episode_steps)" if timed_out and not envs.out["episode_end"][0] else "",
            )
            if timed_out:
                envs.initial()
            steps = 0
    envs.close()
    result = dict(
        step=state["step"],
        episodes=len(returns),
        mean_return=sum(returns) / len(returns),
        min_return=min(returns),
        max_return=max(returns),
        mean_length=sum(lengths) / len(lengths),
        greedy=cfg.test.greedy,
        seconds=round(time.monotonic() - started, 2),
    )
    _append_row(run_dir / "eval.csv", result)
    _log_to_wandb(cfg, run_dir, result, list((run_dir / "videos").glob("test-episode-*.mp4")) if record else [])
    print(
        f"Mean return over {len(returns)} episodes: {result['mean_return']:.2f} "
        f"(min {result['min_return']:.1f}, max {result['max_return']:.1f}) at step {state['step']}."
    )
    return result


def _log_to_wandb(cfg, run_dir: Path, result: dict, videos: list) -> None:
    """Adds the evaluation to the trained run's wandb run (its id is kept in run_dir)."""
    # No config, name or tags: they stay the training run's.
    sink = WandbLog(cfg.logger.wandb, run_dir, job_type=None)
    figures = {f"eval/{key}": value for key, value in result.items() if key not in ("step", "greedy")}
    video = {"eval/video": max(videos, key=lambda path: path.stat().st_mtime)} if videos else {}
    sink.log(dict(step=result["step"], **figures), videos=video, summary=figures)
    sink.close()


def _record_video(env: gym.Env, folder: Path) -> gym.Env:
    try:
        import moviepy  # noqa: F401  (RecordVideo needs it)
    except ImportError:
        raise ConfigError(
            "test.record_video=true needs moviepy: pip install -e '.[video]' (or pip install moviepy)."
        ) from None
    return gym.wrappers.RecordVideo(
        env, str(folder), episode_trigger=lambda episode: True, name_prefix="test", disable_logger=True
    )


def _append_row(path: Path, row: dict) -> None:
    new_file = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, list(row))
        if new_file:
            writer.writeheader()
        writer.writerow(row)
