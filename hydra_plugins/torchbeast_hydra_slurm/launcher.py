"""hydra/launcher=slurm's launcher: hydra-submitit-launcher's SlurmLauncher, with two additions.

- A job left pending for a reason that cannot clear by waiting (the partition cannot run it, a
  dependency failed, a per-job QOS or account limit...) is cancelled and reported, instead of the
  launcher waiting for it forever: a thread watches the sweep's jobs in squeue while it waits.
- When a sweep job fails (a hard crash: SIGKILL, OOM, the time limit; or an error in the job), the
  plugin raises submitit's error through Hydra, which prints a long traceback of launcher frames.
  This prints what matters (which job, its state, the end of its log) and exits 1.

Imported only through conf/hydra/launcher/slurm.yaml (and unpickled in the jobs), so only with
the plugin present.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from hydra_plugins.hydra_submitit_launcher import submitit_launcher

# squeue's pending reasons that waiting never clears (SLURM's "Job Reason Codes").
HOPELESS_REASONS = {
    "PartitionConfig": "the partition's nodes cannot run a job this size (CPUs, memory, GPUs)",
    "BadConstraints": "no node has the requested constraints (features, GRES)",
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows",
    "PartitionTimeLimit": "the job's time limit is above the partition's (hydra.launcher.timeout_min)",
    "DependencyNeverSatisfied": "a job it depends on failed, so it can never start",
    "InvalidAccount": "the account is not valid (hydra.launcher.account)",
    "InvalidQOS": "the QOS is not valid (hydra.launcher.qos)",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than its QOS allows one job",
    "QOSMaxGRESPerJob": "it asks for more GPUs (GRES) than its QOS allows one job",
    "QOSMaxMemoryPerJob": "it asks for more memory than its QOS allows one job",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than its QOS allows one job",
    "QOSMaxWallDurationPerJobLimit": "its time limit is above what its QOS allows",
    "AssocMaxCpuPerJobLimit": "it asks for more CPUs than its account allows one job",
    "AssocMaxGRESPerJob": "it asks for more GPUs (GRES) than its account allows one job",
    "AssocMaxMemPerJob": "it asks for more memory than its account allows one job",
    "AssocMaxNodePerJobLimit": "it asks for more nodes than its account allows one job",
    "AssocMaxWallDurationPerJobLimit": "its time limit is above what its account allows",
}
POLL_S = 10.0


def sweep_job_ids(submitit_dir: Path) -> list:
    """The sweep's SLURM job ids, from submitit's folders (ARRAYID_TASK/, or JOBID/ for one job)."""
    try:
        names = sorted(p.name for p in submitit_dir.iterdir() if p.is_dir())
    except OSError:
        return []
    return [name for name in names if "_" in name] or names


def hopeless(squeue_output: str) -> tuple[str, str] | None:
    """(job id, reason) of the first pending job that cannot start, from `squeue -h -o %i|%T|%r`."""
    for line in squeue_output.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if state == "PENDING" and reason in HOPELESS_REASONS:
            return job, reason
    return None


class PendingWatch(threading.Thread):
    """Watches the sweep's jobs in squeue; cancels them all when one can never start."""

    def __init__(self, submitit_dir: Path, poll_s: float = POLL_S):
        super().__init__(name="slurm-pending-watch", daemon=True)
        self.submitit_dir, self.poll_s = submitit_dir, poll_s
        self.found: tuple[str, str] | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        while not self.finished.wait(self.poll_s):
            ids = sweep_job_ids(self.submitit_dir)
            if not ids:
                continue
            arrays = sorted({i.split("_")[0] for i in ids})
            try:
                out = subprocess.run(
                    ["squeue", "-h", "-j", ",".join(arrays), "-o", "%i|%T|%r"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout
            except (OSError, subprocess.SubprocessError):
                continue  # the controller may be busy; ask again at the next poll
            self.found = hopeless(out)
            if self.found:
                try:
                    subprocess.run(["scancel", *arrays], capture_output=True, timeout=60)
                except (OSError, subprocess.SubprocessError):
                    pass  # reported all the same; the report names the jobs to cancel by hand
                return

    def report(self) -> str:
        job, reason = self.found
        return (
            f"error: SLURM job {job} was pending for a reason that waiting does not clear: {reason} "
            f"({HOPELESS_REASONS[reason]}). The sweep's jobs were cancelled; change the hydra.launcher "
            "settings (`scontrol show job` and `sinfo` tell what the cluster offers) and start the sweep again."
        )


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def launch(self, job_overrides, initial_job_idx):
        from submitit.core.utils import FailedJobError, UncompletedJobError

        watch = PendingWatch(Path(str(self.params["submitit_folder"]).split("%j")[0]))  # SWEEP/.submitit/
        watch.start()
        try:
            return super().launch(job_overrides, initial_job_idx)
        except (UncompletedJobError, FailedJobError) as error:
            if watch.found:
                print(watch.report(), file=sys.stderr)
            else:
                print(f"error: a sweep job failed (sweep dir {self.config.hydra.sweep.dir}):\n{error}", file=sys.stderr)
            sys.exit(1)
        finally:
            watch.finished.set()
