"""Fixtures and hooks (the helpers tests import are in tests/helpers.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers import REPO, TINY, run_cli


@pytest.fixture
def tiny_run(tmp_path):
    """A finished tiny CartPole run; returns its run dir."""
    run_dir = tmp_path / "run"
    run_cli(run_dir, *TINY)
    return run_dir


def _cluster_up() -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local single-node SLURM cluster (`make slurm-start`), for tests marked slurm.

    Started (and its Debian packages installed, if missing) once per session, and stopped at the
    end unless it was already up before the tests. Skipped only where it cannot be had: not root,
    or no apt-get to install it with."""
    installed = all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch"))
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (it starts munged, slurmctld and slurmd)")
    if not installed and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install it with")
    was_up = _cluster_up()
    start = subprocess.run([str(REPO / "scripts/slurm/start.sh")], capture_output=True, text=True, timeout=600)
    if start.returncode != 0:
        raise AssertionError(f"make slurm-start failed:\n{start.stdout}\n{start.stderr}")
    partition = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30).stdout.split()[
        0
    ]
    yield partition
    if not was_up:
        subprocess.run([str(REPO / "scripts/slurm/stop.sh")], capture_output=True, timeout=120)
