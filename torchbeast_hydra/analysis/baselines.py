"""Published reference scores: baselines.yaml beside this module, which says where each number was
read (a paper's table, a library's benchmark page), by task id and its aliases."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

BASELINES = Path(__file__).with_name("baselines.yaml")
KEPT_BASELINES = "baselines.yaml"  # beside report.md, when the report used a baselines file of its own


@dataclass
class Baseline:
    """One task's entry of baselines.yaml."""

    task: str
    random: Optional[dict] = None
    references: list = field(default_factory=list)
    normalise_by: Optional[str] = None

    def normaliser(self) -> Optional[dict]:
        """The reference that scores 1 (with the random score as 0), or None if either is missing."""
        if self.random is None or self.normalise_by is None:
            return None
        return next((r for r in self.references if r["name"] == self.normalise_by), None)


def load_baselines(path: str | Path = BASELINES) -> dict:
    """{task id or alias: Baseline} from baselines.yaml."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    out = {}
    for task, entry in data.items():
        baseline = Baseline(
            task=task,
            random=entry.get("random"),
            references=list(entry.get("references") or []),
            normalise_by=entry.get("normalise_by"),
        )
        for name in [task, *(entry.get("aliases") or [])]:
            out[name] = baseline
    return out


def is_packaged(path: str | Path) -> bool:
    """Whether path is the package's own baselines.yaml (a report with another keeps a copy)."""
    return Path(path).resolve() == BASELINES.resolve()


def why_not_normalised(baseline: Optional[Baseline]) -> str:
    if baseline is None:
        return "not in baselines.yaml"
    if baseline.random is None:
        return "no random score in baselines.yaml"
    if baseline.normalise_by is None:
        return "no reference to normalise by in baselines.yaml"
    return f"normalise_by names {baseline.normalise_by!r}, which is not among its references"
