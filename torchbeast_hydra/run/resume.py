"""Resuming with the checkpoint's config or a changed one.

What shapes the env, the model and the optimiser's state must match: the env's id and spaces,
the model's class and parameter shapes, the optimiser. Any other difference is applied knowingly:
`config_changes` lists each one (the run logs them at start, one line per key, and records them in
run_info.yaml); the learner takes the new hyperparameters over the checkpoint's optimiser state and
re-derives the LR schedule from them (learner.Learner.load_state_dict); the run dir's config says
what the run now uses. Config fields added since (absent from the saved config) are not changes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torchbeast_hydra.env.actions import DISCRETE
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.run.checkpoint import CheckpointError
from torchbeast_hydra.run.settings import to_plain_dict

log = logging.getLogger(__name__)


def env_signature(env_id: str, spec: EnvSpec) -> dict:
    """What a checkpoint's env must match to resume: its id and spaces. An observation that is one
    array is recorded as before leaves existed (obs_shape, obs_dtype); a Dict/Tuple one leaf by leaf;
    Discrete actions as before other action spaces existed (num_actions)."""
    if spec.single:
        leaf = spec.leaves[0]
        signature = dict(id=env_id, obs_shape=list(leaf.shape), obs_dtype=str(leaf.dtype))
    else:
        obs = {leaf.key: dict(shape=list(leaf.shape), dtype=str(leaf.dtype)) for leaf in spec.leaves}
        signature = dict(id=env_id, obs=obs)
    if spec.actions.kind == DISCRETE:
        signature["num_actions"] = spec.actions.nvec[0]
    else:
        signature["actions"] = spec.actions.signature()
    return signature


def check_resumable(path: Path, state: dict, cfg, spec: EnvSpec, model_state: dict) -> None:
    """Raises CheckpointError when the checkpoint at `path` cannot resume this config."""
    saved = state.get("config", {})
    current = to_plain_dict(cfg)
    saved_env = state.get("env", dict(id=saved.get("env", {}).get("id")))  # older checkpoints: the id
    current_env = env_signature(cfg.env.id, spec)
    if any(saved_env[key] != current_env.get(key) for key in saved_env):
        raise _mismatch(path, "env", saved_env, current_env, _env_difference(saved_env, current_env))
    saved_optim = saved.get("optim", {}).get("name")
    if saved_optim is not None and saved_optim != current["optim"]["name"]:
        raise _mismatch(
            path, "optim.name", saved_optim, current["optim"]["name"], "the optimiser's state cannot carry over"
        )
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


def _env_difference(saved: dict, current: dict) -> str:
    """Why the envs differ; names the first observation leaf that changed, if one did."""
    saved_obs, current_obs = saved.get("obs"), current.get("obs")
    if isinstance(saved_obs, dict) and isinstance(current_obs, dict) and saved_obs != current_obs:
        key = next(k for k in [*saved_obs, *current_obs] if saved_obs.get(k) != current_obs.get(k))
        return (
            f"the env's observation differs at leaf {key} ({saved_obs.get(key, 'absent')} saved, "
            f"{current_obs.get(key, 'absent')} now)"
        )
    return "the env's id or spaces differ"


def _mismatch(path: Path, group: str, saved, current, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} was trained with {group}={saved}, but this run asks for {group}={current}: "
        f"{why}. Resume with the original config, or start in a new run dir."
    )


def config_changes(saved: dict, current: dict) -> dict:
    """Dotted key -> (saved, now) for every setting both configs have and that differs."""
    saved, current = _flatten(saved), _flatten(current)
    return {
        key: (saved[key], current[key]) for key in sorted(saved.keys() & current.keys()) if saved[key] != current[key]
    }


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def describe_changes(changes: dict) -> list:
    """Log lines for a resume's changed settings: a heading, then one line per key."""
    if not changes:
        return []
    return [
        f"Resuming with {len(changes)} changed setting(s), applied from here on (the LR schedule follows the "
        "new values; the run dir's config now says what this run uses):",
        *(f"  {key}: {before!r} -> {now!r}" for key, (before, now) in changes.items()),
    ]
