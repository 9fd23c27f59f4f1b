"""The learner's device: which one `device=` means here, and moving a batch onto it."""

from __future__ import annotations

import torch

from .config import ConfigError, usable_cores


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here: use device=auto or cpu.")
    return device


def to_device(batch: dict, core_state: tuple, device: torch.device) -> tuple[dict, tuple]:
    """A CPU batch to the learner's device; through pinned memory to a GPU, so the copy overlaps."""
    if device.type != "cuda":
        return batch, core_state
    batch = {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
    return batch, tuple(s.to(device, non_blocking=True) for s in core_state)


def device_name(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' or 'cpu (2 cores)': which device, in words, for the log."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return f"cpu ({usable_cores()} cores)"
