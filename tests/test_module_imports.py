"""Imports go down: the server serves without the client or a sibling backend, and the run's
pieces do not reach back up into the loop that uses them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchbeast_hydra"


def imported_modules(path: Path) -> set[str]:
    """Package modules `path` imports, as dotted names relative to the package (e.g. 'poly.client')."""
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]  # the importing module's package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - (node.level - 1)])
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}".lstrip(".") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchbeast_hydra."):
            found.add(node.module.removeprefix("torchbeast_hydra."))
    return found


FORBIDDEN = {
    # module: package modules it must not import
    "poly/server.py": {"poly.client", "poly.backend", "mono", "training", "training_run"},
    "poly/rollouts.py": {"poly.client", "poly.backend", "poly.server", "mono", "training"},
    "poly/batcher.py": {"poly.client", "poly.backend", "poly.server", "mono", "training"},
    "poly/wire.py": {"poly.client", "poly.backend", "poly.server", "mono", "training"},
    "poly/client.py": {"poly.backend", "poly.server", "mono", "training", "training_run"},
    "poly/backend.py": {"mono"},
    "mono.py": {"poly", "poly.backend", "poly.server", "poly.client"},
    "training_run.py": {"training", "mono", "poly.backend"},
    "training.py": {"mono", "poly.backend"},
    "supervision.py": {"training", "training_run", "mono", "poly.backend"},
    "resume.py": {"training", "training_run"},
}


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_imports_only_go_down(module):
    imported = imported_modules(PACKAGE / module)
    assert not imported & FORBIDDEN[module], f"{module} imports {sorted(imported & FORBIDDEN[module])}"


def test_the_import_reader_sees_relative_imports():
    """The check above would pass vacuously if it missed imports: it must see today's real ones."""
    assert {"poly.wire", "poly.batcher", "seeding"} <= imported_modules(PACKAGE / "poly/server.py")
    assert {"training", "training_run", "supervision"} <= imported_modules(PACKAGE / "mono.py")
