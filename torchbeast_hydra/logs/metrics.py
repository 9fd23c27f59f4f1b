"""Training statistics: rows (one per learner update) for the sinks, and the console progress line.

A sink is anything with `write(row)` and `close()`: `CsvLog` here (logs.csv), and
`wandb_log.WandbLog`.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Iterable, Protocol

log = logging.getLogger(__name__)

# In a mode=test run dir: a link to the trained run it played (evaluation writes it, analysis reads it).
TRAINED_RUN_LINK = "trained_run"
# The columns logs.csv starts with, in this order. Any other key a row brings (a new loss term,
# a backend's statistic) gets a column of its own when it first appears: nothing is dropped.
# The steps/s figure is measured over this many seconds of recent learner updates.
SPS_WINDOW_S = 30.0

CSV_FIELDS = [
    "step",
    "time_s",
    "sps",
    "mean_episode_return",
    "episode_returns",
    "episodes",
    "total_loss",
    "pg_loss",
    "baseline_loss",
    "entropy_loss",
    "grad_norm",
    "learning_rate",
    "update_ms",  # the learner's time for this update
]


# "The mean return" everywhere (progress line, logs, sweeps' objective, plots, benchmarks): over
# the last 100 episodes, as TorchBeast and the papers report it.
RECENT_EPISODES = 100


class RecentReturns:
    """The last `window` episode returns and their mean: the one place that mean is taken."""

    def __init__(self, window: int = RECENT_EPISODES, returns: Iterable[float] = ()):
        self._returns = collections.deque(returns, maxlen=window)

    def extend(self, returns: Iterable[float]) -> None:
        self._returns.extend(returns)

    def __len__(self) -> int:
        return len(self._returns)

    def __iter__(self):
        return iter(self._returns)

    @property
    def full(self) -> bool:
        return len(self._returns) == self._returns.maxlen

    @property
    def mean(self) -> float | None:
        """None before the first episode."""
        return sum(self._returns) / len(self._returns) if self._returns else None


def recent_means(returns_per_row: Iterable[list], window: int = RECENT_EPISODES) -> list:
    """After each row, the mean of the last `window` episode returns so far (None before any)."""
    recent, means = RecentReturns(window), []
    for returns in returns_per_row:
        recent.extend(returns)
        means.append(recent.mean)
    return means


def target_met(scores: Iterable[tuple[int, float]], target: float, confirmations: int = 0) -> tuple | None:
    """(step, score) of the evaluation at which `target` counts as met: the first to reach it whose
    `confirmations` evaluations before it all reached it too (eval.stop_confirmations); None if none.
    scores: (step, mean return) of a run's evaluations in order (eval.csv's periodic rows)."""
    streak = 0
    for step, score in scores:
        streak = streak + 1 if score >= target else 0
        if streak > confirmations:
            return step, score
    return None


LOGS = "logs.csv"
# A kept run's training log (analysis.runs.copy_run): the columns a report reads, gzipped (a third
# of the text's size; docs/reports/ keeps hundreds). Every reader takes either.
KEPT_LOGS = "logs.csv.gz"


def logs_file(run_dir: str | os.PathLike) -> Path | None:
    """A run dir's training log: its logs.csv, else a kept run's logs.csv.gz; None if it has neither."""
    for name in (LOGS, KEPT_LOGS):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None


def open_csv(path: str | os.PathLike, mode: str = "r"):
    """A csv of this package's for text, gzipped where its name ends in .gz (written without a
    timestamp, so the same rows give the same bytes)."""
    if str(path).endswith(".gz"):
        if "w" in mode:
            return io.TextIOWrapper(gzip.GzipFile(path, mode + "b", mtime=0), encoding="utf-8", newline="")
        return gzip.open(path, mode + "t", encoding="utf-8", newline="")
    return open(path, mode, newline="")


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a csv this package writes (logs.csv or a kept run's logs.csv.gz, eval.csv; a
    run dir means its training log), as dicts: numbers parsed, blank cells None, episode_returns a
    list. A torn last row (the run is still writing it) is left out. The one reader of these files:
    plots, reports, benchmarks, the sweeper's objective and the tests all read through it."""
    path = Path(path)
    if path.is_dir():
        path = logs_file(path) or path / LOGS
    with open_csv(path) as f:
        raw = list(csv.DictReader(f))
    rows = []
    for row in raw:
        if not _complete(row):
            break  # a torn row: the run is still writing it
        rows.append({key: _cell(key, value) for key, value in row.items()})
    return rows


def _complete(row: dict) -> bool:
    """Whether a csv row has all its cells (no more, no fewer) and a step."""
    return None not in row.values() and None not in row and _int(row.get("step")) < math.inf


def _cell(key: str, text: str):
    if key == "episode_returns":
        return json.loads(text or "[]")
    if text == "":
        return None
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


class Sink(Protocol):
    def write(self, row: dict) -> None: ...

    def close(self) -> None: ...


