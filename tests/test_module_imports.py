"""The rooms stay rooms: imports go down the data path, never up.

    errors <- env <- agent <- learning <- logs <- run <- evaluation <- backends <- launch <- pbt
                                                                       <- config, __main__
    errors <- logs <- analysis (apart: it reads runs from disk, and nothing imports it)

A package may import from the packages below it (and from itself), never from one above; within
poly, the server serves without the client or the backend that starts them. Every import form
counts: `from torchbeast_hydra.x import y`, `from torchbeast_hydra import x`, `import
torchbeast_hydra.x.y` and relative imports, at the top of a module or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchbeast_hydra"
# The data path, bottom first. logs sits below run: a run writes its figures; logs never drives a
# run. evaluation sits above run: TrainingRun is handed its evaluations (evaluation.periodic) by the
# command. launch (Hydra callbacks, data-parallel ranks, SLURM glue) starts runs of any backend.
# pbt (population-based training: members are runs of a multirun) may import all of these.
LAYERS = ["errors", "env", "agent", "learning", "logs", "run", "evaluation", "backends", "launch", "pbt"]
# Apart from the data path: the offline analysis reads run dirs; it may import only these.
APART = {"analysis": {"errors", "logs", "analysis"}}
TOP = {"config", "__main__", "__init__", ""}  # compose everything below them


def imported_modules(path: Path, root: Path = PACKAGE) -> set[str]:
    """The package modules `path` imports, dotted and relative to the package ('backends.poly.wire');
    a name imported from a package counts as a module of it too ('env.layout' for `from . import layout`)."""
    here = path.relative_to(root).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = list(here[: len(here) - (node.level - 1)]) + ([node.module] if node.module else [])
                module = ".".join(parts)
            elif node.module == "torchbeast_hydra" or (node.module or "").startswith("torchbeast_hydra."):
                module = node.module.removeprefix("torchbeast_hydra").removeprefix(".")
            else:
                continue
            if module:
                found.add(module)
            found.update(f"{module}.{alias.name}" if module else alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("torchbeast_hydra.") for a in node.names if a.name.startswith("torchbeast_hydra.")
            )
    return found


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name, or None for the top (config, __main__) and the analysis."""
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def package_modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def upward_imports(module: str, root: Path = PACKAGE) -> list[str]:
    """The modules that `module` (a path below root) imports from packages it may not import."""
    dotted = module.replace("/", ".").removesuffix(".py")
    top = dotted.split(".")[0]
    imported = imported_modules(root / module, root)
    if top in APART:
        return sorted(m for m in imported if m.split(".")[0] not in APART[top])
    own = layer_of(dotted)
    if own is None:  # config.py, __main__.py and the package's __init__ compose everything below them
        return sorted(m for m in imported if m.split(".")[0] in APART)
    return sorted(m for m in imported if layer_of(m) is None or layer_of(m) > own)


@pytest.mark.parametrize("module", package_modules())
def test_imports_only_go_down(module):
    upward = upward_imports(module)
    assert not upward, f"{module} imports {upward}, above its own package on the data path {LAYERS} (or {APART})"


def test_every_package_has_a_place():
    """A new sub-package must be placed on the data path (or apart) before it can pass."""
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS) | set(APART), sorted(packages - set(LAYERS) - set(APART))


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
    ones, every import form, and flag an env module that reached up into a backend."""
    assert {"backends.poly.wire", "backends.poly.batcher", "run.seeding"} <= imported_modules(
        PACKAGE / "backends/poly/server.py"
    )
    assert "backends.loop" in imported_modules(PACKAGE / "backends/mono/backend.py")
    (tmp_path / "env").mkdir()
    (tmp_path / "analysis").mkdir()
    forms = {
        "from_module.py": "from torchbeast_hydra.backends.mono import backend\n",
        "from_package.py": "from torchbeast_hydra import config\n",
        "dotted.py": "import torchbeast_hydra.run.checkpoint\n",
        "relative.py": "from ..learning import vtrace\n",
        "in_function.py": "def f():\n    from torchbeast_hydra.launch import jobs\n",
    }
    for name, text in forms.items():
        (tmp_path / "env" / name).write_text(text)
    (tmp_path / "env" / "fine.py").write_text("from torchbeast_hydra.errors import ConfigError\nfrom . import layout\n")
    assert upward_imports("env/from_module.py", tmp_path) == ["backends.mono", "backends.mono.backend"]
    assert upward_imports("env/from_package.py", tmp_path) == ["config"]
    assert upward_imports("env/dotted.py", tmp_path) == ["run.checkpoint"]
    assert upward_imports("env/relative.py", tmp_path) == ["learning", "learning.vtrace"]
    assert upward_imports("env/in_function.py", tmp_path) == ["launch", "launch.jobs"]
    assert upward_imports("env/fine.py", tmp_path) == []
    fine = imported_modules(tmp_path / "env" / "fine.py", tmp_path)
    assert fine == {"errors", "errors.ConfigError", "env", "env.layout"}
    (tmp_path / "analysis" / "bad.py").write_text("from torchbeast_hydra.run import checkpoint\n")
    (tmp_path / "analysis" / "fine.py").write_text("from torchbeast_hydra.logs.metrics import read_rows\n")
    assert upward_imports("analysis/bad.py", tmp_path) == ["run", "run.checkpoint"]
    assert upward_imports("analysis/fine.py", tmp_path) == []
