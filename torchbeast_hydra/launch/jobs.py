"""Sweeps and SLURM: sweep job dirs (named by the swept overrides), checks before a sweep submits
anything, preemption hand-over.

Preemption and time limits under submitit (hydra/launcher=slurm or submitit_local)
---------------------------------------------------------------------------------
submitit runs each Hydra job inside its own job process and installs signal handlers there:
SIGUSR2 (sent by SLURM `signal_delay_s` before the time limit, and on preemption) calls the
launcher's `checkpoint()`, which re-submits the same Hydra job (same overrides, hence the same job
dir), runs `scontrol requeue` and exits without a result; SIGTERM is ignored ("bypassed").

A training run replaces those handlers while it trains (signals.StopOnSignals): any of
SIGINT/SIGTERM/SIGUSR2 stops the run, which stops its actors and writes its checkpoint. Only then,
in `hand_over`, does the signal go to the handler it displaced:
- SIGUSR2 -> submitit's handler: requeue and exit. The requeued job starts in the same job dir,
  finds checkpoint.pt and resumes (step, optimizer, LR schedule; logs.csv rows continue).
- SIGTERM under submitit: SLURM is requeueing (`scontrol requeue`, preemption) or cancelling the
  job. The process exits at once with 143 and no result, so the launcher follows SLURM's job state
  (the requeued run, or CANCELLED) instead of taking an unfinished run for a finished one.
Outside submitit a run exits 0 after its checkpoint, as on Ctrl-C; a job of a sweep that runs its
jobs in this process (the basic launcher) exits with 128 + the signal, which ends the sweep: Ctrl-C
stops the sweep, and the sweep's command again resumes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from torchbeast_hydra.logs.sweep_record import (
    SWEEP_OVERRIDES_FILE,
    fixed_overrides,
    is_fixed,
    is_run_control,
    override_key,
)

log = logging.getLogger("torchbeast_hydra")

SUBDIR_RESOLVER = "tbh_job_subdir"
MAX_SUBDIR_CHARS = 200

# Launcher presets (hydra/launcher=NAME) that need hydra-submitit-launcher.
SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")


def job_subdir(overrides, sweep_dir, job_num) -> str:
    """A sweep job's dir name: its swept overrides, e.g. `optim.learning_rate=0.001,seed=2`.

    The job's overrides (sorted, joined by ',') less those the sweep's command line gave one value
    (the same in every job: see RecordSweepOverrides). Whatever a sweeper varies stays, so two jobs
    of a sweep never share a dir; only the overrides decide it (not the job number or the attempt),
    so a requeued job finds its own dir again. Where the sweep's command line is not known, every
    override names the dir.
    """
    overrides = [str(o) for o in overrides]
    fixed = fixed_overrides(sweep_dir)
    swept = [o for o in overrides if not is_fixed(o, fixed)]
    return safe_dir_name(",".join(sorted(swept or overrides)), job_num)


def safe_dir_name(name: str, job_num) -> str:
    """`name` as a dir name: '/' (as in env.id=ALE/Pong-v5) becomes '_'; a name too long for a file
    system is cut and suffixed with a hash of the whole name; an empty one gives `job<num>`."""
    name = name.replace(os.sep, "_").replace("\0", "").replace("'", "").replace('"', "")  # quotes: typed, not named
    if not name or name in (".", ".."):
        return f"job{job_num}"
    if len(name) > MAX_SUBDIR_CHARS:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_SUBDIR_CHARS - 11]}-{digest}"
    return name


class RecordSweepOverrides(Callback):
    """Records, at a sweep's start, which of its command-line overrides are fixed (one value), in
    SWEEP_DIR/.sweep_overrides.yaml: job dirs are named by the others (job_subdir).

    The first command of a sweep dir writes the record and later ones keep it, so a later command
    on the same dir (a subset of its jobs, `seed=3` alone) finds the same job dirs again, and one
    that fixes another value (`optim.learning_rate=0.01` where the sweep had 0.001) gets dirs of
    its own instead of resuming runs of another config. A later command that fixes a key that
    does not change what is learned (sweep_record.RUN_CONTROL_KEYS: `eval.stop_at_return=18`,
    `logger.wandb.mode=offline`) adds it to the record instead: it resumes the same jobs."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        typed = [str(o) for o in config.hydra.overrides.task]
        try:
            parsed = OverridesParser.create().parse_overrides(typed)
        except Exception:  # a sweep Hydra itself will refuse, with its own message
            return
        fixed = [line for line, o in zip(typed, parsed) if not o.is_sweep_override()]
        sweep_dir = Path(str(config.hydra.sweep.dir))
        record = sweep_dir / SWEEP_OVERRIDES_FILE
        recorded = fixed_overrides(sweep_dir)
        if recorded is None:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.create(dict(fixed=fixed, command_line=typed)), record)
            return
        unrecorded = [o for o in fixed if not is_fixed(o, recorded)]
        run_control = [o for o in unrecorded if is_run_control(override_key(o))]
        if run_control:  # appended, never replacing: a job of an earlier command keeps its dir's name
            saved = OmegaConf.load(record)
            saved.fixed = [*(saved.get("fixed") or []), *run_control]
            OmegaConf.save(saved, record)
            log.info(
                "%s: what is learned stays the same; this command resumes the sweep's jobs.",
                ", ".join(run_control),
            )
        if learning := [o for o in unrecorded if o not in run_control]:
            log.info(
                "This sweep dir's job dirs are named as its first command named them (%s): "
                "%s, fixed here but not there, will name this command's job dirs.",
                record,
                ", ".join(learning),
            )


