"""Scaling: how fast each backend runs on this machine, and where a step's time goes.

    python benchmarks/scaling.py train                  # mono and poly on Pong, actors sized to the machine
    python benchmarks/scaling.py train --backends poly --seconds 120 backend.num_actors=16
    python benchmarks/scaling.py pipeline               # poly's own ceiling: zero-cost env, trivial policy
    python benchmarks/scaling.py pipeline --clients 2 --envs 64 128 256
    python benchmarks/scaling.py pipeline --learner cli --obs cartpole experiment=cartpole

train: trains each backend for --warmup + --seconds and prints steps/s, steps/s per core,
efficiency = steps/s / (cores x the raw single-env rate measured in the same run), GPU
utilisation (when there is a GPU) and the per-step cost breakdown from logs.csv.

pipeline: isolates our overhead from env and model cost. Env client processes step a zero-cost
env (the same Pong-shaped frames, 4x84x84 uint8, every step) through the real client code; the
ActorPool server answers with a trivial policy in its dynamic batches and assembles the unrolls;
a learner takes batches as they come (stacks them, as the real learner does) without the math.
Prints the ceiling in env-steps/s, wall microseconds per env-step and CPU microseconds per
env-step (all processes; the figure that stays comparable when other work shares the machine).
--learner cli runs the real learner instead (`backend.role=learner` with the given overrides).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import platform_line, process_tree, read_log, train  # noqa: E402
from throughput import DEFAULTS, env_steps_per_second, mean_of  # noqa: E402

OBS = dict(pong=((4, 84, 84), "uint8", 6), cartpole=((4,), "float32", 2))


# -- CPU time and GPU utilisation -------------------------------------------------------------------


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
        return f"{np.mean(self.samples):.0f}% mean, {np.median(self.samples):.0f}% median"


# -- train mode ---------------------------------------------------------------------------------------


def run_backend(backend: str, overrides: list, warmup: float, seconds: float) -> dict:
    gpu = GpuSampler()
    gpu.start()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        rc, wall, peak = train(run_dir, [*DEFAULTS, f"backend={backend}", *overrides], seconds=warmup + seconds)
        rows = read_log(run_dir)
    utilisation = gpu.stop()
    steady = [row for row in rows if row["time_s"] >= warmup]
    if len(steady) < 2:
        sys.exit(
            f"{backend}: too few learner updates after the warm-up ({len(rows)} in all, exit {rc}); raise --seconds"
        )
    elapsed = steady[-1]["time_s"] - steady[0]["time_s"]
    return dict(
        rows=steady, sps=(steady[-1]["step"] - steady[0]["step"]) / elapsed, gpu=utilisation, peak=peak, elapsed=elapsed
    )


def breakdown(rows: list, raw_env_sps: float) -> dict:
    """Core-microseconds per env step by part, from what the backends log in logs.csv."""
    steps_per_update = np.mean([b["step"] - a["step"] for a, b in zip(rows, rows[1:])])
    parts = {"env (raw, one core)": 1e6 / raw_env_sps}
    per_step = {
        "inference": ("inference_ms", "inference_batch_size"),  # poly: per pass, over the batch's envs
        "acting (actors' policy + writes)": ("acting_us_per_step", None),  # mono, per env step
        "transport + assembly (server)": ("server_us_per_step", None),  # poly, per env step
        "batch gathering (learner)": ("gather_ms", "steps_per_update"),
        "learner update": ("update_ms", "steps_per_update"),
    }
    for name, (key, per) in per_step.items():
        value = mean_of(rows, key)
        if value is None:
            continue
        if per == "steps_per_update":
            parts[name] = 1000 * value / steps_per_update
        elif per is not None:
            batch = mean_of(rows, per)
            if batch:
                parts[name] = 1000 * value / batch
        else:
            parts[name] = value
    return parts


def train_mode(args) -> None:
    cores = os.cpu_count() or 1
    env_id = next((o.split("=", 1)[1] for o in reversed(args.overrides) if o.startswith("env.id=")), "ALE/Pong-v5")
    print(f"machine: {platform_line()}")
    print(f"config:  {' '.join(DEFAULTS + args.overrides)}")
    for backend in args.backends:
        raw = env_steps_per_second(env_id)  # in the same run, just before: the machine as it is now
        result = run_backend(backend, args.overrides, args.warmup, args.seconds)
        sps = result["sps"]
        print(
            f"\n{backend}: {sps:,.0f} steps/s over {result['elapsed']:.0f} s, {sps / cores:,.0f} per core, "
            f"efficiency {sps / (cores * raw):.2f} (raw env {raw:,.0f} steps/s on one core); "
            f"GPU {result['gpu']}; peak memory {result['peak'] / 2**20:,.0f} MiB",
            flush=True,
        )
        budget = cores * 1e6 / sps
        print(f"  per step: {budget:,.0f} core-us available at this rate on {cores} cores; of which")
        parts = breakdown(result["rows"], raw)
        for name, us in parts.items():
            print(f"    {name + ':':36s} {us:8.1f} us")
        print(f"    {'the rest (messages, idle, ...):':36s} {budget - sum(parts.values()):8.1f} us", flush=True)


# -- pipeline mode --------------------------------------------------------------------------------


class FixedFrames:
    """A zero-cost env maker for EnvClient: the same frames every step, no episode ever ends."""

    def __init__(self, obs_shape: tuple, obs_dtype: str, num_actions: int):
        from torchbeast_hydra.envs import EnvSpec

        self.spec = EnvSpec(tuple(obs_shape), np.dtype(obs_dtype), num_actions)

    def __call__(self, num_envs: int, seed: int):
        return _Fixed(self.spec, num_envs)


class _Fixed:
    def __init__(self, spec, n: int):
        from torchbeast_hydra import layout

        self.out = layout.env_outputs(spec, n)  # the env keys, as real envs have them
        self.out["frame"][:] = 7
        self.out["done"][:] = False

    def initial(self) -> dict:
        return self.out

    def step(self, actions) -> dict:
        self.out["last_action"][:] = actions
        self.out["episode_step"] += 1
        return self.out

    def close(self) -> None:
        pass


def trivial_policy(num_actions: int):
    import torch

    def policy(inputs: dict) -> dict:
        n = inputs["frame"].shape[0]
        return dict(
            action=torch.zeros(n, dtype=torch.int64), policy_logits=torch.zeros(n, num_actions), baseline=torch.zeros(n)
        )

    return policy


class NullLearner:
    """The learner side of poly without the math: the server, central inference, batch stacking."""

    def __init__(self, maker: FixedFrames, args):
        import torch

        from torchbeast_hydra.poly import wire
        from torchbeast_hydra.poly.batcher import DynamicBatcher
        from torchbeast_hydra.poly.rollouts import RolloutQueue
        from torchbeast_hydra.poly.server import ActorPool, ServerSettings, make_server

        self.args = args
        self.token = secrets.token_urlsafe(16)
        self.rollouts = RolloutQueue(args.learner_queue_size)
        self.inference = DynamicBatcher(
            trivial_policy(maker.spec.num_actions),
            args.max_batch_size,
            args.batch_timeout_ms / 1000,
            producers=lambda: self.pool.connected,
            setup=lambda: torch.set_num_threads(1),
            name="inference",
        )
        settings = ServerSettings(
            env_id="FixedFrames",
            unroll_length=args.unroll_length,
            chunk_size=args.batch_size,
            cut_at_reset=True,
            seed=0,
            max_envs_per_client=max(args.envs),
            max_clients=max(args.clients),
            client_idle_timeout_s=60.0,
        )
        self.pool = ActorPool(
            maker.spec,
            settings,
            token=self.token,
            inference=self.inference,
            initial_state=lambda n: (),
            emit=self._enqueue,
        )
        self.max_bytes = wire.max_message_bytes(maker.spec.obs_shape, maker.spec.obs_dtype, max(args.envs))
        self.server, port = make_server(self.pool, "127.0.0.1:0", self.max_bytes)
        self.address = f"127.0.0.1:{port}"
        self.steps = 0
        self.batches = 0
        self.gather_s = 0.0
        self.server.start()
        self._thread = threading.Thread(target=self._learn, daemon=True)
        self._thread.start()

    def _enqueue(self, rollouts, core_state) -> None:
        self.rollouts.put(rollouts, core_state, self.pool.stopping)

    def _learn(self) -> None:
        while True:
            started = time.perf_counter()
            got = self.rollouts.get_batch(self.args.batch_size, self.pool.stopping.is_set)
            if got is None:
                return
            self.steps += int(got[0]["mask"][1:].sum())
            self.gather_s += self.rollouts.assembly_s
            self.batches += 1
            del started

    def stop(self) -> None:
        self.pool.stop(finished=True)
        deadline = time.monotonic() + 5
        while self.pool.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        self.inference.close()
        self.server.stop(grace=1.0).wait()
        self._thread.join()


def start_clients(maker, address: str, token: str, clients: int, envs: int, max_bytes: int) -> list:
    import torch.multiprocessing as mp

    from torchbeast_hydra.config import EnvConfig
    from torchbeast_hydra.poly.client import client_main

    ctx = mp.get_context("spawn")
    processes = [
        ctx.Process(
            target=client_main,
            daemon=True,
            args=(EnvConfig(id="FixedFrames"), address, token, envs, 60, max_bytes, True, maker),
        )
        for _ in range(clients)
    ]
    for process in processes:
        process.start()
    return processes


def measure_null(maker, args, clients: int, envs: int) -> dict:
    learner = NullLearner(maker, args)
    processes = start_clients(maker, learner.address, learner.token, clients, envs, learner.max_bytes)
    try:
        time.sleep(args.warmup)
        pids = process_tree(os.getpid())
        steps0, batches0, gather0 = learner.steps, learner.batches, learner.gather_s
        cpu0, own0, started = cpu_seconds(pids), cpu_seconds([os.getpid()]), time.perf_counter()
        time.sleep(args.seconds)
        steps, elapsed = learner.steps - steps0, time.perf_counter() - started
        cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds([os.getpid()]) - own0
        batches, gather = learner.batches - batches0, learner.gather_s - gather0
        inference = learner.inference.take_stats()
        server_us = learner.pool.take_step_stats()
    finally:
        learner.stop()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return dict(
        sps=steps / elapsed,
        cpu_us=1e6 * cpu / max(steps, 1),
        learner_cpu_us=1e6 * own / max(steps, 1),
        steps=steps,
        gather_us=1e6 * gather / max(steps, 1),
        batches=batches,
        inference_batch=np.mean([size for size, _ in inference]) if inference else 0.0,
        server_us=server_us,
    )


def measure_cli(maker, args, clients: int, envs: int) -> dict:
    """The real learner (role=learner, with the given overrides) fed by zero-cost clients."""
    from _common import cli_command

    from torchbeast_hydra.poly import wire

    token = secrets.token_urlsafe(16)
    max_bytes = wire.max_message_bytes(maker.spec.obs_shape, maker.spec.obs_dtype, max(envs, 256))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = cli_command(
            run_dir,
            [
                "backend=poly",
                "backend.role=learner",
                "total_steps=1000000000",
                "checkpoint_interval_s=100000",
                f"backend.max_envs_per_client={max(envs, 256)}",
                *args.overrides,
            ],
        )
        learner = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, TORCHBEAST_TOKEN=token)
        )
        processes = []
        try:
            address_file = run_dir / "actorpool_address"
            deadline = time.monotonic() + 120
            while not address_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            address = address_file.read_text().strip()
            processes = start_clients(maker, address, token, clients, envs, max_bytes)
            time.sleep(args.warmup)
            pids = process_tree(os.getpid())
            cpu0, own0 = cpu_seconds(pids), cpu_seconds([learner.pid])
            time.sleep(args.seconds)
            cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds([learner.pid]) - own0
            rows = [row for row in read_log(run_dir) if row["time_s"] >= args.warmup]
        finally:
            learner.terminate()
            learner.wait(timeout=60)
            for process in processes:
                process.kill()
                process.join()
    if len(rows) < 2:
        sys.exit("too few learner updates after the warm-up; raise --seconds")
    steps, elapsed = rows[-1]["step"] - rows[0]["step"], rows[-1]["time_s"] - rows[0]["time_s"]
    measured = max(steps * args.seconds / elapsed, 1)
    return dict(
        sps=steps / elapsed,
        cpu_us=1e6 * cpu / measured,
        learner_cpu_us=1e6 * own / measured,
        steps=steps,
        gather_us=1000 * (mean_of(rows, "gather_ms") or 0) / np.mean(np.diff([r["step"] for r in rows])),
        inference_batch=mean_of(rows, "inference_batch_size") or 0.0,
        server_us=mean_of(rows, "server_us_per_step"),
        update_us=1000 * (mean_of(rows, "update_ms") or 0) / np.mean(np.diff([r["step"] for r in rows])),
        queue=mean_of(rows, "learner_queue_size"),
    )


def pipeline_mode(args) -> None:
    maker = FixedFrames(*OBS[args.obs])
    print(f"machine: {platform_line()}; load average {os.getloadavg()[0]:.1f} at the start")
    shape = (
        f"B={args.batch_size}, T={args.unroll_length}, max_batch_size={args.max_batch_size}"
        if args.learner == "none"
        else f"the learner's config: {' '.join(args.overrides) or 'defaults'}"
    )
    print(
        f"pipeline: {args.obs} frames {list(maker.spec.obs_shape)} {maker.spec.obs_dtype}, "
        f"learner={args.learner}, {shape}, {args.warmup:g} s warm-up + {args.seconds:g} s"
    )
    extra = "  update us/step  queue" if args.learner == "cli" else ""
    print(
        f"{'clients':>7} {'envs/client':>11} {'env-steps/s':>12} {'wall us/step':>12} {'CPU us/step':>11} "
        f"{'of it learner process':>21} "
        f"{'server us/step':>14} {'gather us/step':>14} {'inference batch':>15}{extra}"
    )
    measure = measure_cli if args.learner == "cli" else measure_null
    for clients in args.clients:
        for envs in args.envs:
            r = measure(maker, args, clients, envs)
            server = f"{r['server_us']:.1f}" if r.get("server_us") is not None else "-"
            line = (
                f"{clients:>7} {envs:>11} {r['sps']:>12,.0f} {1e6 / r['sps']:>12.1f} {r['cpu_us']:>11.1f} "
                f"{r['learner_cpu_us']:>21.1f} "
                f"{server:>14} {r['gather_us']:>14.1f} {r['inference_batch']:>15.1f}"
            )
            if args.learner == "cli":
                line += f" {r['update_us']:>15.1f} {r['queue'] or 0:>6.1f}"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    train_parser = modes.add_parser("train", help="train mono and poly and break a step's cost down")
    train_parser.add_argument("--backends", nargs="+", default=["mono", "poly"], choices=["mono", "poly"])
    train_parser.add_argument("--seconds", type=float, default=90.0)
    train_parser.add_argument("--warmup", type=float, default=30.0)
    train_parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    pipe = modes.add_parser("pipeline", help="poly's own ceiling with a zero-cost env and a trivial policy")
    pipe.add_argument("--clients", type=int, nargs="+", default=[2])
    pipe.add_argument("--envs", type=int, nargs="+", default=[64], help="envs per client (per message)")
    pipe.add_argument("--obs", choices=sorted(OBS), default="pong")
    pipe.add_argument(
        "--learner",
        choices=["none", "cli"],
        default="none",
        help="none: batches stacked and dropped; cli: the real learner with the overrides",
    )
    pipe.add_argument("--batch-size", type=int, default=8)
    pipe.add_argument("--unroll-length", type=int, default=80)
    pipe.add_argument("--max-batch-size", type=int, default=512, help="envs per central inference pass")
    pipe.add_argument("--batch-timeout-ms", type=float, default=2.0)
    pipe.add_argument("--learner-queue-size", type=int, default=64)
    pipe.add_argument("--seconds", type=float, default=15.0)
    pipe.add_argument("--warmup", type=float, default=5.0)
    pipe.add_argument("overrides", nargs="*", help="--learner cli: Hydra overrides for the learner")
    args = parser.parse_args()
    train_mode(args) if args.mode == "train" else pipeline_mode(args)


if __name__ == "__main__":
    main()
