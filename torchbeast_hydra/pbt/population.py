"""The population's dir: where members meet, and nothing else.

    POP/pbt.csv                 the lineage table (logs/lineage.py): one row per event of any member
    POP/.pbt.lock               what appending to the table locks (fcntl.flock)
    POP/member=N/checkpoint.pt  member N's latest published checkpoint (and checkpoint.prev.pt)

A checkpoint is published as the run dir's are (run.checkpoint.save: a temp file, fsync, rename),
so a reader finds the previous or the new one, whole. Nobody waits for anybody: a member reads what
the others have published so far.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from torchbeast_hydra.logs.lineage import (  # noqa: F401 (the table, as members use it)
    COLUMNS,
    TABLE,
    PopulationError,
    append,
    best_member,
    is_population,
    latest_scores,
    read_table,
)
from torchbeast_hydra.run import checkpoint


def member_dir(population_dir: Path, member: int) -> Path:
    return Path(population_dir) / f"member={member}"


def choose_source(
    scores: dict[int, float], me: int, bottom_fraction: float, top_fraction: float, rng: random.Random
) -> int | None:
    """The member to copy when `me` ranks in the bottom fraction of those published, else None: one of
    the top fraction, at random, scoring above `me` (a NaN score, no episode yet, ranks last)."""
    if me not in scores or len(scores) < 2:
        return None

    def rank_key(member: int) -> float:
        return -math.inf if math.isnan(scores[member]) else scores[member]

    ranked = sorted(scores, key=rank_key)
    bottom = ranked[: max(1, int(len(ranked) * bottom_fraction))]
    top = ranked[len(ranked) - max(1, int(len(ranked) * top_fraction)) :]
    if me not in bottom:
        return None
    better = [member for member in top if member != me and rank_key(member) > rank_key(me)]
    return rng.choice(better) if better else None


def published_path(population_dir: Path, member: int) -> Path:
    """Where member's latest published checkpoint is (write it with run.checkpoint.save: atomically)."""
    path = checkpoint.path_in(member_dir(population_dir, member))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def load_published(population_dir: Path, member: int, attempts: int = 3) -> dict:
    """Member's latest published checkpoint. Retried: on a shared filesystem a file being replaced
    can fail to open for a moment (a stale handle)."""
    path = checkpoint.path_in(member_dir(population_dir, member))
    for attempt in range(attempts):
        try:
            return checkpoint.load(path)
        except (checkpoint.CheckpointError, OSError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")