def register_resolvers() -> None:
    if not OmegaConf.has_resolver(SUBDIR_RESOLVER):
        OmegaConf.register_new_resolver(SUBDIR_RESOLVER, job_subdir)


class LaunchError(Exception):
    """A sweep cannot be launched as configured; nothing has been written or submitted."""


def check_launcher_plugin(argv: list[str]) -> None:
    """hydra/launcher=slurm|submitit_* needs hydra-submitit-launcher: say so before Hydra composes."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "hydra/launcher" and value in SUBMITIT_LAUNCHERS:
            if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
                raise LaunchError(
                    f"hydra/launcher={value} needs the hydra-submitit-launcher plugin, which is not "
                    "installed in this environment: `pip install hydra-submitit-launcher` (a dependency "
                    "of this package, so `make setup` or `pip install -e .` installs it)."
                )


def check_slurm(partition: str | None) -> None:
    """sbatch is on PATH, the controller answers, and the partition (if named) exists."""
    if shutil.which("sbatch") is None:
        raise LaunchError(
            "hydra/launcher=slurm submits jobs with sbatch, which is not on PATH here: run the sweep on "
            "a SLURM login node, or start the local cluster with `make slurm-start`."
        )
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        raise LaunchError(f"cannot ask SLURM for its partitions (sinfo: {error}).") from error
    if result.returncode != 0:
        raise LaunchError(
            f"SLURM's controller does not answer (sinfo: {result.stderr.strip()}). "
            "Is the cluster up? Locally: `make slurm-start`."
        )
    partitions = sorted(set(result.stdout.split()))
    if partition and partition not in partitions:
        raise LaunchError(
            f"SLURM partition '{partition}' does not exist on this cluster (partitions: "
            f"{', '.join(partitions) or 'none'}). Set hydra.launcher.partition=NAME or SLURM_PARTITION."
        )


@dataclass
class SlurmNode:
    """What one node of a partition offers a job."""

    name: str
    cpus: int
    mem_mb: int
    gpus: int


def gpu_count(gres: str) -> int:
    """GPUs in sinfo's GRES column: `(null)`, `gpu:4`, `gpu:a100:4(S:0-1)`, `gpu:2,mps:100`."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if parts[-1].isdigit() else 1
    return total


