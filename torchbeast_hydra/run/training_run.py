"""The run's state: the learner plus the run dir (resume, checkpoints, stats), one for every backend.

`TrainingRun` resumes from the run dir's checkpoint on start (resume.py says when it may),
updates the learner thread-safely, logs each update's row and checkpoints on a timer and at exit,
so mono and poly resume, log and checkpoint identically.

With several data-parallel ranks (`ranks`, launch/distributed.py), every rank has one: each update's
figures are agreed across the ranks first (global steps, every rank's returns, a stop asked of
any rank), the learner averages gradients, and rank 0 alone writes checkpoints and run_info.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import threading
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.learning import accel
from torchbeast_hydra.learning.learner import Learner
from torchbeast_hydra.learning.policy_lag import BehaviourVersions, lag_figures, stale_rollouts, without_rollouts
from torchbeast_hydra.logs.metrics import LOGS, CsvLog, Stats, duration
from torchbeast_hydra.logs.wandb_log import WandbLog, hydra_labels
from torchbeast_hydra.run import checkpoint
from torchbeast_hydra.run.devices import device_name, resolve_device
from torchbeast_hydra.run.resume import check_resumable, config_changes, describe_changes, env_signature
from torchbeast_hydra.run.seeding import seed_everything
from torchbeast_hydra.run.settings import to_plain_dict
from torchbeast_hydra.run.signals import StopOnSignals

log = logging.getLogger(__name__)


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


class NoEvaluations:
    """A run without evaluation during training: what TrainingRun asks of its evaluations."""

    target_reached = None  # (step, mean return) of the evaluation that met eval.stop_at_return

    def __init__(self, cfg=None, run_dir=None, sinks=(), resume_step: int = 0):
        pass

    def maybe_start(self, step: int, snapshot) -> None:
        pass

    def final(self, step: int, weights: dict) -> None:
        pass

    def scores(self) -> list:
        return []

    def close(self) -> None:
        pass


class TrainingRun:
    """The learner plus the run dir's state: resumes on start, checkpoints on a timer and at exit."""

    def __init__(self, cfg, run_dir: str | Path, spec: EnvSpec, ranks=None, evaluations=NoEvaluations):
        """ranks: this rank's launch.distributed.Ranks in a data-parallel run; None with one rank.
        evaluations: what plays the run's weights during training, built as evaluations(cfg,
        run_dir, sinks, resume_step) (the command passes evaluation.periodic.Evaluations; run/
        sits below evaluation/ and never imports it)."""
        self.cfg = cfg
        self.ranks = ranks
        self.run_dir = Path(run_dir)
        self.spec = spec
        self.checkpoint_path = checkpoint.path_in(self.run_dir)
        self.csv_path = self.run_dir / LOGS
        self._make_learner()
        self._make_stop_events()
        # What others keep in the checkpoint: name -> a function giving its state (e.g. a population
        # member's values and lineage, pbt/member.py), read back on resume into resumed_extras.
        self.extra_state: dict = {}
        self.resumed_extras: dict = {}
        self.main_loop_hooks: list = []  # called between the main loop's beats (pbt/member.py's tick)
        start_step, episodes, elapsed_s = self._resume()
        if ranks is not None:
            ranks.synchronise(self.learner.model, start_step, cfg.seed)
        self.resumed = start_step > 0
        sinks = self._open_sinks(start_step)
        self.stats = Stats(start_step, cfg.total_steps, sinks, start_time_s=elapsed_s)
        self.stats.episodes = episodes
        eval_sinks = [sink for sink in sinks if hasattr(sink, "log_eval")]
        self.evaluations = evaluations(cfg, self.run_dir, eval_sinks, resume_step=start_step)
        self._last_save = time.monotonic()
        self._stop_if_target_reached()  # a run resumed after it met eval.stop_at_return stays complete

    def _make_learner(self) -> None:
        """The device, the speed switches, the seed, then the learner (the model's initial weights
        follow the seed); with several ranks, it averages gradients across them."""
        cfg, ranks = self.cfg, self.ranks
        self.device = resolve_device(cfg.device)
        accel.apply_switches(cfg.accel)
        seed_everything(cfg.seed)
        self.learner = Learner(
            cfg,
            make_model(cfg.model, self.spec),
            self.device,
            average_gradients=ranks.average_gradients if ranks is not None else None,
            sum_over_ranks=ranks.sum_over_ranks if ranks is not None else None,
        )
        self.lock = threading.Lock()  # guards the learner and stats between updates and saves
        # Rollouts with a step older than this many learner updates are not learned from (None: all are).
        self.max_policy_lag = 0 if cfg.backend.synchronous else cfg.backend.max_policy_lag

    def _make_stop_events(self) -> None:
        self.stop_requested = threading.Event()
        # What a stop signal sets. With several ranks, all must stop after the same update: a signal
        # only asks, and `update` stops every rank once they have agreed on it.
        self.stop_wanted = self.stop_requested if self.ranks is None else threading.Event()
        self.stopped_by: StopOnSignals | None = None  # set by the backend; see launch.jobs.hand_over

    def _resume(self) -> tuple[int, int, float]:
        """Loads the run dir's checkpoint, if any (resume.py says when it may), and says what changed;
        returns (step, episodes, training seconds) to go on from."""
        self.config_changes = {}  # on resume: key -> (the checkpoint's value, this run's)
        self.ranks_before = self.world_size  # on resume: the ranks of the run that wrote the checkpoint
        if not self.checkpoint_path.exists():
            return 0, 0, 0.0
        cfg = self.cfg
        # On the CPU: the RNG states must stay there; load_state_dict moves the rest to the device.
        state = checkpoint.load(self.checkpoint_path, map_location="cpu")
        check_resumable(self.checkpoint_path, state, cfg, self.spec, self.learner.model.state_dict())
        self.learner.load_state_dict(state["learner"])
        checkpoint.set_rng_state(state["rng"])
        self.resumed_extras = state.get("extras", {})
        log.info("Resuming from %s at step %d.", self.checkpoint_path, state["step"])
        self.config_changes = config_changes(state.get("config", {}), to_plain_dict(cfg))
        for line in describe_changes(self.config_changes) if self.is_main else []:
            log.warning(line)
        self.ranks_before = state.get("ranks", 1)  # absent in older checkpoints: one rank
        if self.ranks_before != self.world_size and self.is_main:
            log.warning(rank_change(self.ranks_before, self.world_size))
        # time_s is absent in older checkpoints.
        return state["step"], state["stats"]["episodes"], state["stats"].get("time_s", 0.0)

    def _open_sinks(self, start_step: int) -> list:
        """Where each update's row goes: logs.csv, TensorBoard and wandb, as configured."""
        cfg, sinks = self.cfg, []
        if cfg.logger.csv:
            with writing(self.csv_path):
                sinks.append(CsvLog(self.csv_path, resume_step=start_step))
        if cfg.logger.tensorboard:
            from torchbeast_hydra.logs.tensorboard_log import TensorboardLog

            sinks.append(TensorboardLog(self.run_dir, resume_step=start_step))
        group, name, tags = hydra_labels()
        self.wandb = WandbLog(
            cfg.logger.wandb,
            self.run_dir,
            group=group,
            name=name,
            tags=tags,
            config=to_plain_dict(cfg),
            resume_step=start_step,
        )
        if self.wandb.active:
            sinks.append(self.wandb)
        return sinks

    def describe(self) -> dict:
        """What this run is, for the start-up summary (the backend adds how it acts)."""
        model = self.learner.model
        core = f" + LSTM ({model.lstm.num_layers} layers)" if model.use_lstm else ""
        wandb = self.wandb.mode if self.wandb.active or self.wandb.mode == "disabled" else "failed to start"
        summary = {
            "device": device_name(self.device),
            "model": f"{type(model.body).__name__}{core}, {sum(p.numel() for p in model.parameters()):,} parameters",
            "batch": f"{self.cfg.batch_size} unrolls x {self.cfg.unroll_length} steps",
            "run dir": str(self.run_dir.resolve()),
            "wandb": f"{wandb} {self.wandb.url}" if self.wandb.url else wandb,
        }
        if self.ranks is not None:
            summary["ranks"] = self.ranks.describe()
        if self.resumed:
            summary["resumed"] = f"at step {self.stats.step:,}, {len(self.config_changes)} settings changed"
            if self.ranks_before != self.world_size:
                summary["resumed"] += f", from {self.ranks_before} ranks to {self.world_size}"
        return summary

    def add_to_run_info(self, section: str, values: dict) -> None:
        """Adds a section to run_info.yaml (what produced the run; __main__.write_run_info)."""
        if not self.is_main:
            return
        path = self.run_dir / "run_info.yaml"
        with writing(path):
            info = OmegaConf.load(path) if path.exists() else OmegaConf.create()
            info[section] = values
            OmegaConf.save(info, path)

    def outcome(self) -> str:
        """The last line of a run: finished, or stopped by a signal and how to resume."""
        stats = self.stats
        if self.complete:
            reached = self.evaluations.target_reached
            why = (
                f"total_steps={self.cfg.total_steps:,}"
                if reached is None
                else f"evaluation at step {reached[0]:,}: {reached[1]:.2f} >= eval.stop_at_return"
            )
            return (
                f"Finished: {stats.step:,} agent steps ({why}) in "
                f"{duration(stats.elapsed_s)}. {stats.returns_text()} Checkpoint: {self.checkpoint_path}"
            )
        received = self.stopped_by.received if self.stopped_by is not None else None
        why = f"by {signal.Signals(received).name}" if received is not None else "early"
        return (
            f"Stopped {why} at step {stats.step:,}/{self.cfg.total_steps:,} after {duration(stats.elapsed_s)}; "
            f"the checkpoint is saved. Resume with: {resume_command(self.run_dir)}"
        )

    @property
    def world_size(self) -> int:
        """How many data-parallel ranks this run has (1: no distributed path)."""
        return 1 if self.ranks is None else self.ranks.world_size

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run dir: the only rank, or rank 0."""
        return self.ranks is None or self.ranks.is_main

    @property
    def complete(self) -> bool:
        """Trained as configured: total_steps reached, or an evaluation met eval.stop_at_return."""
        return self.stats.step >= self.cfg.total_steps or self.evaluations.target_reached is not None

    @property
    def done(self) -> bool:
        return self.stats.step >= self.cfg.total_steps or self.stop_requested.is_set()

    @property
    def stopping(self) -> bool:
        """Done, or a signal asked this rank to stop (with several ranks, before they agree on it):
        actors or env clients that die now (SLURM signals every process of a job) are not replaced."""
        return self.done or self.stop_wanted.is_set()

    @staticmethod
    def batch_figures(batch: dict) -> tuple[int, list]:
        """(real steps, returns of the episodes that ended) of a batch [T+1, B, ...]; read from its
        CPU copy, before it moves to the learner's device (there, each read would wait for the device)."""
        steps = int(batch["mask"][1:].sum())  # partial rollouts are padded
        ends = batch["episode_end"][1:] & batch["mask"][1:]
        return steps, batch["episode_return"][1:][ends].tolist()

    def update(
        self,
        batch: dict,
        initial_core_state: tuple,
        queues: dict,
        figures: tuple | None = None,
        versions: BehaviourVersions | None = None,
    ) -> dict | None:
        """One learner update on a batch [T+1, B, ...]; logs its row. Thread-safe.

        figures: batch_figures(the batch's CPU copy), versions: BehaviourVersions.of(it); computed
        here from `batch` when not given. A batch that arrives once total_steps is reached (another
        learner thread got there first) is dropped, so every run ends at the same step count.
        Rollouts older than backend.max_policy_lag (synchronous: any lag) are masked out of the
        update; their steps and episodes still count (they were played), and they are counted in
        dropped_stale_rollouts.
        """
        steps, episode_returns = self.batch_figures(batch) if figures is None else figures
        versions = BehaviourVersions.of(batch) if versions is None else versions
        with self.lock:
            if self.stats.step >= self.cfg.total_steps:
                return None
            if self.ranks is not None:
                agreed = self._agree(steps, episode_returns)
                if agreed is None:
                    return None
                steps, episode_returns = agreed
            lag = lag_figures(versions, self.learner.updates)
            stale = stale_rollouts(versions, self.learner.updates, self.max_policy_lag)
            if len(stale):
                batch = without_rollouts(batch, stale)
                lag["dropped_stale_rollouts"] = len(stale)
            elif self.max_policy_lag is not None:
                lag["dropped_stale_rollouts"] = 0
            started = time.perf_counter()
            if len(stale) < len(versions.oldest) or self.ranks is not None:
                update_stats = self.learner.update(batch, initial_core_state, steps)
            else:  # nothing fresh: no optimiser step (Adam's moments would move the weights anyway)
                self.learner.steps += steps
                update_stats = {}
            update_stats["update_ms"] = round(1000 * (time.perf_counter() - started), 2)
            update_stats.update(lag)
            with writing(self.csv_path):
                return self.stats.record(steps, episode_returns, update_stats, queues)

    def _agree(self, steps: int, episode_returns: list) -> tuple | None:
        """With several ranks: this update's global (steps, returns), or None when the ranks stop now."""
        if self.stop_requested.is_set():  # this rank failed: the others learn it from the failed collective
            return None
        received = self.stopped_by.received if self.stopped_by is not None else None
        agreed = self.ranks.agree(steps, episode_returns, received, self.stop_wanted.is_set())
        if agreed.stop:
            if agreed.stop_signal is not None and self.stopped_by is not None:
                self.stopped_by.adopt(agreed.stop_signal)  # rank 0 hands it on: under submitit, a requeue
            self.stop_requested.set()
            return None
        return agreed.steps, agreed.returns

    def agree_to_stop(self) -> None:
        """With several ranks, once a signal asked this rank to stop: agree on the stop with the others
        now, in place of this rank's next update, without waiting for its next batch (under SLURM the
        signal reaches the actors too: that batch may never come). The others, in their next update's
        agreement or here, stop with it. The lock keeps it between this rank's updates."""
        if self.ranks is None or not self.stop_wanted.is_set() or self.done:
            return
        with self.lock:
            if not self.done:
                self._agree(0, [])  # a stop asked here: every rank stops, none updates

    def maybe_checkpoint(self) -> None:
        if time.monotonic() - self._last_save >= self.cfg.checkpoint_interval_s:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        if not self.is_main:  # every rank holds the same weights: rank 0's checkpoint is the run's
            return
        step = self.write_state(self.checkpoint_path)
        self._last_save = time.monotonic()
        log.info("Saved checkpoint at step %d to %s.", step, self.checkpoint_path)

    def write_state(self, path: Path) -> int:
        """Writes the run's state as a checkpoint to `path` (atomically: checkpoint.save), between
        updates; returns its step. Also how a population member publishes (pbt/member.py)."""
        with self.lock:  # the tensors stay as they are until written
            state = dict(
                learner=self.learner.state_dict(),
                step=self.stats.step,
                stats=dict(episodes=self.stats.episodes, time_s=self.stats.elapsed_s),
                rng=checkpoint.rng_state(),  # rank 0's: the other ranks re-derive theirs on resume
                ranks=self.world_size,  # a resume may use another number (it says so)
                config=to_plain_dict(self.cfg),
                env=env_signature(self.cfg.env.id, self.spec),  # what a resume must match (with the shapes)
                extras={name: extra() for name, extra in self.extra_state.items()},
            )
            with writing(path):
                checkpoint.save(path, state)
        return state["step"]

    def run_hooks(self) -> None:
        """Between the main loop's beats: what others attached (main_loop_hooks)."""
        for hook in self.main_loop_hooks:
            hook()

    def snapshot(self) -> tuple[int, dict]:
        """The step and a CPU copy of the learner's weights at it, taken together between updates
        (for evaluation: another learner thread may update between a look at the step and the copy)."""
        with self.lock:
            state = self.learner.model.state_dict()
            return self.stats.step, {key: value.detach().to("cpu", copy=True) for key, value in state.items()}

    def maybe_evaluate(self) -> None:
        """Starts an evaluation when one is due (none in flight), and logs those that finished."""
        self.evaluations.maybe_start(self.stats.step, self.snapshot)
        self._stop_if_target_reached()

    def _stop_if_target_reached(self) -> None:
        """An evaluation met eval.stop_at_return: stop as a signal would (with several ranks, every
        rank after the same update), but complete: no resume, no requeue."""
        reached = self.evaluations.target_reached
        if reached is not None and not self.stop_wanted.is_set():
            log.info("Evaluation at step %d met eval.stop_at_return (%.2f): training is complete.", *reached)
            self.stop_wanted.set()

    def final_evaluation(self) -> None:
        """The end-of-run evaluation, once the run is complete."""
        if self.complete:
            self.evaluations.final(*self.snapshot())

    def close(self) -> None:
        self.evaluations.close()
        self.stats.close()


def rank_change(before: int, now: int) -> str:
    """The line a resume with another number of ranks logs: what carries over, what changes."""
    return (
        f"Resuming a run of {before} rank(s) with {now}: the weights, optimiser state, LR schedule, step count "
        f"and episodes carry over (every rank loads them); an update now learns from {now} x batch_size unrolls "
        f"(was {before} x), and each rank r > 0 re-seeds from its rank seed (docs/distributed.md)."
    )


def resume_command(run_dir: Path) -> str:
    """The command that resumes this run: the same overrides, in the same run dir (or sweep dir)."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not in a Hydra job (tests, notebooks)
        return f"python -m torchbeast_hydra hydra.run.dir={run_dir}"
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    if hydra_cfg.mode == RunMode.MULTIRUN:  # each job of the sweep finds its own dir again
        return f"your sweep command again, with hydra.sweep.dir={hydra_cfg.sweep.dir}"
    return " ".join(["python -m torchbeast_hydra", *map(shlex.quote, overrides), f"hydra.run.dir={run_dir}"])
