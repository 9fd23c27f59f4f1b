"""The run's own settings (mode=test's protocol) and the config as plain data for checkpoints and
trackers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from torchbeast_hydra.errors import require


@dataclass
class TestConfig:
    """mode=test: how a trained run's checkpoint is played."""

    num_episodes: int = 10  # games played; the mean return is reported
    greedy: bool = True  # argmax actions; false samples from the policy
    record_video: bool = False  # videos/ in the run dir
    # Agent steps before a game is cut: ALE's own cap, 108,000 frames at frame skip 4.
    max_episode_steps: int = 27_000
    # Sticky actions while testing; null: as trained. 0.25 is the Machado et al. (2018) protocol.
    sticky_action_prob: Optional[float] = None


def to_plain_dict(cfg) -> dict:
    """The resolved config as plain data for checkpoints and trackers, with secrets masked."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if plain.get("backend", {}).get("token"):
        plain["backend"]["token"] = "***"
    return plain


def check(cfg) -> None:
    """The run's top-level sizes and the test slice's checks."""
    require(cfg.total_steps > 0, f"total_steps={cfg.total_steps} must be positive.")
    require(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be at least 1.")
    require(cfg.unroll_length >= 1, f"unroll_length={cfg.unroll_length} must be at least 1.")
    require(cfg.checkpoint_interval_s > 0, "checkpoint_interval_s must be positive.")
    require(
        cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
        f"device={cfg.device!r}: use auto, cpu, cuda or cuda:N.",
    )
    test = cfg.test
    require(test.max_episode_steps >= 1, "test.max_episode_steps must be at least 1.")
    require(test.num_episodes >= 1, "test.num_episodes must be at least 1.")
    sticky = test.sticky_action_prob
    require(
        sticky is None or 0 <= sticky <= 1, f"test.sticky_action_prob={sticky} must be in [0, 1] (or null: as trained)."
    )
