"""The backends by name: a third backend is one module and one registry entry, and nothing else
in the package asks for a backend by its name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchbeast_hydra.backends import memory, registry
from torchbeast_hydra.backends.settings import BackendConfig
from torchbeast_hydra.config import validate
from torchbeast_hydra.errors import ConfigError

from helpers import TINY, compose_config

PACKAGE = Path(registry.__file__).resolve().parents[1]


@dataclass
class ThirdConfig(BackendConfig):
    name: str = "third"


def test_a_third_backend_is_one_registry_entry(monkeypatch):
    checked = []
    third = registry.BackendKind(
        schema=ThirdConfig,
        check=lambda cfg: checked.append(cfg.backend.name),
        auto_actors=lambda cores: (3, 5),
        memory=lambda cfg, unroll, envs, weights: {"third's rollouts": 7 * unroll},
        module="my_pkg.third",
    )
    monkeypatch.setitem(registry.BACKENDS, "third", third)
    cfg = compose_config([*TINY, "backend.num_actors=0", "backend.envs_per_actor=0"])
    cfg.backend.name = "third"
    resolved = validate(cfg)  # its checks and its auto sizes, by its entry alone
    assert checked == ["third"]
    assert (resolved.backend.num_actors, resolved.backend.envs_per_actor) == (3, 5)
    assert registry.get("third").load is not None and registry.BACKENDS["third"].schema is ThirdConfig


def test_an_unknown_backend_name_is_refused_with_the_registered_ones():
    with pytest.raises(ConfigError, match=r"backend.name=fourth: no such backend; use mono or poly"):
        registry.get("fourth")


def test_nothing_outside_the_registry_asks_for_a_backend_by_name():
    asks = re.compile(r"""backend\.name\s*[!=]=\s*["'](mono|poly)["']|\bname\s*==\s*["'](mono|poly)["']""")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert not found, found


def test_memory_adds_the_backends_own_parts(monkeypatch):
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env

    cfg = validate(compose_config(TINY))
    spec = probe_env(cfg.env)
    kind = registry.get(cfg.backend.name)
    monkeypatch.setitem(
        registry.BACKENDS, cfg.backend.name, registry.BackendKind(**{**kind.__dict__, "memory": lambda *a: {"x": 1}})
    )
    parts = memory.estimate(cfg, spec, make_model(cfg.model, spec)).ram
    assert parts["x"] == 1 and "learner process" in parts and "rollout buffers" not in parts
