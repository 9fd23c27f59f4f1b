"""What every backend shares: the run's state, the training loop, actor supervision and seeding.

`TrainingRun` owns the learner and the run dir's state (resume, checkpoints, stats), so mono and
poly resume, log and checkpoint identically. `Backend` is the training loop both run: a backend
(mono.py, poly/backend.py) supplies only how rollouts are produced. `ActorProcesses` starts and
replaces acting processes; `actor_seed` gives each its env seeds.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import checkpoint
from .config import ConfigError, to_plain_dict, usable_cores
from .envs import EnvSpec
from .learner import Learner
from .memory import describe_exit
from .metrics import CsvLog, Stats
from .models import make_model
from .wandb_log import WandbLog, hydra_labels

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here: use device=auto or cpu.")
    return device


def to_device(batch: dict, core_state: tuple, device: torch.device) -> tuple[dict, tuple]:
    """A CPU batch to the learner's device; through pinned memory to a GPU, so the copy overlaps."""
    if device.type != "cuda":
        return batch, core_state
    batch = {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
    return batch, tuple(s.to(device, non_blocking=True) for s in core_state)


def seed_everything(seed: int) -> None:
    """The learner process's seed: model initialisation, sampling in central inference, numpy."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def actor_seed(run_seed: int, actor: int, envs_per_actor: int) -> int:
    """The first env seed of the `actor`-th actor a run starts (restarts and reconnects count on),
    so that every env of every actor, replacement or client gets its own seed."""
    return run_seed * 1_000_003 + actor * envs_per_actor


def env_signature(env_id: str, spec: EnvSpec) -> dict:
    """What a checkpoint's env must match to resume: its id and spaces."""
    return dict(
        id=env_id, obs_shape=list(spec.obs_shape), obs_dtype=str(spec.obs_dtype), num_actions=int(spec.num_actions)
    )


class RunDirError(RuntimeError):
    """The run dir cannot be written (disk full, permissions); the message says what to do."""


@contextlib.contextmanager
def writing(what: Path):
    """Turns an OSError while writing `what` into a RunDirError that says how to recover."""
    try:
        yield
    except OSError as error:
        raise RunDirError(
            f"cannot write {what}: {error.strerror or error}. Free disk space or fix the permissions, "
            "then start again in this run dir: it resumes from the last complete checkpoint."
        ) from None


class TrainingRun:
    """The learner plus the run dir's state: resumes on start, checkpoints on a timer and at exit."""

    def __init__(self, cfg, run_dir: str | Path, spec: EnvSpec):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.spec = spec
        self.device = resolve_device(cfg.device)
        seed_everything(cfg.seed)  # before the model is built: its initial weights follow the seed
        self.learner = Learner(cfg, make_model(cfg.model, spec), self.device)
        self.lock = threading.Lock()  # guards the learner and stats between updates and saves
        self.stop_requested = threading.Event()
        self.stopped_by: StopOnSignals | None = None  # set by the backend; see launch.hand_over

        self.checkpoint_path = checkpoint.path_in(self.run_dir)
        start_step, episodes, elapsed_s = 0, 0, 0.0
        if self.checkpoint_path.exists():
            # On the CPU: the RNG states must stay there; load_state_dict moves the rest to the device.
            state = checkpoint.load(self.checkpoint_path, map_location="cpu")
            self._check_compatible(state)
            self.learner.load_state_dict(state["learner"])
            checkpoint.set_rng_state(state["rng"])
            start_step, episodes = state["step"], state["stats"]["episodes"]
            elapsed_s = state["stats"].get("time_s", 0.0)  # absent in older checkpoints
            log.info("Resuming from %s at step %d.", self.checkpoint_path, start_step)
        self.resumed = start_step > 0
        sinks = []
        self.csv_path = self.run_dir / "logs.csv"
        if cfg.logger.csv:
            with writing(self.csv_path):
                sinks.append(CsvLog(self.csv_path, resume_step=start_step))
        if cfg.logger.tensorboard:
            from .tensorboard_log import TensorboardLog

            sinks.append(TensorboardLog(self.run_dir, resume_step=start_step))
        group, name, tags = hydra_labels()
        wandb_log = WandbLog(
            cfg.logger.wandb,
            self.run_dir,
            group=group,
            name=name,
            tags=tags,
            config=to_plain_dict(cfg),
            resume_step=start_step,
        )
        if wandb_log.active:
            sinks.append(wandb_log)
        self.stats = Stats(start_step, cfg.total_steps, sinks, start_time_s=elapsed_s)
        self.stats.episodes = episodes
        self._last_save = time.monotonic()

    def _check_compatible(self, state: dict) -> None:
        """A checkpoint fits when what shapes the env and the model is unchanged: the env's id and
        spaces, the body class and every parameter's shape. Config fields added since (absent
        from the saved config) or changed without changing shapes do not stop a resume."""
        saved = state.get("config", {})
        current = to_plain_dict(self.cfg)
        saved_env = state.get("env", dict(id=saved.get("env", {}).get("id")))  # older checkpoints: the id
        current_env = env_signature(self.cfg.env.id, self.spec)
        if any(saved_env[key] != current_env.get(key) for key in saved_env):
            raise self._mismatch("env", saved_env, current_env, "the env's id or spaces differ")
        saved_target = saved.get("model", {}).get("_target_")
        if saved_target is not None and saved_target != current["model"]["_target_"]:
            raise self._mismatch("model", saved["model"], current["model"], "the model's body class differs")
        saved_shapes = {key: tuple(value.shape) for key, value in state["learner"]["model"].items()}
        current_shapes = {key: tuple(value.shape) for key, value in self.learner.model.state_dict().items()}
        if saved_shapes != current_shapes:
            differ = sorted(set(saved_shapes) ^ set(current_shapes)) or [
                key for key in saved_shapes if saved_shapes[key] != current_shapes[key]
            ]
            key = differ[0]
            before, now = (list(shapes.get(key, ["absent"])) for shapes in (saved_shapes, current_shapes))
            detail = f"{key}: {before} saved, {now} now"
            raise self._mismatch("model", saved.get("model"), current["model"], f"parameter shapes differ ({detail})")
        for group in ("env", "model"):
            changed = {
                key: (value, current[group][key])
                for key, value in saved.get(group, {}).items()
                if key in current[group] and value != current[group][key]
            }
            for key, (before, now) in changed.items():
                log.warning(
                    "Resuming with %s.%s=%s (trained with %s): it does not change shapes.", group, key, now, before
                )

    def _mismatch(self, group: str, saved, current, why: str) -> checkpoint.CheckpointError:
        return checkpoint.CheckpointError(
            f"{self.checkpoint_path} was trained with {group}={saved}, but this run asks for {group}={current}: "
            f"{why}. Resume with the original config, or start in a new run dir."
        )

    @property
    def done(self) -> bool:
        return self.stats.step >= self.cfg.total_steps or self.stop_requested.is_set()

    def update(self, batch: dict, initial_core_state: tuple, queues: dict) -> dict | None:
        """One learner update on a batch [T+1, B, ...]; logs its row. Thread-safe.

        A batch that arrives once total_steps is reached (another learner thread got there
        first) is dropped, so every run ends at the same step count.
        """
        steps = int(batch["mask"][1:].sum())  # real steps: partial rollouts are padded
        ends = batch["episode_end"][1:] & batch["mask"][1:]
        episode_returns = batch["episode_return"][1:][ends].tolist()
        with self.lock:
            if self.stats.step >= self.cfg.total_steps:
                return None
            started = time.perf_counter()
            update_stats = self.learner.update(batch, initial_core_state)
            update_stats["update_ms"] = round(1000 * (time.perf_counter() - started), 2)
            with writing(self.csv_path):
                return self.stats.record(steps, episode_returns, update_stats, queues)

    def maybe_checkpoint(self) -> None:
        if time.monotonic() - self._last_save >= self.cfg.checkpoint_interval_s:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        with self.lock:
            state = dict(
                learner=self.learner.state_dict(),
                step=self.stats.step,
                stats=dict(episodes=self.stats.episodes, time_s=self.stats.elapsed_s),
                rng=checkpoint.rng_state(),
                config=to_plain_dict(self.cfg),
                env=env_signature(self.cfg.env.id, self.spec),  # what a resume must match (with the shapes)
            )
            with writing(self.checkpoint_path):
                checkpoint.save(self.checkpoint_path, state)
        self._last_save = time.monotonic()
        log.info("Saved checkpoint at step %d to %s.", self.stats.step, self.checkpoint_path)

    def close(self) -> None:
        self.stats.close()


# Signals that stop a run cleanly. SLURM sends SIGTERM when it cancels or requeues a job (then
# SIGKILL after KillWait, 30 s by default), and submitit asks for SIGUSR2 `signal_delay_s` before
# the time limit and on preemption.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


class StopOnSignals:
    """SIGINT/SIGTERM/SIGUSR2 ask the run to stop cleanly (checkpoint, no orphans); a second SIGINT aborts.

    The first stop signal is kept in `received`, with the handler it displaced (`previous`), so
    that once the checkpoint is written the caller can hand the signal to its owner: under
    submitit that is its job handler, which requeues the job (see launch.hand_over).
    """

    def __init__(self, stop: threading.Event):
        self.stop = stop
        self._previous = {}
        self.received: int | None = None
        self.previous = None  # the handler that owned `received` before us

    def __enter__(self):
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning(
            "Received %s: stopping after the current update and saving a checkpoint.", signal.Signals(signum).name
        )
        if self.received is None:
            self.received, self.previous = signum, self._previous[signum]
        self.stop.set()

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class ActorProcesses:
    """Acting processes (mono actors, poly env clients), replaced when they die, up to a limit.

    start(index, number) starts the process for slot `index`; `number` counts every start of the
    run (replacements too), for actor_seed. on_exit(index) cleans up after a process that ended.
    An exit code in `final` is never replaced (the process finished its job); one in `fatal`
    stops the run with that message (a restart could not fix it).
    """

    def __init__(
        self,
        start: Callable[[int, int], Any],
        count: int,
        max_restarts: int,
        what: str = "Actor",
        on_exit: Callable[[int], None] = lambda index: None,
        final=(),
        fatal=None,
    ):
        self._start_process, self.count, self.max_restarts = start, count, max_restarts
        self.what, self.on_exit, self.final, self.fatal = what, on_exit, tuple(final), dict(fatal or {})
        self.processes = {}
        self.restarts = 0
        self.started = 0
        self.exit_codes = []  # of processes that ended for good

    def start(self) -> None:
        for index in range(self.count):
            self._start(index)

    def _start(self, index: int) -> None:
        self.processes[index] = self._start_process(index, self.started)
        self.started += 1

    def supervise(self, replace: bool, broken=()) -> None:
        """Replaces processes that died (or whose pipe broke) while `replace`; raises when they keep dying."""
        for index, process in list(self.processes.items()):
            if process.is_alive() and index not in broken:
                continue
            process.join(timeout=1.0)
            if process.is_alive():  # its pipe broke but it lingers: end it
                process.kill()
                process.join()
            del self.processes[index]
            self.on_exit(index)
            code = process.exitcode
            if not replace or code in self.final:
                self.exit_codes.append(code)
                continue
            if code in self.fatal:
                raise RuntimeError(self.fatal[code].format(index=index))
            self.restarts += 1
            log.error(
                "%s %d (pid %s) %s; starting a replacement (%d/%d).",
                self.what,
                index,
                process.pid,
                describe_exit(code),
                self.restarts,
                self.max_restarts,
            )
            if self.restarts > self.max_restarts:
                raise RuntimeError(
                    f"{self.what.lower()}s died {self.restarts} times (last exit code {code}); see the log "
                    "above for the cause. Raise backend.max_actor_restarts if crashes are expected."
                )
            self._start(index)

    @property
    def running(self) -> bool:
        return any(process.is_alive() for process in self.processes.values())

    def stop(self, timeout: float = 5.0) -> None:
        """Waits up to timeout for the processes to exit (after being told to), then ends them."""
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join()


class Backend:
    """The training loop both backends share; a backend supplies only how rollouts are produced.

    Here: the learner threads (batch -> TrainingRun.update -> publish the new weights to the
    acting policy), the main loop (progress line, checkpoints, supervision through `wait`), clean
    stopping on signals, and the final checkpoint. A backend implements:

    - start(): start producing rollouts (actor processes, a server, ...);
    - wait(timeout): one beat of the main loop: wait for news, replace dead actors;
    - next_batch(): (batch [T+1, B, ...] on the CPU, core state, the backend's own statistics
      for logs.csv), or None once the run is done (check run.done while waiting);
    - shut_down(): stop producing and end every process it started;
    - progress() (optional): text appended to the progress line.
    """

    num_learner_threads = 1

    def __init__(self, cfg, run: TrainingRun, policy: torch.nn.Module):
        self.cfg = cfg
        self.run = run
        self.policy = policy  # the acting copy of the model; publish_weights keeps it current
        self.policy.eval()
        self.weights_lock = threading.Lock()  # held while the acting copy is written
        self._errors = []
        self.publish_weights()

    # -- what a backend supplies -------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def wait(self, timeout: float) -> None:
        raise NotImplementedError

    def next_batch(self):
        raise NotImplementedError

    def shut_down(self) -> None:
        raise NotImplementedError

    def progress(self) -> str:
        return ""

    # -- shared ------------------------------------------------------------------------------

    def publish_weights(self) -> None:
        """Copies the learner's weights into the acting policy (in place: shared memory stays shared)."""
        with torch.no_grad(), self.run.lock, self.weights_lock:
            for target, source in zip(self.policy.state_dict().values(), self.run.learner.model.state_dict().values()):
                target.copy_(source)

    def _learn(self) -> None:
        # Per thread: intra-op threads are a per-thread setting.
        torch.set_num_threads(self.cfg.backend.learner_torch_threads or usable_cores())
        try:
            while not self.run.done:
                got = self.next_batch()
                if got is None:
                    return
                batch, core_state, observed = got
                self.run.update(*to_device(batch, core_state, self.run.device), observed)
                self.publish_weights()
        except BaseException as error:  # surfaced by the main thread
            self._errors.append(error)
            self.run.stop_requested.set()

    def train(self) -> None:
        run = self.run
        learners = [
            threading.Thread(target=self._learn, name=f"learner-{i}", daemon=True)
            for i in range(self.num_learner_threads)
        ]
        with StopOnSignals(run.stop_requested) as run.stopped_by:
            try:
                self.start()
            except BaseException:  # e.g. the server's port is taken: nothing learned, nothing to save
                run.stop_requested.set()
                self.shut_down()
                raise
            try:
                for thread in learners:
                    thread.start()
                last_log = time.monotonic()
                while not run.done:
                    self.wait(timeout=0.2)
                    if time.monotonic() - last_log >= self.cfg.logger.log_interval_s:
                        log.info("%s%s", run.stats.progress_line(), self.progress())
                        last_log = time.monotonic()
                    run.maybe_checkpoint()
            finally:
                run.stop_requested.set()
                for thread in learners:
                    if thread.is_alive():
                        thread.join()
                self.shut_down()
                run.save_checkpoint()  # the learner's last consistent state, whatever stopped us
            if self._errors:
                raise self._errors[0]
        log.info("Finished: %s", run.stats.progress_line())
