"""Throughput: how fast training runs on this machine, and where a step's time goes.

    python benchmarks/throughput.py train                 # Pong, atari_net, B=8, T=80, mono
    python benchmarks/throughput.py train backend=poly    # the same on the poly backend
    python benchmarks/throughput.py train --backends mono poly --warmup 30   # both, actors sized to the machine
    python benchmarks/throughput.py train --seconds 120 backend.envs_per_actor=4
    python benchmarks/throughput.py train --backends mono poly --steps 150000   # whole runs' wall clock
    python benchmarks/throughput.py scaling               # poly with 1, 2, 4, 8 env clients
    python benchmarks/throughput.py scaling --clients 1 2 4 8 16 --seconds 60 backend.envs_per_actor=8
    python benchmarks/throughput.py pipeline              # poly's own ceiling: zero-cost env, trivial policy
    python benchmarks/throughput.py pipeline --clients 2 --envs 64 128 256
    python benchmarks/throughput.py pipeline --learner cli --obs cartpole experiment=cartpole
    python benchmarks/throughput.py pipeline --learner cli --clients 2 4 --envs 64 model=trivial_frames
    python benchmarks/throughput.py pipeline --obs float64 --clients 1   # the server's float range check
    python benchmarks/throughput.py pipeline --shards 1 2 --rounds 3 --envs 16   # the server in 1 and 2 processes
    python benchmarks/throughput.py pipeline --frames whole newest --envs 16     # stacks whole, or a frame a step
    python benchmarks/throughput.py pipeline --transport grpc shared_memory --envs 16   # role=all's local path too
    python benchmarks/throughput.py pipeline --transport shared_memory --episode-steps 1000   # envs out of step
    python benchmarks/throughput.py envs                  # the raw env rate of each engine (env.engine)
    python benchmarks/throughput.py envs --engines native envpool --ids ALE/Pong-v5 --rounds 5
    python benchmarks/throughput.py envs --processes 16 --seconds 3   # a 16-core machine, a process a core

train (the default mode): trains for --warmup + --seconds of training, by the run's own clock (its
start-up not counted; the default warm-up covers the learner's thread trial, run/thread_trial.py;
once with the config's backend, or once per backend in --backends) and prints the steady-state
steps/s after the warm-up, as a fraction of the raw single-env rate (one env on one core, the mean
of its rate just before the run and just after), per core, and efficiency = steps/s / (cores x that
rate); GPU utilisation (when there is a GPU) and peak memory (PSS of the whole process tree, so
shared buffers count once). Then where a step's time went, in core-microseconds per env step: by
process (the CPU time of each of the run's processes over the steady window, from /proc), by stage
as the run timed itself (logs.csv: env, inference, server work, batch gathering, learner update),
and each stage alone on one core after the run (_stages.py). With --steps N, a whole run of N steps
instead, to its end: its wall-clock rate (start-up and shut-down included) beside the steady one.

scaling: trains once per actor count in --clients (poly env clients by default; --backend mono
for mono's actors) and prints a row each: steps/s, the mean central inference batch and its
time, and the mean learner queue (poly's columns; "-" where the backend logs none).

pipeline: isolates our overhead from env and model cost. Env client processes step a zero-cost
env (the same Pong-shaped frames, 4x84x84 uint8, every step) through the real client code; the
ActorPool server answers with a trivial policy in its dynamic batches and assembles the unrolls;
a learner takes batches as they come (stacks them, as the real learner does) without the math.
The clients connect over gRPC, or with --transport shared_memory as role=all's local clients do;
their envs never end an episode unless --episode-steps says when (then each env's unrolls end at
steps of their own, as real envs' do after their first episode). Prints the ceiling in
env-steps/s, wall microseconds per env-step and CPU microseconds per env-step (all processes;
the figure that stays comparable when other work shares the machine), and the one-GIL ceiling:
1e6 / the CPU per env-step of the busiest server process (the learner's, or with --shards a
shard's), the rate at which that process would fill its one core.
--learner cli runs the real learner instead (`backend.role=learner` with the given overrides;
model=trivial_frames, from benchmarks/conf, is a policy that costs the learner next to nothing).

envs: the raw env rate of each engine (env.engine: gymnasium, native, envpool) for each id in --ids
(Pong, HalfCheetah and Hopper by default): --processes processes at once, each stepping --num-envs
envs with random actions on --threads threads, no policy (_engines.py). The engines alternate
within each of --rounds rounds; the median round is printed: env-steps per CPU-second (what a core
gives, comparable when other work shares the machine), CPU microseconds an env-step, and the wall
rate of all the processes together. An engine that cannot run an id says why.

Hydra overrides (key=value) may stand anywhere on the line, after a list option too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GpuSampler, composed, mean_of, platform_line, steady_rate, steps_per_update, train  # noqa: E402
from _engines import measure as measure_engine  # noqa: E402
from _engines import refusal as engine_refusal  # noqa: E402
from _pipeline import OBS  # noqa: E402
from _stages import NATIVE_ENV, lockstep_env_us, stage_costs  # noqa: E402

from torchbeast_hydra.logs.metrics import read_rows  # noqa: E402

# Pong (whose env option keeps the default model, atari_net) at B=8, T=80; an override of the same
# key replaces its entry here (env=nethack: NetHack with the model its env option brings).
DEFAULTS = [
    "env=pong",
    "batch_size=8",
    "unroll_length=80",
    "total_steps=1000000000",
    "checkpoint_interval_s=100000",
]


def with_defaults(overrides: list) -> list:
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [d for d in DEFAULTS if d.split("=", 1)[0] not in given] + list(overrides)


# -- one training run -------------------------------------------------------------------------------


@dataclass
class Run:
    rc: int
    wall: float  # seconds, the whole run
    peak: int  # bytes, PSS of the process tree
    gpu: str  # utilisation while it ran
    last_step: int
    rows: list  # logs.csv rows after the warm-up
    sps: float | None  # steady-state steps/s; None with fewer than two updates after the warm-up
    cpu: dict  # process role -> CPU seconds over the steady window (_common.cpu_by_role)
    window_s: float  # that window's length
    learner: str = "-"  # the start-up summary's learner line, and the thread trial's decision if it made one


def measure(overrides: list, warmup: float, seconds: float, steps: int | None = None) -> Run:
    """Trains DEFAULTS + overrides for warmup + seconds, or with steps a whole run of that many
    steps to its end; the rate is measured after the warm-up."""
    gpu = GpuSampler()
    gpu.start()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        if steps is None:
            trained = train(run_dir, with_defaults(overrides), seconds=warmup + seconds, warmup=warmup)
        else:
            trained = train(run_dir, with_defaults([*overrides, f"total_steps={steps}"]))
        rows = read_rows(run_dir) if (run_dir / "logs.csv").exists() else []  # none: it failed to start
        learner = learner_lines(run_dir / "torchbeast.log")
    steady, sps = steady_rate(rows, warmup)
    last = rows[-1]["step"] if rows else 0
    return Run(
        trained.rc, trained.wall, trained.peak, gpu.stop(), last, steady, sps, trained.cpu, trained.window_s, learner
    )


def learner_lines(log: Path) -> str:
    """'1 torch thread (2 if ...), bf16 autocast; Learner threads: ... it keeps 1 thread.' from a run's log."""
    if not log.exists():
        return "-"
    lines = log.read_text().splitlines()
    summary = [line.split("learner", 1)[1].strip() for line in lines if line.startswith("  learner ")]
    decision = [line.split(" - ", 1)[1] for line in lines if "Learner threads:" in line]
    return "; ".join(summary[:1] + decision[:1]) or "-"


