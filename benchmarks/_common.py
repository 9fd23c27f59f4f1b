"""Helpers for the benchmarks: run the CLI, sample the memory of its process tree, read logs.csv."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
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


def cli_command(run_dir: Path, overrides: list) -> list:
    # wandb off unless an override turns it on: the figures measure training, as before wandb.
    return [
        sys.executable,
        "-m",
        "torchbeast_hydra",
        f"hydra.run.dir={run_dir}",
        "logger.wandb.mode=disabled",
        *overrides,
    ]


def train(run_dir: Path, overrides: list, seconds: float | None = None, timeout: float = 3600):
    """Runs training; with `seconds`, stops it (SIGTERM) after that long. Returns (rc, wall, peak)."""
    command = cli_command(run_dir, overrides)
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sampler = MemorySampler(process.pid)
    sampler.start()
    try:
        process.wait(timeout=seconds if seconds is not None else timeout)
    except subprocess.TimeoutExpired:
        if seconds is None:
            process.kill()
            raise
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    sampler.stop()
    return process.returncode, time.monotonic() - started, sampler.peak


def read_log(run_dir: Path) -> list:
    """logs.csv's rows with step, time_s and episode_returns parsed; a torn last row (the run is
    still writing) is left out."""
    with open(run_dir / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    parsed = []
    for row in rows:
        try:
            row["step"] = int(row["step"])
            row["time_s"] = float(row["time_s"])
            row["episode_returns"] = json.loads(row["episode_returns"] or "[]")
        except (TypeError, ValueError):
            break
        parsed.append(row)
    return parsed


def platform_line() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}"
