"""Entry point: `python -m torchbeast_hydra [overrides]` (or `torchbeast-hydra`).

Composes the config, checks it, then trains (resuming from the run dir's checkpoint) or tests.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from torchbeast_hydra.backends import memory, registry
from torchbeast_hydra.config import Mode, register_configs, validate
from torchbeast_hydra.env import families
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.evaluation.settings import EvalObjective
from torchbeast_hydra.launch import distributed
from torchbeast_hydra.launch.jobs import LaunchError, check_launcher_plugin, hand_over, register_resolvers
from torchbeast_hydra.learning.learner import NonFiniteUpdate
from torchbeast_hydra.logs.metrics import RecentReturns, read_rows
from torchbeast_hydra.overrides import check_overrides
from torchbeast_hydra.pbt import member as pbt
from torchbeast_hydra.pbt import population
from torchbeast_hydra.run import checkpoint, supervision
from torchbeast_hydra.run.checkpoint import CheckpointError
from torchbeast_hydra.run.devices import resolve_device
from torchbeast_hydra.run.training_run import RunDirError

log = logging.getLogger("torchbeast_hydra")


def config_dir() -> str:
    """The config tree: inside the package when installed from a wheel, else the checkout's conf/."""
    package = Path(__file__).resolve().parent
    installed = package / "conf"
    return str(installed if installed.is_dir() else package.parent / "conf")


CONFIG_DIR = config_dir()
HELP_GROUPS_RESOLVER = "tbh_config_groups"
HELP_FAMILIES_RESOLVER = "tbh_env_families"


def config_groups(root: str = CONFIG_DIR) -> str:
    """`--help`'s list of config groups: each dir of conf/ with its options, the default first.

    Read from the files, so the typed schemas that config.py registers (base_env, ...) stay out.
    """
    defaults = {}
    for item in OmegaConf.load(Path(root) / "config.yaml").get("defaults", []):
        if isinstance(item, (dict, DictConfig)):
            defaults.update({str(k): v for k, v in item.items()})
    lines = []
    for group in sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        default = defaults.get(group.name)
        if default in options:
            options = [f"{default} (default)"] + [o for o in options if o != default]
        elif group.name in defaults:  # e.g. experiment: null
            options = ["none (default)"] + options
        lines.append(f"  {group.name}: {', '.join(options)}")
    return "\n".join(lines)


register_configs()
register_resolvers()  # here, so that submitit job processes (which import this module) have them
if not OmegaConf.has_resolver(HELP_GROUPS_RESOLVER):
    OmegaConf.register_new_resolver(HELP_GROUPS_RESOLVER, lambda: config_groups())
if not OmegaConf.has_resolver(HELP_FAMILIES_RESOLVER):
    OmegaConf.register_new_resolver(HELP_FAMILIES_RESOLVER, lambda: families.describe())


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


def final_return(training_run) -> float:
    """What a sweeper optimises (eval.objective): the final or the best evaluation's mean return, or
    the mean return of the run's last 100 training episodes (also where no evaluation was played).

    A run resumed at its end plays no episode in this process: logs.csv and eval.csv still have
    them. NaN when the run finished no episode at all (Optuna records such a trial as failed).
    """
    objective = EvalObjective(training_run.cfg.eval.objective)
    scores = training_run.evaluations.scores() if objective is not EvalObjective.train else []
    if objective is EvalObjective.final and any(final for _, _, final in scores):
        return [score for _, score, final in scores if final][-1]
    if objective is EvalObjective.best and scores:
        return max(score for _, score, _ in scores)
    recent = training_run.stats.recent_returns
    if not len(recent) and training_run.csv_path.exists():
        recent = RecentReturns(returns=[r for row in read_rows(training_run.csv_path) for r in row["episode_returns"]])
    return recent.mean if recent.mean is not None else math.nan


def trained_run_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """mode=test's trained run: load_dir (a population's dir: its best member's latest published
    checkpoint), else this run dir when started in a trained run's dir."""
    if cfg.load_dir and population.is_population(Path(cfg.load_dir)):  # its best member
        best, row = population.best_member(Path(cfg.load_dir))
        log.info("Playing the population's best member, %d (score %.2f at step %d).", best, row["score"], row["step"])
        return population.member_dir(Path(cfg.load_dir), best)
    if cfg.load_dir:
        return Path(cfg.load_dir)
    if not checkpoint.path_in(run_dir).exists():
        raise ConfigError(
            "mode=test plays a trained run's checkpoint: set load_dir=RUN_DIR (e.g. load_dir=outputs/DATE/TIME)."
        )
    return run_dir