def env_steps_per_second(env_cfg, seconds: float = 5.0) -> float:
    """One env on one core, random actions: what a core can give at most (its CPU time a step)."""
    return 1e6 / lockstep_env_us(env_cfg, seconds)[0]


# -- train mode -------------------------------------------------------------------------------------


def breakdown(rows: list, env_us_alone: float) -> dict:
    """Core-microseconds per env step by part, from what the backends log in logs.csv; the env's
    cost alone on one core (env_us_alone) where the run does not time it (poly's clients)."""
    env_us = mean_of(rows, "actor_env_us_per_step")  # mono's actors time their own envs and policy
    parts = {"env (in the actors)": env_us} if env_us is not None else {"env (alone, one core)": env_us_alone}
    actor_inference_us = mean_of(rows, "actor_inference_us_per_step")
    if actor_inference_us is not None:
        parts["inference (in the actors)"] = actor_inference_us
    inference_ms, batch = mean_of(rows, "inference_ms"), mean_of(rows, "inference_batch_size")
    if inference_ms is not None and batch:  # poly: per pass, over the batch's envs
        parts[f"central inference (mean batch {batch:.1f})"] = 1000 * inference_ms / batch
    server_us = mean_of(rows, "server_us_per_step")  # poly, per env step
    if server_us is not None:
        parts["wire + assembly (server threads, CPU)"] = server_us
    per_update = steps_per_update(rows)
    for name, key in (("batch gathering (learner)", "gather_ms"), ("learner update", "update_ms")):
        value = mean_of(rows, key)
        if value is not None:
            parts[name] = 1000 * value / per_update
    return parts