def minutes(limit: str) -> float | None:
    """A SLURM time limit (`infinite`, `30`, `4:00:00`, `1-00:00:00`, `2-12`) in minutes; None: no limit."""
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, _, rest = limit.rpartition("-")
    fields = [int(f) for f in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        fields += [0] * (3 - len(fields))
    elif len(fields) < 3:  # MM[:SS]
        fields = [0, *fields, *[0] * (2 - len(fields))]
    hours, mins, secs = fields
    return int(days or 0) * 1440 + hours * 60 + mins + secs / 60


def partition_nodes(sinfo_output: str, partition: str | None) -> tuple[str, list, float | None]:
    """(partition, its nodes, its time limit in minutes) from `sinfo -h -N -o %N|%P|%c|%m|%G|%l`.

    partition None: the cluster's default one (marked * by sinfo)."""
    nodes, limits, default = {}, {}, None
    for line in sinfo_output.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        name, part, cpus, mem, gres, limit = fields
        if part.endswith("*"):
            part = default = part[:-1]
        nodes.setdefault(part, []).append(SlurmNode(name, int(cpus.rstrip("+")), int(mem.rstrip("+")), gpu_count(gres)))
        limits[part] = minutes(limit)
    chosen = partition or default
    return chosen, nodes.get(chosen, []), limits.get(chosen)


def check_fits(launcher, partition: str, nodes: list, time_limit: float | None) -> None:
    """Raises LaunchError when no node of the partition can run one job as the launcher asks."""
    tasks = int(launcher.get("tasks_per_node") or 1)
    wants = dict(
        cpus=int(launcher.get("cpus_per_task") or 1) * tasks,
        mem_mb=int(float(launcher.get("mem_gb") or 0) * 1024),
        gpus=int(launcher.get("gpus_per_node") or 0) or int(launcher.get("gpus_per_task") or 0) * tasks,
    )
    fits = [n for n in nodes if n.cpus >= wants["cpus"] and n.mem_mb >= wants["mem_mb"] and n.gpus >= wants["gpus"]]
    problems, fixes = [], []
    if not fits and nodes:
        most = {key: max(getattr(n, key) for n in nodes) for key in wants}
        if wants["cpus"] > most["cpus"]:
            problems.append(
                f"{wants['cpus']} CPUs (cpus_per_task={launcher.get('cpus_per_task')} x tasks_per_node={tasks})"
            )
            fixes.append(f"hydra.launcher.cpus_per_task={max(1, most['cpus'] // tasks)}")
        if wants["mem_mb"] > most["mem_mb"]:
            problems.append(f"{wants['mem_mb'] / 1024:g} GB (mem_gb)")
            fixes.append(f"hydra.launcher.mem_gb={most['mem_mb'] // 1024}")
        if wants["gpus"] > most["gpus"]:
            problems.append(f"{wants['gpus']} GPU{'s' if wants['gpus'] > 1 else ''} (gpus_per_node)")
            fixes.append(f"hydra.launcher.gpus_per_node={most['gpus']}")
        if not problems:  # each fits some node, but no node has them all
            problems.append(f"{wants['cpus']} CPUs, {wants['mem_mb'] / 1024:g} GB and {wants['gpus']} GPUs together")
        offers = "; ".join(sorted({f"{n.cpus} CPUs, {n.mem_mb / 1024:.1f} GB, {n.gpus or 'no'} GPUs" for n in nodes}))
        raise LaunchError(
            f"each job asks for {', '.join(problems)}, but no node of SLURM partition '{partition}' has "
            f"that (its nodes: {offers}): set {' '.join(fixes) or 'smaller hydra.launcher resources'}, or "
            "pick a partition that has it with hydra.launcher.partition=NAME."
        )
    wanted_min = launcher.get("timeout_min")
    if time_limit is not None and wanted_min and float(wanted_min) > time_limit:
        raise LaunchError(
            f"hydra.launcher.timeout_min={wanted_min} is above SLURM partition '{partition}'s time limit "
            f"({time_limit:g} min), so the jobs would never start: set hydra.launcher.timeout_min={int(time_limit)} "
            "(runs are requeued at the limit and resume from their checkpoint)."
        )


def check_resources(launcher) -> None:
    """Compares what each job asks for with the nodes of its partition (sinfo), before submitting."""
    partition = launcher.get("partition")
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%l"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise LaunchError(f"cannot ask SLURM for its nodes (sinfo: {error}).") from error
    name, nodes, time_limit = partition_nodes(result.stdout, partition)
    if name is None or not nodes:
        return  # no default partition, or sinfo hides it from us: sbatch will say what it thinks
    check_fits(launcher, name, nodes, time_limit)


class LaunchChecks(Callback):
    """Checks a sweep's launcher before the sweeper writes its sweep dir or submits any job."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        try:
            if target.endswith("SlurmLauncher"):
                check_slurm(OmegaConf.select(config, "hydra.launcher.partition", default=None))
                check_resources(OmegaConf.select(config, "hydra.launcher"))
        except LaunchError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)  # SystemExit passes through Hydra's error reporting: one clear line


def _in_process_sweep() -> bool:
    """Whether this job is one of a -m sweep whose jobs run one after another in this process (the
    basic launcher, the Optuna sweeper with it); submitit's jobs are processes of their own."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _under_submitit(handler) -> bool:
    owner = getattr(handler, "__self__", None)
    return type(owner).__module__.startswith("submitit.")


def hand_over(stopped_by) -> None:
    """After a run stopped by a signal has written its checkpoint: let the signal's owner act on it.

    See the module docstring. stopped_by: the run's signals.StopOnSignals (or None).
    """
    if stopped_by is None or stopped_by.received is None:
        return
    signum = stopped_by.received
    if not _under_submitit(stopped_by.previous):
        if _in_process_sweep():  # Ctrl-C stops the sweep, not only the job it happened to reach
            log.info("The sweep stops here: %s stopped its job.", signal.Signals(signum).name)
            sys.exit(128 + signum)
        return
    for handler in logging.getLogger().handlers:  # the job's log, before submitit takes over
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if signum == signal.SIGTERM:
        os._exit(128 + signum)
    if signum == signal.SIGUSR2:
        stopped_by.previous(signum, None)  # submitit: re-submit, `scontrol requeue`, sys.exit(-1)
