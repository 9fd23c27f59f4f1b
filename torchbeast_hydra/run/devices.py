"""The learner's device: which one `device=` means here, moving a batch onto it, and how many
host threads (and how long a GIL turn) a learner on it needs."""

from __future__ import annotations

import os
import sys

import torch

from torchbeast_hydra.errors import ConfigError

# Intra-op threads of a GPU learner's thread: its host-side work is copies and kernel launches,
# and the cores are the actors'.
GPU_LEARNER_THREADS = 2


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name} but CUDA is not available here: use device=auto or cpu.")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"device={name} but this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}; CUDA_VISIBLE_DEVICES may hide others)."
            )
    return device


def learner_threads(configured: int, device: torch.device, bf16: bool = False, actor_processes: int = 0) -> int:
    """backend.learner_torch_threads, or (0) what a learner on this device needs: on a GPU a few;
    on a CPU the cores, but one where it computes in bf16 and this machine's actor processes fill
    the cores (2 cores' defaults). Its math then costs less than theirs, so it waits for them, and
    a second thread only takes cycles from them (docs/performance.md#cpu-speed-options)."""
    if configured:
        return configured
    cores = usable_cores()
    if device.type == "cuda":
        return min(GPU_LEARNER_THREADS, cores)
    return 1 if bf16 and actor_processes >= cores else cores


def to_device(batch: dict, core_state: tuple, device: torch.device) -> tuple[dict, tuple]:
    """A CPU batch to the learner's device, asynchronously from pinned memory. The backends
    assemble batches into pinned memory already when bound for a GPU; anything else is pinned here."""
    if device.type != "cuda":
        return batch, core_state

    def move(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)

    return {key: move(value) for key, value in batch.items()}, tuple(move(s) for s in core_state)


def is_cuda_error(error: BaseException) -> bool:
    """An error the CUDA runtime raised (a device-side assert, an illegal access, ...): after most
    of these the device is unusable for the rest of this process."""
    if isinstance(error, getattr(torch, "AcceleratorError", ())):  # what torch >= 2.8 raises
        return True
    return isinstance(error, RuntimeError) and str(error).startswith(("CUDA error", "CUBLAS_STATUS", "cuDNN error"))


def device_name(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' or 'cpu (2 cores)': which device, in words, for the log."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return f"cpu ({usable_cores()} cores)"


def usable_cores() -> int:
    """The cores this process may run on (a SLURM job's allocation, not the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_gil_switch_interval(ms: float | None) -> float:
    """Sets how long a thread of this process may hold the GIL while another waits (ms; None: leave
    it); returns the interval it replaced, in seconds, for sys.setswitchinterval to restore."""
    previous = sys.getswitchinterval()
    if ms is not None:
        sys.setswitchinterval(ms / 1000)
    return previous