def train_mode(args) -> None:
    cores = os.cpu_count() or 1
    print(f"machine: {platform_line()}")
    print(f"config:  {' '.join(with_defaults(args.overrides))}")
    for backend in args.backends or [None]:
        overrides = [f"backend={backend}", *args.overrides] if backend else args.overrides
        cfg = composed(with_defaults(overrides))
        # The raw rate just before the run and just after, and their mean: a shared machine's speed
        # drifts by tens of percent within minutes, and a run's fraction should not hang on one side.
        before = env_steps_per_second(cfg.env)
        run = measure(overrides, args.warmup, args.seconds, args.steps)
        after = env_steps_per_second(cfg.env)
        raw = (before + after) / 2
        name = backend or "training"
        if run.sps is None:
            sys.exit(
                f"{name}: too few learner updates after the warm-up ({run.last_step:,} steps in all, exit {run.rc}); "
                "raise --seconds"
            )
        elapsed = run.rows[-1]["time_s"] - run.rows[0]["time_s"]
        print(
            f"\n{name}: {run.sps:,.0f} steps/s over {elapsed:.0f} s after {args.warmup:g} s warm-up "
            f"({run.last_step:,} steps in {run.wall:.0f} s wall, exit {run.rc})\n"
            f"  {run.sps / raw:.2f} of the raw env rate ({raw:,.0f} steps/s, the mean of {before:,.0f} before the run "
            f"and {after:,.0f} after: {cfg.env.id}, one env, one core, random actions); "
            f"per core {run.sps / cores:,.0f} steps/s, efficiency {run.sps / (cores * raw):.2f}\n"
            f"  GPU {run.gpu}; peak memory {run.peak / 2**20:,.0f} MiB (PSS, whole process tree)\n"
            f"  learner: {run.learner}",
            flush=True,
        )
        if args.steps is not None:  # the whole run, start-up and shut-down included, against the steady rate
            whole = run.last_step / run.wall
            print(
                f"  whole run: {run.last_step:,} steps in {run.wall:.1f} s wall = {whole:,.0f} steps/s, "
                f"{whole / run.sps:.2f} of the steady rate"
            )
        budget = cores * 1e6 / run.sps
        print(f"  per step: {budget:,.1f} core-us available at this rate on {cores} cores")
        if run.cpu:
            _print_parts(
                "  where the CPU went, by process (from /proc, over the steady window):", by_process(run, cores)
            )
        envs = cfg.backend.envs_per_actor  # what one actor evaluates its policy on at once (composed: resolved)
        batch = mean_of(run.rows, "inference_batch_size") or envs
        stages = stage_costs(cfg, max(1, round(batch)), envs_per_message=envs)
        parts = breakdown(run.rows, stages.get(NATIVE_ENV, 1e6 / raw))
        parts["the rest (messages, copies, idle, ...)"] = budget - sum(parts.values())
        _print_parts("  by stage, as the run timed itself (logs.csv):", parts)
        _print_parts("  each stage alone on one core, after the run (no contention):", stages)


