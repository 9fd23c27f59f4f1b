"""What the tests share: configs composed in process, the CLI run in a subprocess, run dirs and
processes read back. Tests import from here; tests/conftest.py holds only fixtures and hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR
from torchbeast_hydra.logs.metrics import read_rows

REPO = Path(__file__).resolve().parent.parent

# Small enough for any env to train a few updates in seconds: add the env and total_steps.
SMALL = [
    "batch_size=4",
    "unroll_length=16",
    "backend.num_actors=2",
    "backend.envs_per_actor=2",
    "logger.log_interval_s=1",
    "logger.wandb.mode=disabled",  # tests/test_wandb.py covers wandb
]
# A tiny but complete training run: CartPole with an MLP, two actors, a few updates.
TINY = ["experiment=cartpole", "total_steps=2560", *SMALL]


def compose_config(overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, False)
    return cfg


def cli_env(**extra: str | None) -> dict:
    """The CLI's environment in tests: never real wandb credentials; wandb off unless asked.

    extra: variables to set, or to remove (None).
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(HYDRA_FULL_ERROR="0", WANDB_MODE="disabled", NETRC=os.devnull)
    env.update(extra)
    return {key: value for key, value in env.items() if value is not None}


def run_cli(
    run_dir: Path,
    *overrides: str,
    timeout: float = 180,
    check: bool = True,
    env: dict | None = None,
    multirun: bool = False,
):
    """Runs `python -m torchbeast_hydra` with its run dir at run_dir; returns the CompletedProcess.

    multirun: `-m`, with run_dir as the sweep dir.
    """
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    command = [
        sys.executable,
        "-m",
        "torchbeast_hydra",
        *(["-m"] if multirun else []),
        f"{dir_key}={run_dir}",
        *overrides,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env if env is not None else cli_env()
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def sweep_job_dir(sweep: Path, *overrides: str) -> Path:
    """The one job dir of a sweep whose overrides include these (job dirs are named by overrides)."""
    (match,) = [d for d in sweep.iterdir() if d.is_dir() and set(overrides) <= set(d.name.split(","))]
    return match


def rows(run_dir):
    """logs.csv's rows, read as everything else reads them (numbers parsed, blanks None)."""
    return read_rows(run_dir)


def steps(run_dir):
    return [int(row["step"]) for row in rows(run_dir)]


def children(pid):
    """Live child processes of pid (actors, and multiprocessing's helpers)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        pytest.skip("pgrep is not available")
    return [int(p) for p in out.split()]


def actor_pids(pid):
    return [p for p in children(pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_cli(run_dir, *overrides, env=None):
    """Starts `python -m torchbeast_hydra` in the background (output in .stdout).

    env: variables to add to cli_env() (None removes one)."""
    command = [sys.executable, "-m", "torchbeast_hydra", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(**(env or {}))
    )


def run_sweep(sweep_dir, *overrides, timeout: float, env=None):
    """`python -m torchbeast_hydra -m ...` into sweep_dir, bounded in time; returns the CompletedProcess."""
    command = [sys.executable, "-m", "torchbeast_hydra", "-m", f"hydra.sweep.dir={sweep_dir}", *overrides]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=dict(os.environ if env is None else env, HYDRA_FULL_ERROR="0"),
    )
