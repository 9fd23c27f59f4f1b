"""What the tests share: configs composed in process, the CLI run in a subprocess, run dirs read
back (and written as training writes them), and a poly ActorPool served on loopback with a raw
client. Tests import from here; tests/conftest.py holds only fixtures and hooks.

A helper that starts the CLI is decorated @starts_cli: conftest.py marks slow every test that
reaches one (its docstring says how).
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from matplotlib.image import imread
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR
from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.batcher import DynamicBatcher
from torchbeast_hydra.backends.poly.server import ActorPool, ServerSettings, make_server
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.logs.metrics import CSV_FIELDS, read_rows

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"

# Small enough for any env to train a few updates in seconds: add the env and total_steps.
SMALL = [
    "batch_size=4",
    "unroll_length=16",
    "backend.num_actors=2",
    "backend.envs_per_actor=2",
    "logger.log_interval_s=1",
    "logger.wandb.mode=disabled",  # tests/test_wandb.py covers wandb
]
# A tiny but complete training run: CartPole with an MLP, two actors, a few updates.
TINY = ["experiment=cartpole", "total_steps=2560", *SMALL]


def starts_cli(function):
    """Marks a helper that starts the CLI: conftest.py marks slow every test that reaches it."""
    function.starts_cli = True
    return function


# -- configs and the CLI ---------------------------------------------------------------------------


def leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) for each value a YAML tree sets; an empty dict or a list is one value."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def compose_config(overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, False)
    return cfg


def cli_env(**extra: str | None) -> dict:
    """The CLI's environment in tests: never real wandb credentials; wandb off unless asked.

    extra: variables to set, or to remove (None).
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(HYDRA_FULL_ERROR="0", WANDB_MODE="disabled", NETRC=os.devnull)
    env.update(extra)
    return {key: value for key, value in env.items() if value is not None}


def cli_env_with_path(*dirs: Path, **extra: str | None) -> dict:
    """cli_env() with dirs first on PYTHONPATH, then this checkout: the user's modules (env.imports,
    model targets, stand-ins) importable in every process, next to the package under test."""
    path = [*map(str, dirs), str(REPO), os.environ.get("PYTHONPATH")]
    return cli_env(PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)


@starts_cli
def cli_argv(*args: str, prelude: str | None = None) -> list[str]:
    """The command line of `python -m torchbeast_hydra ARGS`.

    prelude: Python run first in the CLI's process (e.g. to hide a package), through -c.
    """
    if prelude is None:
        return [sys.executable, "-m", "torchbeast_hydra", *args]
    return [sys.executable, "-c", f"{prelude}\nfrom torchbeast_hydra.__main__ import cli\ncli()\n", *args]