def by_process(run: Run, cores: int) -> dict:
    """Core-microseconds per env step each kind of process spent in the steady window, and idle."""
    steps = run.sps * run.window_s
    if not run.cpu or steps <= 0:
        return {}
    parts = {role: 1e6 * seconds / steps for role, seconds in sorted(run.cpu.items())}
    parts["idle (no process of the run on a core)"] = max(0.0, 1e6 * cores * run.window_s / steps - sum(parts.values()))
    return parts


def _print_parts(title: str, parts: dict) -> None:
    print(title)
    for part, us in parts.items():
        print(f"    {part + ':':60s} {us:8.1f} us", flush=True)


# -- scaling mode -----------------------------------------------------------------------------------


def scaling_mode(args) -> None:
    unit = "clients" if args.backend == "poly" else "actors"
    print(f"machine: {platform_line()}")
    print(f"config:  backend={args.backend} {' '.join(with_defaults(args.overrides))}")
    print(f"{unit:>7} {'steps/s':>8} {'inference batch':>16} {'inference ms':>13} {'learner queue':>14}")
    for actors in args.clients:
        run = measure(
            [f"backend={args.backend}", f"backend.num_actors={actors}", *args.overrides], args.warmup, args.seconds
        )
        if run.sps is None:
            print(f"{actors:>7} too few updates after the warm-up (exit {run.rc}); raise --seconds", flush=True)
            continue
        columns = ((16, "inference_batch_size", ".1f"), (13, "inference_ms", ".2f"), (14, "learner_queue_size", ".1f"))
        cells = [_cell(mean_of(run.rows, key), width, spec) for width, key, spec in columns]
        print(f"{actors:>7} {run.sps:>8,.0f} {' '.join(cells)}", flush=True)


def _cell(value: float | None, width: int, spec: str) -> str:
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


# -- pipeline mode ----------------------------------------------------------------------------------


def pipeline_mode(args) -> None:
    from _pipeline import FixedFrames, measure_cli, measure_null

    maker = FixedFrames(*OBS[args.obs], episode_steps=args.episode_steps)
    print(f"machine: {platform_line()}; load average {os.getloadavg()[0]:.1f} at the start")
    shape = (
        f"B={args.batch_size}, T={args.unroll_length}, max_batch_size={args.max_batch_size}"
        if args.learner == "none"
        else f"the learner's config: {' '.join(args.overrides) or 'defaults'}"
    )
    print(
        f"pipeline: {args.obs} frames {list(maker.spec.obs_shape)} {maker.spec.leaves[0].dtype}, "
        f"learner={args.learner}, {shape}, "
        f"episodes {f'of ~{args.episode_steps} steps' if args.episode_steps else 'never end'}, "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s"
    )
    extra = "  update us/step  queue" if args.learner == "cli" else ""
    print(
        f"{'shards':>6} {'path':>6} {'clients':>7} {'envs/client':>11} {'env-steps/s':>12} {'wall us/step':>12} "
        f"{'CPU us/step':>11} {'of it learner process':>21} {'shards':>6} "
        f"{'server us/step':>14} {'server all us/step':>18} {'gather us/step':>14} {'inference batch':>15} "
        f"{'inference host us/step':>22} {'one-GIL ceiling':>15}{extra}"
    )
    # Rounds alternate the shard counts, transports and frame encodings: other load on the machine hits
    # each alike. Shared memory carries whole stacks: one round of it whatever --frames says.
    settings = [
        (transport, frames)
        for transport in args.transport
        for frames in (args.frames if transport == "grpc" else ["-"])
    ]
    for _, shards, (transport, frames), clients, envs in itertools.product(
        range(args.rounds), args.shards, settings, args.clients, args.envs
    ):
        newest = frames == "newest"
        if args.learner == "cli":
            args.overrides = [o for o in args.overrides if not o.startswith("backend.server_shards=")]
            args.overrides.append(f"backend.server_shards={shards}")
            r = measure_cli(maker, args, clients, envs, newest)
        else:
            r = measure_null(maker, args, clients, envs, shards, newest, transport)
        path = frames if transport == "grpc" else "shm"
        print(_pipeline_line(args, shards, path, clients, envs, r), flush=True)