class CsvLog:
    """Appends rows to logs.csv; on resume, drops rows past the checkpoint so none repeat.

    The header is CSV_FIELDS plus every other key seen so far, in order of appearance. A row with
    a new key rewrites the file once with the wider header (earlier rows get empty cells), so the
    csv stays one rectangular table across resumes and code changes.
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None, fields=CSV_FIELDS):
        self.path = Path(path)
        exists = self.path.exists() and self.path.stat().st_size > 0
        header, rows, torn = self._read() if exists else ([], [], False)
        self.fields = header + [f for f in fields if f not in header]
        kept = rows if resume_step is None else [r for r in rows if _int(r.get("step")) <= resume_step]
        if not exists or torn or kept != rows or self.fields != header:
            self._rewrite(kept)
        self._open()

    def _read(self) -> tuple[list, list, bool]:
        """(header, complete rows, whether a torn row was dropped). A row cut short by a kill is
        dropped, and so is a last line with no line end, however many cells it has: appending after
        it would glue the next row onto it."""
        with open(self.path, newline="") as f:
            text = f.read()
        whole = text[: text.rfind("\n") + 1]  # up to the last line end
        reader = csv.DictReader(io.StringIO(whole, newline=""))
        read = list(reader)
        rows = [row for row in read if _complete(row)]
        return list(reader.fieldnames or []), rows, len(rows) < len(read) or whole != text

    def _rewrite(self, rows: list) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def _open(self) -> None:
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, self.fields, extrasaction="ignore")

    def write(self, row: dict) -> None:
        new = [key for key in row if key not in self.fields]
        if new:  # a column logs.csv has not had yet: widen the header once
            self._file.close()
            _, rows, _ = self._read()
            self.fields += new
            self._rewrite(rows)
            self._open()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def measured(value: float | None, digits: int = 2):
    """A backend's figure for a row: rounded, or blank in logs.csv where nothing was measured."""
    return "" if value is None else round(value, digits)


def _int(value) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return math.inf  # a torn last line: drop it


class Stats:
    """Folds learner updates into CSV rows and keeps recent returns for the progress line."""

    def __init__(self, start_step: int, total_steps: int, sinks: Iterable[Sink] = (), start_time_s: float = 0.0):
        """start_time_s: training time before this process (a resumed run's clock goes on)."""
        self.step = start_step
        self.total_steps = total_steps
        self.sinks = list(sinks)
        self.recent_returns = RecentReturns()
        self.episodes = 0
        self.last = {}
        self._start_time = time.monotonic() - start_time_s
        # (time, step) after each recent update, from the first update on: start-up (spawning
        # actors, the first rollouts) is not throughput, and old updates leave the window.
        self._rate_window = collections.deque()

    def record(self, steps: int, episode_returns: list, update_stats: dict, queues: dict) -> dict:
        now = time.monotonic()
        self.step += steps
        self._rate_window.append((now, self.step))
        while len(self._rate_window) > 2 and now - self._rate_window[1][0] >= SPS_WINDOW_S:
            self._rate_window.popleft()
        sps = self.sps
        self.recent_returns.extend(episode_returns)
        self.episodes += len(episode_returns)
        row = dict(
            step=self.step,
            time_s=round(now - self._start_time, 3),
            sps="" if sps is None else round(sps, 2),  # none until a second update
            mean_episode_return=(sum(episode_returns) / len(episode_returns)) if episode_returns else "",
            episode_returns=json.dumps(episode_returns),
            episodes=self.episodes,
            **update_stats,
            **queues,
        )
        self.last = row
        for sink in self.sinks:
            sink.write(row)
        return row

    def close(self) -> None:
        """Closes every sink, even when one fails (the first error is raised after)."""
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]

    @property
    def elapsed_s(self) -> float:
        """Training time so far, across resumes (logs.csv's time_s)."""
        return time.monotonic() - self._start_time

    @property
    def sps(self) -> float | None:
        """Agent steps per second over the last SPS_WINDOW_S seconds of updates (None before two)."""
        if len(self._rate_window) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate_window[0], self._rate_window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    @property
    def mean_recent_return(self) -> float | None:
        return self.recent_returns.mean

    def progress_line(self) -> str:
        sps = self.sps
        if sps:
            rate = f"@ {sps:,.0f} SPS, ETA {duration(max(0, self.total_steps - self.step) / sps)}"
        elif not self._rate_window:
            rate = "waiting for the first rollouts"
        else:
            rate = "@ measuring SPS"  # until the second update
        done = min(100.0, 100 * self.step / self.total_steps)  # the last batch may end past total_steps
        return f"step {self.step:,}/{self.total_steps:,} ({done:.1f}%) {rate}. {self.returns_text()}"

    def returns_text(self) -> str:
        mean = self.mean_recent_return
        returns = f"{mean:.2f} over last {len(self.recent_returns)} episodes" if mean is not None else "n/a"
        return f"Return {returns}.{self.loss_text()}"

    def loss_text(self) -> str:
        """' Loss 1.234 (pg 0.1, baseline 1.2, entropy -0.066).': the sum and its named terms."""
        loss = self.last.get("total_loss")
        if not isinstance(loss, float):
            return ""
        terms = [
            f"{key.removesuffix('_loss')} {value:.3g}"
            for key, value in self.last.items()
            if key.endswith("_loss") and key != "total_loss" and isinstance(value, float)
        ]
        return f" Loss {loss:.3f}" + (f" ({', '.join(terms)})." if terms else ".")


def duration(seconds: float) -> str:
    """'1h05m', '3m07s': for progress lines and summaries."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
