"""The built wheel, installed outside the checkout, trains and tests with its own configs."""

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, TINY, cli_env

# What the wheel is built from (a copy, so the build leaves nothing in the checkout).
SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "conf", "torchbeast_hydra", "hydra_plugins"]


def build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name)
    # No build isolation: the venv's setuptools builds it, so no network is needed.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("torchbeast_hydra-*.whl")
    return wheel


def fresh_venv(path: Path) -> Path:
    """A new venv whose own site-packages comes first and that sees this venv's installed dependencies.

    The dependencies' dir is added by a .pth line, so .pth files in it (this checkout's editable
    install) are not processed: torchbeast_hydra can only come from what is installed in the new venv.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "project_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return path


@pytest.mark.slow
def test_wheel_installs_anywhere_and_trains(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "torchbeast_hydra/conf/config.yaml",
        "torchbeast_hydra/conf/experiment/cartpole.yaml",
        "torchbeast_hydra/conf/hydra/launcher/slurm.yaml",
        "torchbeast_hydra/backends/poly/actorpool.proto",
        "torchbeast_hydra/analysis/baselines.yaml",
        "torchbeast_hydra/env/families.py",
        "hydra_plugins/torchbeast_hydra_slurm/launcher.py",
    ):
        assert needed in names, f"{needed} is not in the wheel"

    venv = fresh_venv(tmp_path / "venv")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"  # neither the checkout nor the venv: only the install can answer
    elsewhere.mkdir()
    outside = cli_env(PYTHONPATH=None)  # nor a PYTHONPATH that names the checkout
    command = venv / "bin" / "torchbeast-hydra"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torchbeast_hydra; print(torchbeast_hydra.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=elsewhere,
        env=outside,
    ).stdout
    assert where.startswith(str(venv)), where

    help_page = subprocess.run(
        [str(command), "--help"], capture_output=True, text=True, timeout=120, cwd=elsewhere, env=outside
    )
    assert help_page.returncode == 0 and "env: pong (default)" in help_page.stdout, help_page.stderr

    run_dir = elsewhere / "run"

    def installed(*args):  # the installed command, run from outside the checkout
        return subprocess.run(
            [str(command), *args], capture_output=True, text=True, timeout=240, cwd=elsewhere, env=outside
        )

    train = installed(f"hydra.run.dir={run_dir}", *TINY)
    assert train.returncode == 0, train.stdout + train.stderr
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "logs.csv").exists()
    test = installed(
        "mode=test", f"load_dir={run_dir}", f"hydra.run.dir={elsewhere / 'test'}", "test.num_episodes=2", *TINY
    )
    assert test.returncode == 0, test.stdout + test.stderr
    assert "Mean return over 2 episodes" in test.stdout
