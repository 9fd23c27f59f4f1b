"""The docs site: mkdocs builds it in strict mode, the configuration reference is generated from the
schemas (every key, with its default), and a broken link, a missing anchor or a page left out of
the nav fails the build, so the check cannot pass by saying nothing. And the README stays one
screen whose commands are the Makefile's."""

from __future__ import annotations

import dataclasses
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env_with_path, run_command


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH: this checkout's package, whose schemas the reference is generated from.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", site]
    return run_command(command, timeout=120, env=cli_env_with_path(), cwd=config.parent)


def table_rows(page: str) -> list[str]:
    """Each table row of a built page as text: cells joined by ' | ', markup and entities gone."""
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", page, re.S):
        cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)
        rows.append(" | ".join(html.unescape(re.sub(r"<[^>]+>", "", cell)).strip() for cell in cells))
    return rows


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    result = build(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, result.stdout + result.stderr
    return site


def test_the_site_builds_in_strict_mode_with_every_page(site):
    nav_pages = re.findall(r":\s*([\w-]+)\.md\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    on_disk = {path.stem for path in (REPO / "docs").glob("*.md")}
    assert set(nav_pages) == on_disk
    for page in on_disk:
        assert (site / ("" if page == "index" else page) / "index.html").is_file(), page
    assert not (site / "hooks").exists()  # the hook is build code, not a page's file


def test_the_configuration_reference_has_each_key_with_its_default(site):
    page = (site / "configuration" / "index.html").read_text()
    assert "config-reference" not in page  # the marker was replaced
    rows = table_rows(page)

    def row(key: str) -> str:
        (found,) = [r for r in rows if r.startswith(key + " | ")]
        return found

    # key | type | default | the comment beside the field in its schema
    assert row("total_steps").startswith("total_steps | int | 20000000 | environment steps")
    assert row("vtrace.discounting") == "vtrace.discounting | float | 0.99 | gamma"
    assert row("vtrace.reward_clipping").startswith("vtrace.reward_clipping | one of abs_one, none | abs_one |")
    assert row("backend.token").startswith("backend.token | str or null | null | Clients must present")
    assert row("logger.wandb.mode").startswith("logger.wandb.mode | one of auto, online, offline, disabled | auto |")
    # A field a schema overrides is listed under each: RMSProp's (from OptimConfig) and Adam's.
    assert {r.split(" | ")[2] for r in rows if r.startswith("optim.learning_rate | ")} == {"0.0006", "0.0003"}
    # conf/'s options: the schema each extends, what it sets and the options it brings.
    assert row("env=pong").startswith("env=pong | AtariEnvConfig | id=ALE/Pong-v5 |")
    assert "brings model=mlp" in row("env=cartpole")
    assert row("hydra.launcher.timeout_min").startswith("hydra.launcher.timeout_min | 240 |")

    # Every field of every schema registered in the ConfigStore is in the reference, as typed.
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from torchbeast_hydra.config import register_configs

    register_configs()
    keys = {r.split(" | ")[0] for r in rows}
    for group in ("env", "model", "vtrace", "optim", "backend"):
        for node in ConfigStore.instance().repo[group].values():
            schema = OmegaConf.get_type(node.node)
            if dataclasses.is_dataclass(schema) and schema.__module__.startswith("torchbeast_hydra"):
                missing = {f"{group}.{f.name}" for f in dataclasses.fields(schema)} - keys
                assert not missing, (schema.__name__, missing)


def tree_copy(tmp_path: Path) -> Path:
    """The site's sources in a scratch dir, to be broken there."""
    for name in ("docs", "conf"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path / "mkdocs.yml"


BREAKAGES = {  # what is added to the copied tree -> what the build says of it
    "[the backends](backend.md)": "backend.md', but the target is not found",
    "[poly's roles](backends.md#no-such-section)": "does not contain an anchor '#no-such-section'",
    "[the README](../README.md)": "../README.md', but the target is not found",
    "![a figure](no-such-figure.png)": "no-such-figure.png', but the target is not found",
    "orphan page": 'not included in the "nav" configuration',
}


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory) -> subprocess.CompletedProcess:
    """One build of a copied tree with every breakage of BREAKAGES in it: strict mode reports each as a
    warning, and a warning alone fails the build, so one build shows what each would do on its own."""
    tmp_path = tmp_path_factory.mktemp("broken")
    config = tree_copy(tmp_path)
    for breakage in BREAKAGES:
        if breakage == "orphan page":
            (tmp_path / "docs" / "notes.md").write_text("# Notes\n\nA page no one added to the nav.\n")
        else:
            with open(tmp_path / "docs" / "quick-start.md", "a") as page:
                page.write(f"\nSee {breakage}.\n")
    return build(config, tmp_path / "site")


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_broken_link_or_a_page_missing_from_the_nav_fails_the_build(broken_build, breakage):
    output = broken_build.stdout + broken_build.stderr
    assert broken_build.returncode != 0, output
    # The build's log, one entry per level name (an entry may span lines): the breakage is a warning.
    entries = re.split(r"^(?=(?:DEBUG|INFO|WARNING|ERROR) +-)", output, flags=re.M)
    warnings = [entry for entry in entries if entry.startswith("WARNING")]
    assert any(BREAKAGES[breakage] in entry for entry in warnings), output
    assert "Aborted with" in output and "warnings in strict mode" in output


def test_the_copied_tree_builds_before_it_is_broken(tmp_path):
    """The breakages above fail for what they add, not because the copy cannot build."""
    result = build(tree_copy(tmp_path), tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_is_one_screen_of_the_makefiles_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 40
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    used = set(re.findall(r"\bmake ([\w-]+)", readme))
    assert {"train", "test"} <= used <= targets
    assert "outputs/DATE/TIME/" in readme and "logs.csv" in readme and "mkdocs serve" in readme
    for link in re.findall(r"\]\((docs/[^)#]+)\)", readme):
        assert (REPO / link).is_file(), link


def test_the_env_families_page_shows_the_familys_table(site):
    """docs read the same table the code does (torchbeast_hydra/env/families.py)."""
    from torchbeast_hydra.env import families

    page = (site / "env-families" / "index.html").read_text()
    for family in families.FAMILIES:
        assert f"env={family.option}" in page and family.default_id in page and family.learns in page
