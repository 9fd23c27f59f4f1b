"""A population's lineage table (population-based training, torchbeast_hydra/pbt/): POP/pbt.csv,
one row per event of any member, appended whole under an exclusive flock on POP/.pbt.lock.

Members racing on one filesystem (Linux NFS maps flock to its byte-range locks) never interleave;
a row cut short by a member killed while writing is skipped by readers and ended by the next writer.
Here, beside the run's other tables, so that the report reads it as pbt/ writes it.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import math
import os
from pathlib import Path

TABLE = "pbt.csv"
LOCK = ".pbt.lock"
# The table's columns before the mutated keys' (one column each, their value after the event).
COLUMNS = ("time", "member", "step", "event", "score", "exploited_from", "from_step", "run_dir")


class PopulationError(RuntimeError):
    """The population's dir cannot be used as asked; the message says what to do."""


def is_population(directory: Path) -> bool:
    return (Path(directory) / TABLE).is_file()


@contextlib.contextmanager
def locked(population_dir: Path, exclusive: bool):
    """Holds the population's lock (shared for reading the table, exclusive for appending)."""
    with open(Path(population_dir) / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def append(population_dir: Path, row: dict, keys: list) -> None:
    """Appends one row (COLUMNS, then the mutated keys' values) to the table, whole, under the lock."""
    path = Path(population_dir) / TABLE
    fields = [*COLUMNS, *keys]
    with locked(population_dir, exclusive=True), open(path, "a+b") as table:  # appends land at the end
        table.seek(0)
        header = table.readline().decode()
        if not header:
            table.write(_line(fields))
        elif next(csv.reader([header])) != fields:
            raise PopulationError(
                f"{path} belongs to a population that mutates other keys ({header.strip()}): give this one a "
                "dir of its own (pbt.dir=...)."
            )
        else:
            table.seek(-1, os.SEEK_END)
            if table.read(1) != b"\n":  # a row cut short by a member killed while writing: end it
                table.write(b"\n")
        table.write(_line([_cell(row.get(field)) for field in fields]))
        table.flush()
        os.fsync(table.fileno())


def _line(values: list) -> bytes:
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(values)
    return text.getvalue().encode()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def read_table(population_dir: Path) -> list[dict]:
    """The table's whole rows, typed (member, step, from_step: int; score, values: float)."""
    path = Path(population_dir) / TABLE
    if not path.exists():
        return []
    with locked(population_dir, exclusive=False):
        text = path.read_text()
    lines = text.splitlines()
    if not lines:
        return []
    fields = next(csv.reader([lines[0]]))
    rows = []
    for values in csv.reader(lines[1:]):
        if len(values) != len(fields):  # cut short by a kill: skipped
            continue
        try:
            rows.append({field: _typed(field, value) for field, value in zip(fields, values)})
        except ValueError:
            continue
    return rows


def _typed(field: str, value: str):
    if value == "":
        return None
    if field in ("member", "step", "from_step", "exploited_from"):
        return int(value)
    if field in ("event", "run_dir"):
        return value
    return float(value)


def latest_scores(rows: list[dict]) -> dict[int, tuple[int, float]]:
    """member -> (step, score) of its latest publish."""
    latest = {}
    for row in rows:
        if row["event"] == "publish" and row["score"] is not None:
            latest[row["member"]] = (row["step"], row["score"])
    return latest


def best_member(population_dir: Path) -> tuple[int, dict]:
    """(member, its latest row) of the best latest published score: what mode=test plays."""
    latest = {}
    for row in read_table(population_dir):
        if row["event"] == "publish" and row["score"] is not None and not math.isnan(row["score"]):
            latest[row["member"]] = row
    if not latest:
        raise PopulationError(f"{population_dir} has no published score yet ({TABLE}): nothing to play.")
    member = max(latest, key=lambda m: latest[m]["score"])
    return member, latest[member]
