"""Every figure in the docs can be drawn again: its report keeps its runs beside it, or is listed, with
what was lost, in docs/reports/lost-runs.md."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers import REPO

DOCS = REPO / "docs"
REPORTS = DOCS / "reports"
LOST = REPORTS / "lost-runs.md"
KEPT_BUDGET_MB = 30  # the kept runs of every report together (issue 48: compact, under ~30 MB)


def lost_reports() -> set:
    """The report dirs listed in lost-runs.md's table (its first column links to their report.md)."""
    return {match for match in re.findall(r"^\| \[[^\]]+\]\(([^)]+)/report\.md\)", LOST.read_text(), re.M)}


def report_dir(figure: Path) -> Path:
    """The report a figure belongs to: the dir under docs/reports/ it is in."""
    return REPORTS / figure.relative_to(REPORTS).parts[0]


def keeps_runs(figure: Path) -> bool:
    """A runs/ dir beside the figure or above it, within its report, with a run's logs (logs.csv.gz
    as kept, or logs.csv) or eval.csv."""
    for folder in [figure.parent, *figure.parent.parents]:
        runs = folder / "runs"
        if runs.is_dir() and any(p.name in ("logs.csv.gz", "logs.csv", "eval.csv") for p in runs.rglob("*.csv*")):
            return True
        if folder == REPORTS:
            return False
    return False


def figures() -> list:
    """Every image under docs/reports/, and every image a docs page shows."""
    found = set(REPORTS.rglob("*.png"))
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", page.read_text()):
            found.add((page.parent / target).resolve())
    return sorted(found)


def test_every_figure_keeps_its_runs_or_is_listed_as_lost():
    lost = lost_reports()
    assert lost, "lost-runs.md lists no report: its table's first column links to each report.md"
    orphans = []
    for figure in figures():
        assert figure.is_file(), f"a page shows {figure}, which is not there"
        if not figure.is_relative_to(REPORTS):
            orphans.append(f"{figure.relative_to(REPO)} (not in a report under docs/reports/)")
        elif not keeps_runs(figure) and report_dir(figure).name not in lost:
            orphans.append(str(figure.relative_to(REPO)))
    assert not orphans, (
        "figures without their runs: keep them (report --keep-runs) or list the report in "
        f"docs/reports/lost-runs.md: {orphans}"
    )
    for name in lost:  # a listed report exists, and was not since given its runs
        assert (REPORTS / name / "report.md").is_file(), f"lost-runs.md lists {name}, which has no report"
        assert not (REPORTS / name / "runs").exists(), f"{name} keeps its runs now: take it off lost-runs.md"


def test_the_kept_runs_stay_compact():
    total = sum(p.stat().st_size for p in REPORTS.rglob("*") if p.is_file() and "runs" in p.relative_to(REPORTS).parts)
    assert total < KEPT_BUDGET_MB * 2**20, f"docs/reports/*/runs hold {total / 2**20:.1f} MB"


def test_a_figure_without_runs_fails(tmp_path, monkeypatch):
    """The check above can fail: a report with a figure and neither runs nor a listing is found."""
    reports = tmp_path / "reports"
    (reports / "new").mkdir(parents=True)
    (reports / "new" / "curve.png").write_bytes(b"png")
    (reports / "kept" / "runs" / "0").mkdir(parents=True)
    (reports / "kept" / "curve.png").write_bytes(b"png")
    (reports / "kept" / "runs" / "0" / "logs.csv").write_text("step\n1\n")
    monkeypatch.setattr(sys.modules[__name__], "REPORTS", reports)
    assert not keeps_runs(reports / "new" / "curve.png")
    assert keeps_runs(reports / "kept" / "curve.png")
