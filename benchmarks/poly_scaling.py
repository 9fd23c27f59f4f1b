"""Poly scaling: steps/s and achieved inference batch sizes with 1, 2, 4, 8 env clients on loopback.

    python benchmarks/poly_scaling.py                           # Pong, atari_net, B=8, T=80
    python benchmarks/poly_scaling.py --clients 1 2 4 8 16 --seconds 60 backend.envs_per_actor=8

Each setting trains for --warmup + --seconds; the rate is measured after the warm-up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import platform_line, read_log, train  # noqa: E402
from throughput import DEFAULTS, mean_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()

    print(f"machine: {platform_line()}")
    print(f"config:  backend=poly {' '.join(DEFAULTS + args.overrides)}")
    print(f"{'clients':>7} {'steps/s':>8} {'inference batch':>16} {'inference ms':>13} {'learner queue':>14}")
    for clients in args.clients:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            overrides = [*DEFAULTS, "backend=poly", f"backend.num_actors={clients}", *args.overrides]
            train(run_dir, overrides, seconds=args.warmup + args.seconds)
            rows = [row for row in read_log(run_dir) if row["time_s"] >= args.warmup]
        if len(rows) < 2:
            print(f"{clients:>7} too few updates after the warm-up; raise --seconds")
            continue
        sps = (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time_s"] - rows[0]["time_s"])
        print(
            f"{clients:>7} {sps:>8,.0f} {mean_of(rows, 'inference_batch_size'):>16.1f} "
            f"{mean_of(rows, 'inference_ms'):>13.2f} {mean_of(rows, 'learner_queue_size'):>14.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
