"""Throughput: training steps/s for a config, beside the raw env step rate on this machine.

    python benchmarks/throughput.py                       # Pong, atari_net, B=8, T=80, mono
    python benchmarks/throughput.py --seconds 120 backend.envs_per_actor=4
    python benchmarks/throughput.py backend=poly         # the same on the poly backend

Runs training for --seconds (after a warm-up that is excluded from the rate), then prints the
steady-state steps/s, the single-env step rate measured in the same run, and peak memory (PSS of
the whole process tree, so shared buffers count once), then where the CPU time of a step goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import platform_line, read_log, train  # noqa: E402

DEFAULTS = [
    "env=pong",
    "model=atari_net",
    "batch_size=8",
    "unroll_length=80",
    "total_steps=1000000000",
    "checkpoint_interval_s=100000",
]


def env_steps_per_second(env_id: str, seconds: float = 5.0) -> float:
    from torchbeast_hydra.config import AtariEnvConfig
    from torchbeast_hydra.envs import Environments

    envs = Environments(AtariEnvConfig(id=env_id), 1, seed=0)
    envs.initial()
    rng = np.random.default_rng(0)
    actions = rng.integers(0, envs.spec.num_actions, size=(100_000, 1))
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        envs.step(actions[steps % len(actions)])
        steps += 1
    envs.close()
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0, help="training time to measure")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds excluded at the start")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the run")
    args = parser.parse_args()
    overrides = DEFAULTS + args.overrides

    env_id = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("env.id=")), "ALE/Pong-v5")
    raw = env_steps_per_second(env_id)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        rc, wall, peak = train(run_dir, overrides, seconds=args.warmup + args.seconds)
        rows = read_log(run_dir)
    steady = [row for row in rows if row["time_s"] >= args.warmup]
    if len(steady) < 2:
        sys.exit(f"too few learner updates after the warm-up ({len(rows)} in all); raise --seconds")
    sps = (steady[-1]["step"] - steady[0]["step"]) / (steady[-1]["time_s"] - steady[0]["time_s"])
    print(f"config:        {' '.join(args.overrides) or '(defaults)'}  [{' '.join(DEFAULTS)}]")
    print(f"machine:       {platform_line()}")
    print(f"raw env:       {raw:,.0f} steps/s ({env_id}, one env, one core, random actions)")
    print(
        f"training:      {sps:,.0f} steps/s over {steady[-1]['time_s'] - steady[0]['time_s']:.0f} s "
        f"after {args.warmup:.0f} s warm-up ({rows[-1]['step']:,} steps in {wall:.0f} s wall, exit {rc})"
    )
    print(f"peak memory:   {peak / 2**20:,.0f} MiB (PSS, whole process tree)")
    print_breakdown(steady, sps, raw)


def mean_of(rows: list, key: str) -> float | None:
    values = [float(row[key]) for row in rows if row.get(key) not in (None, "")]
    return sum(values) / len(values) if values else None


def print_breakdown(rows: list, sps: float, raw_env_sps: float) -> None:
    """Core-milliseconds per env step: env, learner, central inference (poly), and the rest."""
    steps_per_update = mean_of([dict(d=b["step"] - a["step"]) for a, b in zip(rows, rows[1:])], "d")
    parts = {"env step (one core)": 1000 / raw_env_sps}
    update_ms = mean_of(rows, "update_ms")
    if update_ms is not None and steps_per_update:
        parts["learner update"] = update_ms / steps_per_update
    inference_ms, batch = mean_of(rows, "inference_ms"), mean_of(rows, "inference_batch_size")
    if inference_ms is not None and batch:
        parts[f"central inference (mean batch {batch:.1f})"] = inference_ms / batch
    budget = (os.cpu_count() or 1) * 1000 / sps
    print(f"per step:      {budget:.2f} core-ms available at this rate on {os.cpu_count()} cores; of which")
    for name, ms in parts.items():
        print(f"  {name + ':':42s} {ms:.2f} ms")
    print(f"  {'the rest (acting, messages, copies, idle):':42s} {budget - sum(parts.values()):.2f} ms")


if __name__ == "__main__":
    main()
