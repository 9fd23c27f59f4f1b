"""Entry point: `python -m torchbeast_hydra [overrides]` (or `torchbeast-hydra`).

Composes the config, checks it, then trains (resuming from the run dir's checkpoint) or tests.
"""

from __future__ import annotations

import logging
import platform
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .checkpoint import CheckpointError
from .config import ConfigError, Mode, PolyRole, register_configs, validate
from .launch import LaunchError, check_launcher_plugin, hand_over, register_resolvers
from .learner import NonFiniteUpdate
from .training import RunDirError

log = logging.getLogger("torchbeast_hydra")

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()
register_resolvers()  # here, so that submitit job processes (which import this module) have them


def write_run_info(run_dir: Path) -> None:
    """Records what produced this run: code version and platform (never the environment: secrets)."""
    import torch

    source = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=source, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    info = dict(
        git_commit=git("rev-parse", "HEAD") or None,
        git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
        python=platform.python_version(),
        torch=str(torch.__version__),
        host=platform.node(),
        argv=list(sys.argv),
    )
    OmegaConf.save(OmegaConf.create(info), run_dir / "run_info.yaml")


def run(cfg: DictConfig) -> None:
    from .envs import probe_env
    from .models import make_model

    validate(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if Mode(cfg.mode) is Mode.test:
        from .evaluate import evaluate

        evaluate(cfg, Path(cfg.load_dir) if cfg.load_dir else run_dir)
        return

    spec = probe_env(cfg.env)  # an unknown env id fails here, before any process starts
    make_model(cfg.model, spec)  # and so does a model that does not fit the env
    write_run_info(run_dir)

    if cfg.backend.name == "poly":
        from .poly import backend

        if PolyRole(cfg.backend.role) is PolyRole.env:  # env clients only: no learner, no run state
            sys.exit(backend.run_env_clients(cfg))
    else:
        from . import mono as backend
    from .training import TrainingRun

    training_run = TrainingRun(cfg, run_dir, spec)
    try:
        backend.train(cfg, training_run)
    finally:
        training_run.close()
    if training_run.stats.step < cfg.total_steps:  # stopped early: under submitit, requeue (see launch.py)
        hand_over(training_run.stopped_by)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ConfigError, CheckpointError) as error:  # before training: nothing to save
        log.error("error: %s", error)
        cause = error.__cause__
        if cause is not None:  # e.g. a bug in a user's env: its traceback, after the one clear line
            log.error("caused by:", exc_info=(type(cause), cause, cause.__traceback__))
        sys.exit(2)
    except (NonFiniteUpdate, RunDirError) as error:  # the backend saved the last good state first
        log.error("error: %s", error)
        sys.exit(1)


def cli() -> None:
    """The command line: checks what must be checked before Hydra composes the config, then runs."""
    try:
        check_launcher_plugin(sys.argv[1:])
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
