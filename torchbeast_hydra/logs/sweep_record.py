"""What a sweep's command line fixed (one value for every job), recorded once when the sweep starts
(run.launch.RecordSweepOverrides) and read by job naming (run.launch.job_subdir) and wandb's
labels (logs.wandb_log.hydra_labels). Light on purpose: the learner process imports it."""

from __future__ import annotations

from pathlib import Path

import yaml

SWEEP_OVERRIDES_FILE = ".sweep_overrides.yaml"


def override_key(override: str) -> str:
    """`+optim.learning_rate=0.1` -> `optim.learning_rate`."""
    return override.partition("=")[0].lstrip("+~")


def fixed_override_keys(sweep_dir: str | Path) -> set | None:
    """The keys a sweep's command line gave one value; None where the sweep did not record them."""
    try:
        recorded = yaml.safe_load((Path(sweep_dir) / SWEEP_OVERRIDES_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return {override_key(str(o)) for o in (recorded or {}).get("fixed", [])}
