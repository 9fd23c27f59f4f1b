"""Memory: torchbeast_hydra.backends.memory's estimate beside the measured peak, for a few configs.

    python benchmarks/memory.py                     # the calibration set below
    python benchmarks/memory.py env=pong batch_size=128      # one config of your own
    python benchmarks/memory.py --update env=pong batch_size=1000        # one learner update only

Each config trains until it has logged --updates learner updates (at most --seconds) while the PSS
of the whole process tree is sampled twice a second (shared buffers count once); the estimate is what the entry point
checks before starting. A good estimate sits a little above the peak: never far below it (a config
that cannot fit would start), never far above (a config that fits would be refused).

Figures (2 cores, 24 GB, no GPU, torch 2.13.0 CPU; peak PSS / estimate):
    experiment=cartpole 0.56 / 0.81 GiB; env=pong 1.16 / 1.35; batch_size=32 1.52 / 1.60;
    batch_size=96 2.24 / 2.30; model=resnet batch_size=32 2.72 / 3.10; backend=poly batch_size=32 0.91 / 1.17.
    One update (--update, the activations part): batch 32 0.35 / 0.36 GiB, 96 0.93 / 0.95,
    resnet 32 1.48 / 1.87, batch 1000 6.66 / 9.34.
Those whole-run figures predate the fork server (2026-11-30: run/supervision.py). Since then an
actor's or env client's own memory is 8-10 MB of private pages (USS) beside the server's ~160 MB
shared once, where a spawned one had 142-156 MB (2-core box, CartPole, mono and poly); the
backends' constants follow (backends/settings.py FORK_SERVER_BYTES). Take whole-run peaks on an
otherwise idle machine: PSS splits shared pages among every process that maps them, so other runs
of torch on the machine make it read low.

--update measures one learner update (forward + backward + optimiser step) on a batch of zeros in
a fresh process, by its peak RSS (the kernel's high-water mark, which sampling cannot miss), beside
the estimate's activation part; this calibrated memory.ACTIVATION_FACTOR.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package, as `python -m` runs it
from _common import MemorySampler, cli_command, composed, platform_line  # noqa: E402

CONFIGS = [
    ["experiment=cartpole"],
    ["env=pong"],
    ["env=pong", "batch_size=32"],
    ["env=pong", "batch_size=96"],
    ["env=pong", "model=resnet", "batch_size=32"],
    ["env=pong", "backend=poly", "batch_size=32"],
]
COMMON = ["total_steps=1000000000", "checkpoint_interval_s=100000"]


def estimate(overrides: list):
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.backends import memory
    from torchbeast_hydra.env.spaces import probe_env

    cfg = composed(overrides)
    spec = probe_env(cfg.env)
    return memory.estimate(cfg, spec, make_model(cfg.model, spec))


UPDATE = """
import resource, sys, torch
from hydra import compose, initialize_config_dir
from torchbeast_hydra.__main__ import CONFIG_DIR
from torchbeast_hydra.backends import memory
from torchbeast_hydra.env.layout import zero_rollouts
from torchbeast_hydra.env.spaces import probe_env
from torchbeast_hydra.learning.learner import Learner
from torchbeast_hydra.agent.models import make_model
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    cfg = compose("config", sys.argv[1:])
spec = probe_env(cfg.env)
model = make_model(cfg.model, spec)
learner = Learner(cfg, model, torch.device("cpu"))
T, B = cfg.unroll_length, cfg.batch_size
batch = zero_rollouts(spec, T, B)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
learner.update(batch, model.initial_state(B))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
estimated = memory.ACTIVATION_FACTOR * B * (T + 1) * memory.activation_bytes(model, spec) + memory.UPDATE_OVERHEAD
print(f"{' '.join(sys.argv[1:]):45s} update peak {peak / 2**30:5.2f} GiB  estimate {estimated / 2**30:5.2f} GiB "
      f"({estimated / peak:4.2f}x)")
"""


def measure_update(overrides: list) -> None:
    import subprocess

    repo = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-c", UPDATE, *overrides], cwd=repo, check=True)


def train_for_updates(run_dir: Path, overrides: list, updates: int, seconds: float) -> tuple:
    """Trains until `updates` rows are in logs.csv (or `seconds` pass); returns (updates logged, peak PSS)."""
    import signal
    import subprocess
    import time

    command = cli_command(run_dir, overrides)
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent
    )
    sampler = MemorySampler(process.pid)
    sampler.start()
    deadline, logged = time.monotonic() + seconds, 0
    while time.monotonic() < deadline and process.poll() is None and logged < updates:
        time.sleep(1)
        try:
            logged = len((run_dir / "logs.csv").read_text().splitlines()) - 1
        except OSError:
            pass
    time.sleep(2)  # a few more samples past the last update
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    sampler.stop()
    return logged, sampler.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="at most this long per config")
    parser.add_argument("--updates", type=int, default=5, help="learner updates to wait for")
    parser.add_argument("--update", action="store_true", help="measure one learner update only")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from torchbeast_hydra.backends.memory import GiB, summary

    print(platform_line())
    if args.update:
        measure_update(args.overrides)
        return
    for overrides in [args.overrides] if args.overrides else CONFIGS:
        needed = estimate([*COMMON, *overrides])
        with tempfile.TemporaryDirectory() as tmp:
            updates, peak = train_for_updates(Path(tmp) / "run", [*COMMON, *overrides], args.updates, args.seconds)
        print(
            f"{' '.join(overrides):45s} peak {peak / GiB:5.2f} GiB  estimate {needed.ram_total / GiB:5.2f} GiB "
            f"({needed.ram_total / peak:4.2f}x)  after {updates} updates",
            flush=True,
        )
        print(f"    {summary(needed)}", flush=True)


if __name__ == "__main__":
    main()