def run_command(argv, *, timeout: float, check: bool = False, env: dict | None = None, cwd=REPO):
    """Runs argv to its end with its output captured; returns the CompletedProcess.

    env: the whole environment (default cli_env()). check: a non-zero exit fails, with the output.
    """
    result = subprocess.run(
        [str(arg) for arg in argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=cli_env() if env is None else env,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def resume_refusal(run_dir: Path, *overrides: str) -> str:
    """What a run started in run_dir (which holds a checkpoint) with these overrides does first, in
    process: it resumes (TrainingRun), which refuses. Returns the refusal's message, which the CLI
    says as `error: MESSAGE` before it exits 2 (test_mono's corrupt-checkpoint test shows it)."""
    from torchbeast_hydra.config import validate
    from torchbeast_hydra.env.spaces import probe_env
    from torchbeast_hydra.run.checkpoint import CheckpointError
    from torchbeast_hydra.run.training_run import TrainingRun

    cfg = validate(compose_config(overrides))
    with pytest.raises(CheckpointError) as refused:
        TrainingRun(cfg, run_dir, probe_env(cfg.env))
    return str(refused.value)


def run_dir_args(run_dir, multirun: bool) -> list[str]:
    """The CLI's arguments that put its run dir (with multirun: -m, its sweep dir) at run_dir."""
    return ["-m", f"hydra.sweep.dir={run_dir}"] if multirun else [f"hydra.run.dir={run_dir}"]


@starts_cli
def run_cli(
    run_dir: Path,
    *overrides: str,
    timeout: float = 180,
    check: bool = True,
    env: dict | None = None,
    multirun: bool = False,
    prelude: str | None = None,
):
    """Runs `python -m torchbeast_hydra` with its run dir at run_dir; returns the CompletedProcess.

    multirun: `-m`, with run_dir as the sweep dir. env: the whole environment (default cli_env()).
    """
    argv = cli_argv(*run_dir_args(run_dir, multirun), *overrides, prelude=prelude)
    return run_command(argv, timeout=timeout, check=check, env=env)


@starts_cli
def run_sweep(sweep_dir: Path, *overrides: str, timeout: float, env: dict | None = None, prelude: str | None = None):
    """`python -m torchbeast_hydra -m ...` into sweep_dir, bounded in time; returns the CompletedProcess,
    whatever its exit status."""
    return run_cli(sweep_dir, *overrides, timeout=timeout, check=False, env=env, multirun=True, prelude=prelude)


@starts_cli
def start_cli(run_dir: Path, *overrides: str, env: dict | None = None, multirun: bool = False):
    """Starts `python -m torchbeast_hydra` in the background (output, stderr included, in .stdout).

    env: the whole environment (default cli_env()).
    """
    return subprocess.Popen(
        cli_argv(*run_dir_args(run_dir, multirun), *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=cli_env() if env is None else env,
    )


@starts_cli
def run_clis_together(*runs, timeout: float = 300, env: dict | None = None) -> list[str]:
    """Several independent `python -m torchbeast_hydra` runs started at once, each (run_dir, *overrides),
    so that one's start-up overlaps another's training; waits for all. Returns each run's output
    (stderr included), in order; a run that exits non-zero, or outlasts timeout, fails with its output."""
    processes = [start_cli(run_dir, *overrides, env=env) for run_dir, *overrides in runs]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise AssertionError(f"{process.args} exited {process.returncode}:\n{output}")
            outputs.append(output)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return outputs


@starts_cli
def start_env_process(run_dir: Path, learner_dir: Path, *overrides: str, env: dict):
    """Starts a poly env process (one client) that finds its learner through learner_dir's address file,
    as array jobs on a shared filesystem do. env: with the learner's TORCHBEAST_TOKEN."""
    address = f"file:{learner_dir / 'actorpool_address'}"
    return start_cli(
        run_dir, *overrides, "backend.role=env", f"backend.address={address}", "backend.num_actors=1", env=env
    )


def sweep_job_dir(sweep: Path, *overrides: str) -> Path:
    """The one job dir of a sweep whose overrides include these (job dirs are named by overrides)."""
    (match,) = [d for d in sweep.iterdir() if d.is_dir() and set(overrides) <= set(d.name.split(","))]
    return match


def import_benchmark(monkeypatch, name: str):
    """benchmarks/NAME.py as a module, imported as the scripts import each other (benchmarks/ on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


# -- processes ---------------------------------------------------------------------------------------


def children(pid):
    """Live child processes of pid (actors, and multiprocessing's helpers)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        pytest.skip("pgrep is not available")
    return [int(p) for p in out.split()]


def running(pid) -> bool:
    """Whether the process exists and is not a zombie (an exited child nobody has reaped yet)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def descendants(pid):
    """Live processes below pid: its children, theirs, and so on."""
    found = children(pid)
    return found + [p for child in found for p in descendants(child)]


def actor_pids(pid):
    """The helper processes a run started (actors, env clients, the evaluator): its fork server's
    children (run/supervision.py), or where there is none, its spawned children."""
    helpers = []
    for child in children(pid):
        cmdline = _cmdline(child)
        if "forkserver" in cmdline:
            helpers += children(child)
        elif "spawn_main" in cmdline:
            helpers.append(child)
    return helpers


def _cmdline(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # gone meanwhile
        return ""


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# -- run dirs: read back, and written as training writes them --------------------------------------


def rows(run_dir):
    """logs.csv's rows, read as everything else reads them (numbers parsed, blanks None)."""
    return read_rows(run_dir)


def steps(run_dir):
    return [int(row["step"]) for row in rows(run_dir)]


def csv_dicts(path) -> list[dict]:
    """A csv file's rows as written: strings, blanks "" (what a reader of the file sees)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_run(run_dir, overrides, seed, updates, config=None, choices=None, steps_per_s=None):
    """A run dir as training leaves it: logs.csv and .hydra/{overrides,config,hydra}.yaml.

    updates: (step, episode returns, loss) per logs.csv row. choices: the config groups' options
    (hydra.yaml). steps_per_s: fills time_s, the training seconds so far, as at a constant rate.
    """
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(dict(seed=seed, **(config or {}))))
    if choices is not None:
        hydra = dict(hydra=dict(runtime=dict(choices={"hydra/launcher": "basic", **choices})))
        (run_dir / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(hydra))
    with open(run_dir / "logs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for step, returns, loss in updates:
            writer.writerow(
                dict(
                    step=step,
                    time_s=step / steps_per_s if steps_per_s else "",
                    sps=100.0 + step / 10,
                    episode_returns=json.dumps(returns),
                    mean_episode_return=sum(returns) / len(returns) if returns else "",
                    total_loss=loss,
                    pg_loss=loss / 2,
                    baseline_loss=loss / 4,
                    entropy_loss=-0.1,
                )
            )


def assert_real_image(path):
    image = imread(path)
    assert image.shape[0] >= 300 and image.shape[1] >= 400, f"{path}: {image.shape}"
    assert image[..., :3].std() > 0.05, f"{path} is blank"


# -- the poly ActorPool on loopback, and a client that sends raw messages ---------------------------

POOL_TOKEN = "server-token"


@contextlib.contextmanager
def serve_pool(spec, settings, policy, emit=None, on_error=None, **pool_options):
    """An ActorPool for spec serving on a free loopback port, policy its inference; yields (pool, port).

    emit: takes each finished rollout (and its initial core state). on_error: what inference raised.
    pool_options: the ActorPool's other keywords (newer_weights, ...).
    """
    inference = DynamicBatcher(policy, max_batch_size=64, timeout_s=0.001, on_error=on_error)
    pool = ActorPool(
        spec,
        settings,
        token=POOL_TOKEN,
        inference=inference,
        initial_state=lambda n: (),
        emit=emit or (lambda rollout, state: None),
        **pool_options,
    )
    server, port = make_server(pool, "127.0.0.1:0", 1 << 20)
    server.start()
    try:
        yield pool, port
    finally:
        pool.stop(finished=True)
        inference.close()
        server.stop(grace=None).wait()


POOL_SPEC = EnvSpec.box((3,), np.dtype(np.float32), 2)  # the in-process pool tests' env: 3 floats, 2 actions


def pool_hello(num_envs=2, spec=POOL_SPEC) -> bytes:
    """A client's hello for the in-process pool tests' env."""
    return wire.encode_hello(spec, "Test-v0", num_envs)


def pool_step(num_envs=2, frame=0.0, done=False, spec=POOL_SPEC) -> bytes:
    """A client's step for that env: every frame value `frame`, every env `done` or not."""
    outputs = layout.env_outputs(spec, num_envs)
    outputs["frame"][:] = frame
    outputs["done"][:] = done
    return wire.encode_step(outputs)


def zero_policy(inputs: dict) -> dict:
    """Central inference for POOL_SPEC: action 0, zero logits and values, for every env, by weights of version 0."""
    n = inputs["done"].shape[0]
    return dict(
        action=torch.zeros(n, dtype=torch.int64),
        policy_logits=torch.zeros(n, POOL_SPEC.actions.num_params),
        baseline=torch.zeros(n),
        policy_version=torch.zeros(n, dtype=torch.int64),
    )


def serve_small_pool(spec=POOL_SPEC, infer=zero_policy, on_error=None, idle_timeout_s=0.5, lent=None):
    """Yields (pool, port, emitted rollouts) for a pool of unrolls of 5 steps, chunks of 2 envs,
    at most 2 clients of 4 envs, and an idle limit of idle_timeout_s. lent: a list; the emitter then
    takes buffers, as the learner's queue does, and appends each lent chunk's release there."""
    emitted = []
    settings = ServerSettings(
        env_id="Test-v0",
        unroll_length=5,
        chunk_size=2,
        cut_at_reset=True,
        seed=1,
        max_envs_per_client=4,
        max_clients=2,
        client_idle_timeout_s=idle_timeout_s,
    )

    def emit(rollout, state, release=None):
        emitted.append(rollout)
        if release is not None:
            lent.append(release)

    emit.takes_buffers = lent is not None
    with serve_pool(spec, settings, infer, emit=emit, on_error=on_error) as served:
        yield (*served, emitted)


class RawClient:
    """A Connect stream whose messages the test sends one at a time (or never)."""

    def __init__(self, port, token=POOL_TOKEN, options=()):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=list(options))
        self.outgoing = queue.SimpleQueue()
        connect = self.channel.stream_stream(
            wire.CONNECT, request_serializer=None, response_deserializer=wire.ServerMessage.FromString
        )
        self.responses = connect(iter(self.outgoing.get, None), metadata=((wire.TOKEN_METADATA_KEY, token),))

    def send(self, raw: bytes) -> str:
        """Sends a message; returns the kind of the answer."""
        self.outgoing.put(raw)
        return next(self.responses).WhichOneof("kind")

    def error(self, timeout=10.0) -> grpc.RpcError:
        """Waits for the stream to end with an error and returns it."""
        result = {}

        def wait():
            try:
                for _ in self.responses:
                    pass
            except grpc.RpcError as error:
                result["error"] = error

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        thread.join(timeout)
        assert "error" in result, "the stream did not end"
        return result["error"]

    def close(self):
        self.outgoing.put(None)
        self.responses.cancel()
        self.channel.close()
