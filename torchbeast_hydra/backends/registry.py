"""The backends by name: what config, memory, launching and the command need to know of each.

`backend=NAME` picks an entry of BACKENDS. A third backend is one module (a subclass of
loop.Backend with a `train(cfg, run)` function beside it), its settings (a BackendConfig subclass
with `name: str = "NAME"`, conf/backend/NAME.yaml extending base_NAME) and one entry here; nothing
else asks for a backend by name. Only settings modules are imported here, so config.py can read
the registry without torch; the backend itself is imported when a run starts (`load`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from torchbeast_hydra.backends.mono import settings as mono
from torchbeast_hydra.backends.poly import settings as poly
from torchbeast_hydra.errors import ConfigError


def _always_learns(backend) -> bool:
    return True


def _same_for_every_rank(backend, local_rank: int) -> None:
    return None


@dataclass(frozen=True)
class BackendKind:
    """One backend, as the rest of the package sees it."""

    schema: type  # its config dataclass, registered as base_NAME for conf/backend/NAME.yaml
    check: Callable[[Any], None]  # its slice's checks (after backends.settings.check)
    auto_actors: Callable[[int], tuple[int, int]]  # cores -> (num_actors, envs_per_actor) for 0 (auto)
    # (cfg, bytes of one unroll, bytes of every env, bytes of the weights) -> {part: bytes} in RAM
    # beside the learner: its rollout storage and its acting processes (memory.py).
    memory: Callable[[Any, int, int, int], dict]
    module: str  # the module with train(cfg, run)
    learns: Callable[[Any], bool] = _always_learns  # False: this process runs without a learner
    without_learner: str = ""  # the module's function (cfg) -> exit code, when learns() is False
    for_rank: Callable[[Any, int], None] = _same_for_every_rank  # a data-parallel rank's own settings

    def load(self) -> ModuleType:
        """The backend's module: imported only when a run starts (it brings torch and its processes)."""
        return importlib.import_module(self.module)

    def run_without_learner(self, cfg) -> int:
        return getattr(self.load(), self.without_learner)(cfg)


BACKENDS = {
    "mono": BackendKind(
        schema=mono.MonoConfig,
        check=mono.check,
        auto_actors=mono.auto_actors,
        memory=mono.memory,
        module="torchbeast_hydra.backends.mono.backend",
    ),
    "poly": BackendKind(
        schema=poly.PolyConfig,
        check=poly.check,
        auto_actors=poly.auto_actors,
        memory=poly.memory,
        module="torchbeast_hydra.backends.poly.backend",
        learns=poly.learns,
        without_learner="run_env_clients",
        for_rank=poly.for_rank,
    ),
}


def get(name: str) -> BackendKind:
    """The backend named by backend.name; a ConfigError naming the registered ones otherwise."""
    if name not in BACKENDS:
        raise ConfigError(f"backend.name={name}: no such backend; use {' or '.join(BACKENDS)}.")
    return BACKENDS[name]
