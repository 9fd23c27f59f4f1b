"""launch's settings: data-parallel ranks (distributed)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torchbeast_hydra.errors import require


class DistBackend(enum.Enum):
    """torch.distributed's backend for the ranks' collectives."""

    auto = "auto"  # nccl when each rank on a machine has a GPU of its own, else gloo
    gloo = "gloo"  # CPU tensors (and what the ranks agree on each update, on any device)
    nccl = "nccl"  # GPU tensors: one GPU per rank (NCCL refuses two ranks on one GPU)


@dataclass
class DistributedConfig:
    """Data-parallel learners on torch.distributed (launch/distributed.py, docs/distributed.md).

    torchrun and SLURM (submitit) say how many ranks there are; `nproc` is for one machine without
    them. A run with one rank runs none of this."""

    nproc: int = 1  # ranks this command starts on this machine itself (as Lightning's devices=N); 1: no spawning
    backend: DistBackend = DistBackend.auto
    # A rank that neither answers nor reaches the next update within this many seconds (dead, hung,
    # or still starting) stops the others, with a line naming it. Cover the slowest start of a rank.
    timeout_s: float = 300.0


def check(cfg) -> None:
    """The distributed slice's checks."""
    require(cfg.distributed.nproc >= 1, f"distributed.nproc={cfg.distributed.nproc} must be at least 1.")
    require(cfg.distributed.timeout_s > 0, "distributed.timeout_s must be positive.")
