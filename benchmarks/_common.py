"""Helpers for the benchmarks: run the CLI, sample the memory, CPU time and GPU of its process tree,
read logs.csv and its steady state."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def process_tree(pid: int) -> list:
    """pid and all its descendants, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


def pss_bytes(pids: list) -> int:
    """Proportional set size: shared memory (rollout buffers, the shared model) counted once."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def cpu_seconds(pids: list) -> float:
    """user + system CPU seconds of these processes so far (from /proc; 0 where unreadable)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            continue
    return total / ticks


class MemorySampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self._finished = threading.Event()

    def run(self):
        while not self._finished.wait(self.interval):
            self.peak = max(self.peak, pss_bytes(process_tree(self.pid)))

    def stop(self):
        self._finished.set()
        self.join()


class GpuSampler(threading.Thread):
    """Samples GPU utilisation (%) with nvidia-smi every second; empty without a GPU."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples = []
        self._finished = threading.Event()
        self.available = shutil.which("nvidia-smi") is not None

    def run(self):
        while self.available and not self._finished.wait(1.0):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                self.samples.append(float(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def stop(self) -> str:
        self._finished.set()
        self.join()
        if not self.samples:
            return "no GPU" if not self.available else "n/a"
        return f"{statistics.fmean(self.samples):.0f}% mean, {statistics.median(self.samples):.0f}% median"


def composed(overrides: list):
    """The config a run of these overrides uses: composed as the CLI composes it, then resolved as it
    resolves it (auto actor counts filled in for this machine)."""
    from hydra import compose, initialize_config_dir

    from torchbeast_hydra.__main__ import CONFIG_DIR
    from torchbeast_hydra.config import validate

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose("config", overrides))


def cli_command(run_dir: Path, overrides: list, flags: tuple = ()) -> list:
    """flags (e.g. --config-dir=DIR) go before the overrides, where Hydra's parser takes them."""
    # wandb off unless an override turns it on: the figures measure training, as before wandb.
    return [
        sys.executable,
        "-m",
        "torchbeast_hydra",
        *flags,
        f"hydra.run.dir={run_dir}",
        "logger.wandb.mode=disabled",
        *overrides,
    ]


@dataclass
class Trained:
    rc: int
    wall: float  # seconds, the whole run
    peak: int  # bytes, PSS of the process tree
    # CPU seconds per process role over the measured window (after the warm-up): PROCESS_ROLES
    cpu: dict = field(default_factory=dict)
    window_s: float = 0.0  # the window's length


def train(run_dir: Path, overrides: list, seconds: float | None = None, warmup: float = 0.0, timeout: float = 3600):
    """Runs training; with `seconds`, stops it (SIGTERM) once it has trained that long by its own
    clock (logs.csv's time_s, which starts with training, not with the process: a slow start-up, of
    several ranks say, takes nothing from the time measured), and samples the CPU time of each of
    its processes from `warmup` seconds of training to the stop."""
    command = cli_command(run_dir, overrides)
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sampler = MemorySampler(process.pid)
    sampler.start()
    cpu, window = {}, 0.0
    try:
        # The log is read only until training starts (its first row dates the clock); then plain
        # waits, so that the benchmark takes no CPU from the run it measures.
        deadline = started + timeout
        while seconds is not None and process.poll() is None and time.monotonic() < deadline:
            if (trained := _trained_for(run_dir)) is not None:
                deadline = min(deadline, time.monotonic() + seconds - trained)
                if _wait(process, time.monotonic() + warmup - trained):
                    before, window = cpu_by_process(process.pid), time.monotonic()
                    if _wait(process, deadline):
                        cpu, window = cpu_by_role(before, cpu_by_process(process.pid)), time.monotonic() - window
                break
            time.sleep(0.5)
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if seconds is None or time.monotonic() - started >= timeout:
                process.kill()
                raise
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    finally:
        sampler.stop()
    return Trained(process.returncode, time.monotonic() - started, sampler.peak, cpu, window)


def _wait(process: subprocess.Popen, until: float) -> bool:
    """Waits until the monotonic time `until`; False if the process ended first."""
    try:
        process.wait(timeout=max(0.0, until - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        return True


# What each process of a run is, by its command line (the first match); the run's own is the learner's.
PROCESS_ROLES = (
    ("forkserver", "actors (mono) / env clients (poly)"),  # forked from the fork server (run/supervision.py)
    ("spawn_main", "actors (mono) / env clients (poly)"),  # where there is none
    ("resource_tracker", "other (resource tracker, wandb)"),
    ("wandb", "other (resource tracker, wandb)"),
)


def cpu_by_process(root: int) -> dict:
    """pid -> (role, CPU seconds so far) for root and its descendants."""
    seconds = {}
    for pid in process_tree(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        role = "learner process (poly: + server, inference)" if pid == root else None
        if _comm(pid) == SHARD_NAME:
            role = "server shards (poly)"
        role = role or next((name for key, name in PROCESS_ROLES if key in cmdline), "other")
        seconds[pid] = (role, cpu_seconds([pid]))
    return seconds


SHARD_NAME = "poly-shard"  # a server shard process's name (shards.py sets it)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cpu_by_role(before: dict, after: dict) -> dict:
    """role -> CPU seconds spent between two cpu_by_process samples (a process started between
    them, a replaced actor say, counts from zero)."""
    spent = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return spent


def _trained_for(run_dir: Path) -> float | None:
    """Seconds of training the run has logged so far; None before its first row."""
    from torchbeast_hydra.logs.metrics import read_rows

    rows = read_rows(run_dir) if (run_dir / "logs.csv").exists() else []
    return rows[-1]["time_s"] if rows else None


def steady_rate(rows: list, warmup: float) -> tuple[list, float | None]:
    """The rows logged after the warm-up and their steps/s (None with fewer than two such rows)."""
    steady = [row for row in rows if row["time_s"] >= warmup]
    if len(steady) < 2:
        return steady, None
    return steady, (steady[-1]["step"] - steady[0]["step"]) / (steady[-1]["time_s"] - steady[0]["time_s"])


def mean_of(rows: list, key: str) -> float | None:
    """The mean of a logs.csv column over these rows; None where no row has it (another backend's)."""
    values = [float(row[key]) for row in rows if row.get(key) not in (None, "")]
    return sum(values) / len(values) if values else None


def steps_per_update(rows: list) -> float:
    """Env steps a learner update consumed, on average over these rows (one row per update)."""
    return (rows[-1]["step"] - rows[0]["step"]) / (len(rows) - 1)


def platform_line() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}"
