"""hydra/launcher=slurm's launcher: hydra-submitit-launcher's SlurmLauncher with a short report.

When a sweep job fails (a hard crash: SIGKILL, OOM, the time limit; or an error in the job), the
plugin raises submitit's error through Hydra, which prints a long traceback of launcher frames.
This prints what matters (which job, its state, the end of its log) and exits 1. Imported only
through conf/hydra/launcher/slurm.yaml (and unpickled in the jobs), so only with the plugin present.
"""

from __future__ import annotations

import sys

from hydra_plugins.hydra_submitit_launcher import submitit_launcher


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def launch(self, job_overrides, initial_job_idx):
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            return super().launch(job_overrides, initial_job_idx)
        except (UncompletedJobError, FailedJobError) as error:
            print(f"error: a sweep job failed (sweep dir {self.config.hydra.sweep.dir}):\n{error}", file=sys.stderr)
            sys.exit(1)
