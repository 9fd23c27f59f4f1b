"""Shared fixtures: compose configs in-process, and run the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR

# A tiny but complete training run: CartPole with an MLP, two actors, a few updates.
TINY = [
    "experiment=cartpole",
    "total_steps=2560",
    "batch_size=4",
    "unroll_length=16",
    "backend.num_actors=2",
    "backend.envs_per_actor=2",
    "logger.log_interval_s=1",
]


def compose_config(overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, False)
    return cfg


def run_cli(run_dir: Path, *overrides: str, timeout: float = 180, check: bool = True):
    """Runs `python -m torchbeast_hydra` with its run dir at run_dir; returns the CompletedProcess."""
    command = [sys.executable, "-m", "torchbeast_hydra", f"hydra.run.dir={run_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, HYDRA_FULL_ERROR="0"))
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture
def tiny_run(tmp_path):
    """A finished tiny CartPole run; returns its run dir."""
    run_dir = tmp_path / "run"
    run_cli(run_dir, *TINY)
    return run_dir