def run(cfg: DictConfig) -> float:
    """Trains (or tests) as configured; returns the final mean episode return (test: evaluation's)."""
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env

    cfg = validate(cfg)  # the resolved copy: auto sizes filled in
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if Mode(cfg.mode) is Mode.test:
        from torchbeast_hydra.evaluation.evaluate import evaluate_all

        results = evaluate_all(cfg, trained_run_dir(cfg, run_dir), run_dir)
        return sum(result["mean_return"] for result in results) / len(results)

    spec = probe_env(cfg.env)  # an unknown env id fails here, before any process starts
    model = make_model(cfg.model, spec, initialise=False)  # and so does a model that does not fit the env
    backend = registry.get(cfg.backend.name)
    learns = backend.learns(cfg.backend)
    several = learns and distributed.wanted(cfg)  # data-parallel ranks; one rank takes none of their paths
    if several and distributed.is_follower():  # before its first line: under SLURM every task opened the log
        distributed.quiet_follower()
    if learns:
        copies = distributed.ranks_on_this_machine(cfg) if several else 1  # each rank holds all of it
        needed = memory.check(cfg, spec, model, resolve_device(cfg.device), copies)  # before any process starts
        log.info("Memory estimate: %s", memory.summary(needed, copies))
    ranks = spawned = None
    if several:
        cfg, run_dir, ranks, spawned = distributed.setup(cfg, run_dir)
    if ranks is None or ranks.is_main:
        write_run_info(run_dir)
    supervision.start_fork_server()  # before the learner: most runs start helpers (actors, env clients, evaluator)

    if not learns:  # e.g. poly's env clients alone: no learner, no run state
        sys.exit(backend.run_without_learner(cfg))
    from torchbeast_hydra.evaluation.periodic import Evaluations
    from torchbeast_hydra.run.training_run import TrainingRun

    training_run = TrainingRun(cfg, run_dir, spec, ranks, evaluations=Evaluations)
    member = pbt.join(cfg, training_run)  # a population's member: its hyperparameters change as it trains
    with distributed.running(ranks, spawned) if ranks is not None else contextlib.nullcontext():
        try:
            backend.load().train(cfg, training_run)
            if member is not None:
                member.finish()
        finally:
            training_run.close()
    if not training_run.complete:  # stopped early: under submitit, requeue (see launch/jobs.py)
        hand_over(training_run.stopped_by)
    return final_return(training_run)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    """A Hydra task: its return value is what sweepers (hydra/sweeper=optuna, ...) optimise."""
    try:
        return run(cfg)
    except (ConfigError, CheckpointError, population.PopulationError) as error:  # before training: nothing to save
        log.error("error: %s", error)
        cause = error.__cause__
        if cause is not None:  # e.g. a bug in a user's env: its traceback, after the one clear line
            log.error("caused by:", exc_info=(type(cause), cause, cause.__traceback__))
        sys.exit(2)
    except (NonFiniteUpdate, RunDirError, distributed.RankFailure) as error:  # the last good state is saved
        log.error("error: %s", error)
        sys.exit(1)
    except Exception as error:
        message, traceback = failure_line(error)
        if traceback:  # the detail first, so the one line that says what happened comes last
            log.error("The failure, in detail:", exc_info=error)
        log.error("error: %s", message)
        sys.exit(1)


def failure_line(error: BaseException) -> tuple[str, bool]:
    """(one line saying what stopped the run and what to do, whether its traceback helps)."""
    from torchbeast_hydra.run.devices import is_cuda_error

    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    kept = "checkpoints already saved are intact"
    if memory.is_out_of_memory(error) and "CUDA" in str(error):
        return (
            f"CUDA out of memory on the learner's GPU ({first}). Lower batch_size or unroll_length (the memory "
            f"estimate is near the top of this log), or free the GPU (nvidia-smi lists what holds it); {kept}.",
            False,
        )
    if memory.is_out_of_memory(error):
        return (
            f"out of memory in the learner process ({first}). Lower batch_size or unroll_length "
            "(the memory estimate is near the top of this log); the last checkpoint is intact.",
            False,
        )
    if is_cuda_error(error):
        return (
            f"the GPU failed ({type(error).__name__}: {first}); the device is unusable for this process, and "
            f"{kept}. A device-side assert is most often an index out of range (an action, an embedding); "
            "rerun with CUDA_LAUNCH_BLOCKING=1 for its exact place in the traceback above.",
            True,
        )
    return f"the run stopped on {type(error).__name__}: {first} (traceback above); {kept}.", True


PATH_KEYS = ("load_dir=", "+load_dir=")


def quote_paths(arg: str) -> str:
    """load_dir=SWEEP/seed=1 as Hydra can read it: a sweep's job dirs are named by their overrides,
    and an unquoted `=` or `,` in a value is Hydra syntax."""
    key, sep, value = arg.partition("=")
    if not arg.startswith(PATH_KEYS) or "=" not in value or value[:1] in ("'", '"') or "'" in value:
        return arg
    return f"{key}{sep}'{value}'"


def cli() -> None:
    """The command line: checks what must be checked before Hydra composes the config, then runs."""
    sys.argv[1:] = [quote_paths(arg) for arg in sys.argv[1:]]
    sys.argv += distributed.follower_overrides(sys.argv[1:])  # torchrun's (and the spawn's) ranks other than 0
    try:
        check_launcher_plugin(sys.argv[1:])
        check_overrides(sys.argv[1:], CONFIG_DIR)
    except (LaunchError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
