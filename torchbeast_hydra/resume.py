"""What a checkpoint must match to resume: the env's id and spaces, the model's class and shapes.

Config fields added since (absent from the saved config) or changed without changing shapes do
not stop a resume.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .checkpoint import CheckpointError
from .config import to_plain_dict
from .envs import EnvSpec

log = logging.getLogger(__name__)


def env_signature(env_id: str, spec: EnvSpec) -> dict:
    """What a checkpoint's env must match to resume: its id and spaces."""
    return dict(
        id=env_id, obs_shape=list(spec.obs_shape), obs_dtype=str(spec.obs_dtype), num_actions=int(spec.num_actions)
    )


def check_resumable(path: Path, state: dict, cfg, spec: EnvSpec, model_state: dict) -> None:
    """Raises CheckpointError when the checkpoint at `path` cannot resume this config."""
    saved = state.get("config", {})
    current = to_plain_dict(cfg)
    saved_env = state.get("env", dict(id=saved.get("env", {}).get("id")))  # older checkpoints: the id
    current_env = env_signature(cfg.env.id, spec)
    if any(saved_env[key] != current_env.get(key) for key in saved_env):
        raise _mismatch(path, "env", saved_env, current_env, "the env's id or spaces differ")
    saved_target = saved.get("model", {}).get("_target_")
    if saved_target is not None and saved_target != current["model"]["_target_"]:
        raise _mismatch(path, "model", saved["model"], current["model"], "the model's body class differs")
    saved_shapes = {key: tuple(value.shape) for key, value in state["learner"]["model"].items()}
    current_shapes = {key: tuple(value.shape) for key, value in model_state.items()}
    if saved_shapes != current_shapes:
        differ = sorted(set(saved_shapes) ^ set(current_shapes)) or [
            key for key in saved_shapes if saved_shapes[key] != current_shapes[key]
        ]
        key = differ[0]
        before, now = (list(shapes.get(key, ["absent"])) for shapes in (saved_shapes, current_shapes))
        detail = f"{key}: {before} saved, {now} now"
        raise _mismatch(path, "model", saved.get("model"), current["model"], f"parameter shapes differ ({detail})")
    for group in ("env", "model"):
        changed = {
            key: (value, current[group][key])
            for key, value in saved.get(group, {}).items()
            if key in current[group] and value != current[group][key]
        }
        for key, (before, now) in changed.items():
            log.warning("Resuming with %s.%s=%s (trained with %s): it does not change shapes.", group, key, now, before)


def _mismatch(path: Path, group: str, saved, current, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} was trained with {group}={saved}, but this run asks for {group}={current}: "
        f"{why}. Resume with the original config, or start in a new run dir."
    )