def _pipeline_line(args, shards: int, path: str, clients: int, envs: int, r: dict) -> str:
    line = (
        # no step in the window (a loaded machine, a short --seconds): no time a step either
        f"{shards:>6} {path:>6} {clients:>7} {envs:>11} {r['sps']:>12,.0f} "
        f"{_cell(1e6 / r['sps'] if r['sps'] else None, 12, '.1f')} {r['cpu_us']:>11.1f} "
        f"{r['learner_cpu_us']:>21.1f} {_cell(r.get('shards_cpu_us'), 6, '.1f')} "
        f"{_cell(r['server_us'], 14, '.1f')} {_cell(r.get('server_all_us'), 18, '.1f')} "
        f"{r['gather_us']:>14.1f} {r['inference_batch']:>15.1f} "
        f"{_cell(r.get('inference_host_us'), 22, '.1f')} {_cell(r.get('ceiling'), 15, ',.0f')}"
    )
    if args.learner == "cli":
        line += f" {r['update_us']:>15.1f} {r['queue'] or 0:>6.1f}"
    return line


ENGINES = ("gymnasium", "native", "envpool")
ENV_IDS = ("ALE/Pong-v5", "HalfCheetah-v5", "Hopper-v5")


def envs_mode(args) -> None:
    shape = f"{args.processes} process(es) x {args.num_envs} envs x {args.threads} thread(s)"
    print(f"# raw env rate: {platform_line()}; {shape}")
    runs = {}
    for env_id in args.ids:
        for engine in args.engines:
            reason = engine_refusal(env_id, engine)
            if reason is not None:
                print(f"{env_id:<16} {engine:<10} -  ({reason})")
            else:
                runs[env_id, engine] = []
    for round_ in range(args.rounds):  # engines alternate, so that a slow spell of the machine hits each
        for key in runs:
            runs[key].append(measure_engine(*key, args.num_envs, args.threads, args.processes, args.seconds))
            print(f"  round {round_ + 1}: {key[0]} {key[1]} {runs[key][-1].per_core:,.0f} a core", file=sys.stderr)
    print(f"{'id':<16} {'engine':<10} {'steps/s a core':>14} {'CPU us/step':>12} {'wall steps/s':>13}  rounds (a core)")
    for (env_id, engine), rates in runs.items():
        median = sorted(rates, key=lambda r: r.per_core)[len(rates) // 2]
        each = ", ".join(f"{r.per_core:,.0f}" for r in rates)
        print(
            f"{env_id:<16} {engine:<10} {median.per_core:>14,.0f} {1e6 / median.per_core:>12.1f} "
            f"{median.per_second:>13,.0f}  {each}"
        )


# -- the command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = top.add_subparsers(dest="mode", required=True)

    training = modes.add_parser("train", help="steady-state steps/s of a config and where a step's time goes")
    training.add_argument(
        "--backends", nargs="+", choices=["mono", "poly"], help="one run per backend (default: the config's backend)"
    )
    training.add_argument("--seconds", type=float, default=90.0, help="training time to measure")
    training.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds excluded at the start (the learner's thread trial ends in them)",
    )
    training.add_argument(
        "--steps", type=int, help="a whole run of this many steps instead, to its end: its wall-clock rate too"
    )
    training.add_argument("overrides", nargs="*", help="Hydra overrides for every run")

    scaling = modes.add_parser("scaling", help="steps/s over numbers of env clients (poly) or actors (mono)")
    scaling.add_argument("--clients", "--actors", type=int, nargs="+", default=[1, 2, 4, 8], help="backend.num_actors")
    scaling.add_argument("--backend", choices=["mono", "poly"], default="poly")
    scaling.add_argument("--seconds", type=float, default=40.0)
    scaling.add_argument("--warmup", type=float, default=60.0)
    scaling.add_argument("overrides", nargs="*", help="Hydra overrides for every run")

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
    pipe.add_argument(
        "--episode-steps",
        type=int,
        default=0,
        help="envs end episodes after ~this many steps each (0: never), falling out of step as real envs do",
    )
    pipe.add_argument("--batch-size", type=int, default=8)
    pipe.add_argument("--unroll-length", type=int, default=80)
    pipe.add_argument("--max-batch-size", type=int, default=512, help="envs per central inference pass")
    pipe.add_argument("--batch-timeout-ms", type=float, default=2.0)
    pipe.add_argument("--learner-queue-size", type=int, default=64)
    pipe.add_argument(
        "--shards", type=int, nargs="+", default=[1], help="server shard processes (1: all in the learner's process)"
    )
    pipe.add_argument(
        "--frames",
        nargs="+",
        choices=["newest", "whole"],
        default=["newest"],
        help="stacks of frames over gRPC: a frame a step where they shift (backend.newest_frames), or whole",
    )
    pipe.add_argument(
        "--transport",
        nargs="+",
        choices=["grpc", "shared_memory"],
        default=["grpc"],
        help="how clients reach the server: gRPC, or shared memory as role=all's local clients (--learner none, "
        "--shards 1; --frames does not apply)",
    )
    pipe.add_argument("--rounds", type=int, default=1, help="times to measure each setting, alternating")
    pipe.add_argument("--seconds", type=float, default=15.0)
    pipe.add_argument("--warmup", type=float, default=5.0)
    pipe.add_argument("overrides", nargs="*", help="--learner cli: Hydra overrides for the learner")

    engines = modes.add_parser("envs", help="the raw env rate of each engine (env.engine), no policy")
    engines.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    engines.add_argument("--ids", nargs="+", default=list(ENV_IDS), help="ids (Atari's: env=pong's preprocessing)")
    engines.add_argument("--num-envs", type=int, default=16, help="envs a process steps together")
    engines.add_argument("--threads", type=int, default=1, help="each process's engine threads (C++ engines)")
    engines.add_argument("--processes", type=int, default=1, help="processes measured at once")
    engines.add_argument("--seconds", type=float, default=5.0)
    engines.add_argument("--rounds", type=int, default=3)
    engines.set_defaults(overrides=[])  # none: the ids and engines are the options
    return top


def parse_args(argv: list) -> argparse.Namespace:
    if not argv or argv[0] not in ("train", "scaling", "pipeline", "envs", "-h", "--help"):
        argv = ["train", *argv]  # train is the default mode: `throughput.py backend=poly` as before modes
    # Hydra overrides (key=value) may stand anywhere: argparse alone would read `experiment=cartpole`
    # after `--envs 4 64` as a third env count and refuse it.
    overrides = [arg for arg in argv if "=" in arg and not arg.startswith("-")]
    top = parser()
    args = top.parse_args([arg for arg in argv if arg not in overrides])
    args.overrides += overrides
    if "shared_memory" in getattr(args, "transport", []) and (args.learner != "none" or args.shards != [1]):
        top.error("--transport shared_memory measures the null learner's own local clients: --learner none --shards 1")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    dict(train=train_mode, scaling=scaling_mode, pipeline=pipeline_mode, envs=envs_mode)[args.mode](args)


if __name__ == "__main__":
    main()
