"""Checkpoints: written atomically (temp file, fsync, rename), read back with clear errors.

A checkpoint holds the learner (model, optimiser, LR schedule), the step count, run statistics,
RNG states and the resolved config. The previous checkpoint is kept as `checkpoint.prev.pt`, so a
crash can never leave a run without a loadable one.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

FILENAME = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def path_in(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / FILENAME


def rng_state() -> dict:
    numpy_state = np.random.get_state()
    state = dict(
        torch=torch.get_rng_state(),
        numpy=dict(key=torch.from_numpy(numpy_state[1].astype(np.int64)), pos=int(numpy_state[2])),
        python=random.getstate(),
    )
    if torch.cuda.is_initialized():  # a GPU learner: its devices' generators too (CPU tensors)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restores the RNG states. CUDA's only where the checkpoint has as many devices as this run
    sees: a GPU-saved checkpoint resumed on a CPU (or elsewhere) starts CUDA's generators afresh."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    key = state["numpy"]["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, state["numpy"]["pos"], 0, 0.0))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save(path: str | os.PathLike, state: dict) -> None:
    """Writes state so that `path` is always either the old checkpoint or the complete new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state, format_version=FORMAT_VERSION), f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.replace(path, path.with_name(PREVIOUS))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a partial file behind
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, map_location="cpu") -> dict:
    """Loads a checkpoint; a missing, truncated or foreign file raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: train a run there first, or point to its run dir.")
    try:
        # weights_only: a checkpoint is data, and loading it must never run code.
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # any failure to read it back means the file cannot be trusted
        previous = path.with_name(PREVIOUS)
        fallback = (
            f" The previous checkpoint {previous} may be intact: move {path.name} aside and rename "
            f"{previous.name} to {path.name} to resume from it."
            if previous.is_file()
            else " Move it aside to start this run from scratch."
        )
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {str(error)[:200]}).{fallback}"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a torchbeast_hydra checkpoint (format {FORMAT_VERSION}).")
    return state
