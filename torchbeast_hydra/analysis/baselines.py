"""Published reference scores: baselines.yaml beside this module, which says where each number was
read (a paper's table, a library's benchmark page), by task id and its aliases."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from torchbeast_hydra.analysis import measures

BASELINES = Path(__file__).with_name("baselines.yaml")
KEPT_BASELINES = "baselines.yaml"  # beside report.md, when the report used a baselines file of its own


@dataclass
class Baseline:
    """One task's entry of baselines.yaml."""

    task: str
    random: Optional[dict] = None
    references: list = field(default_factory=list)
    normalise_by: Optional[str] = None
    same_dynamics: list = field(default_factory=list)  # ids whose figures compare with each other
    notes: Optional[str] = None

    def why_not_comparable(self, reference: dict, task: str, configs=()) -> Optional[str]:
        """None if runs on task (with these flattened configs) compare with this reference
        (measures.why_not_comparable)."""
        return measures.why_not_comparable(reference, task, self.same_dynamics, configs)

    def peer_reference(self) -> Optional[dict]:
        """The reference whose measure and budget the runs' peer figure is read on: its normaliser
        when that is measured from training episodes, else its first such reference; None if none."""
        peers = [r for r in self.references if measures.measure_of(r) in measures.FROM_TRAINING and r.get("steps")]
        peers.sort(key=lambda r: r["name"] != self.normalise_by)
        return peers[0] if peers else None

    def peer_budget(self) -> Optional[float]:
        """The steps at which the peer figure is read for this task (peer_reference's); None if none."""
        reference = self.peer_reference()
        return float(reference["steps"]) if reference else None

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
            same_dynamics=list(entry.get("same_dynamics") or []),
            notes=entry.get("notes"),
        )
        for reference in baseline.references:
            measures.measure_of(reference)  # an unknown measure fails here, naming the reference
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
