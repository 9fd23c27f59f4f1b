"""The run's own checks (its sizes and device) and the config as plain data for checkpoints and
trackers. The run-wide keys themselves are declared in config.py's Config."""

from __future__ import annotations

from omegaconf import OmegaConf

from torchbeast_hydra.errors import require


def to_plain_dict(cfg) -> dict:
    """The resolved config as plain data for checkpoints and trackers, with secrets masked."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if plain.get("backend", {}).get("token"):
        plain["backend"]["token"] = "***"
    return plain


def check(cfg) -> None:
    """The run's top-level sizes and its device."""
    require(cfg.total_steps > 0, f"total_steps={cfg.total_steps} must be positive.")
    require(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be at least 1.")
    require(cfg.unroll_length >= 1, f"unroll_length={cfg.unroll_length} must be at least 1.")
    require(cfg.checkpoint_interval_s > 0, "checkpoint_interval_s must be positive.")
    require(
        cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
        f"device={cfg.device!r}: use auto, cpu, cuda or cuda:N.",
    )
