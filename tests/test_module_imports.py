"""The rooms stay rooms: imports go down the data path, never up.

    errors <- env <- agent <- learning <- logs <- run <- backends <- config, __main__

A package may import from the packages below it (and from itself), never from one above; within
poly, the server serves without the client or the backend that starts them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchbeast_hydra"
# The data path, bottom first. logs sits below run: a run writes its figures; logs never drives a run.
LAYERS = ["errors", "env", "agent", "learning", "logs", "run", "backends"]
# Shims of paths that moved (marked for removal): they re-export from below and are imported by nobody.
SHIMS = {"models.py", "encoders.py", "learner.py", "analysis/__init__.py", "analysis/__main__.py"}


def imported_modules(path: Path, root: Path = PACKAGE) -> set[str]:
    """The package modules `path` imports, dotted and relative to the package ('backends.poly.wire')."""
    here = path.relative_to(root).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - (node.level - 1)])
            found.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchbeast_hydra."):
            found.add(node.module.removeprefix("torchbeast_hydra."))
            found.update(f"{node.module.removeprefix('torchbeast_hydra.')}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("torchbeast_hydra.") for a in node.names if a.name.startswith("torchbeast_hydra.")
            )
    return found


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name, or None for the top (config, __main__) and shims."""
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def package_modules() -> list[str]:
    return sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if str(p.relative_to(PACKAGE)) not in SHIMS
    )


def upward_imports(module: str, root: Path = PACKAGE) -> list[str]:
    """The modules that `module` (a path below root) imports from packages above its own."""
    own = layer_of(module.replace("/", ".").removesuffix(".py"))
    if own is None:  # config.py and __main__.py compose everything below them
        return []
    imported = imported_modules(root / module, root)
    return sorted(m for m in imported if layer_of(m) is None or layer_of(m) > own)


@pytest.mark.parametrize("module", package_modules())
def test_imports_only_go_down(module):
    upward = upward_imports(module)
    assert not upward, f"{module} imports {upward}, above its own package on the data path {LAYERS}"


POLY_FORBIDDEN = {
    "server.py": {"client", "backend"},
    "rollouts.py": {"client", "backend", "server"},
    "batcher.py": {"client", "backend", "server"},
    "wire.py": {"client", "backend", "server"},
    "client.py": {"backend", "server"},
}


@pytest.mark.parametrize("module", sorted(POLY_FORBIDDEN))
def test_poly_server_serves_without_its_clients(module):
    imported = {m.removeprefix("backends.poly.") for m in imported_modules(PACKAGE / "backends/poly" / module)}
    assert not imported & POLY_FORBIDDEN[module], f"poly/{module} imports {sorted(imported & POLY_FORBIDDEN[module])}"


def test_mono_and_poly_do_not_import_each_other():
    for path in (PACKAGE / "backends/mono").glob("*.py"):
        assert not any(m.startswith("backends.poly") for m in imported_modules(path)), path
    for path in (PACKAGE / "backends/poly").glob("*.py"):
        assert not any(m.startswith("backends.mono") for m in imported_modules(path)), path


def test_the_rule_sees_real_imports_and_flags_an_upward_one(tmp_path):
    """The checks above would pass vacuously if they missed imports: they must see today's real
    ones, and flag an env module that reached up into a backend."""
    assert {"backends.poly.wire", "backends.poly.batcher", "run.seeding"} <= imported_modules(
        PACKAGE / "backends/poly/server.py"
    )
    assert "run.training" in imported_modules(PACKAGE / "backends/mono/actors.py")
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "bad.py").write_text("from torchbeast_hydra.backends.mono import actors\n")
    (tmp_path / "env" / "fine.py").write_text("from torchbeast_hydra.errors import ConfigError\nfrom . import layout\n")
    assert upward_imports("env/bad.py", tmp_path) == ["backends.mono", "backends.mono.actors"]
    assert upward_imports("env/fine.py", tmp_path) == []
