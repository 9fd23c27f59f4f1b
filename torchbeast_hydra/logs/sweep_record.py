"""What a sweep's command line fixed (one value for every job), recorded once when the sweep starts
(launch.jobs.RecordSweepOverrides) and read by job naming (launch.jobs.job_subdir) and wandb's
labels (logs.wandb_log.hydra_labels). Light on purpose: the learner process imports it."""

from __future__ import annotations

from pathlib import Path

import yaml

SWEEP_OVERRIDES_FILE = ".sweep_overrides.yaml"

# Config keys that say how a run logs, where it writes, how it is reached or when it stops, not
# what it learns: runs that differ only in these are one setting (the report aggregates them), and
# a later command on a sweep dir that adds one resumes the same jobs. A trailing dot covers the
# keys under it.
RUN_CONTROL_KEYS = (
    "logger.",
    "hydra.",
    "checkpoint_interval_s",
    "check_memory",
    "load_dir",
    "mode",
    "test.record_video",
    "eval.stop_at_return",
    "eval.stop_confirmations",
    "backend.token",
    "backend.address",
)


def is_run_control(key: str) -> bool:
    """A key that never tells two settings apart (RUN_CONTROL_KEYS)."""
    return any(key.startswith(k) if k.endswith(".") else key == k for k in RUN_CONTROL_KEYS)


def override_key(override: str) -> str:
    """`+optim.learning_rate=0.1` -> `optim.learning_rate`."""
    return override.partition("=")[0].lstrip("+~")


def fixed_overrides(sweep_dir: str | Path) -> set | None:
    """The overrides a sweep's command line gave one value, as (key, value) pairs; None where the
    sweep did not record them."""
    try:
        recorded = yaml.safe_load((Path(sweep_dir) / SWEEP_OVERRIDES_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return {as_pair(str(o)) for o in (recorded or {}).get("fixed", [])}


def is_fixed(override: str, fixed: set | None) -> bool:
    """Whether a job's override is one its sweep's command line fixed (by value, not by spelling:
    the launcher writes `eval.final=False` for a typed `eval.final=false`)."""
    return bool(fixed) and as_pair(override) in fixed


def as_pair(override: str) -> tuple:
    """(key, value) of an override, the value as Hydra reads it (its text where Hydra cannot)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key, _, text = override.partition("=")
    try:
        value = OverridesParser.create().parse_override(override).value()
    except Exception:  # not Hydra's syntax: compare as typed
        value = text
    return override_key(key), repr(value)
