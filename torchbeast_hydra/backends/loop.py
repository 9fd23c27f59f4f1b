"""The training loop every backend shares; a backend (mono/backend.py, poly/backend.py) supplies
only how rollouts are produced. registry.py lists the backends by name."""

from __future__ import annotations

import logging
import threading
import time

import torch

from torchbeast_hydra.learning import accel
from torchbeast_hydra.learning.policy_lag import BehaviourVersions
from torchbeast_hydra.run.devices import learner_threads, to_device, usable_cores
from torchbeast_hydra.run.publish import WeightPublisher
from torchbeast_hydra.run.signals import StopOnSignals
from torchbeast_hydra.run.thread_trial import ThreadTrial
from torchbeast_hydra.run.training_run import TrainingRun

log = logging.getLogger(__name__)


class Backend:
    """The training loop both backends share; a backend supplies only how rollouts are produced.

    Here: the learner threads (batch -> TrainingRun.update -> publish the new weights to the
    acting policy), the main loop (progress line, checkpoints, supervision through `wait`), clean
    stopping on signals, and the final checkpoint. A backend implements:

    - start(): start producing rollouts (actor processes, a server, ...);
      anything of theirs that fails in a way that must end the run calls fail(error);
    - wait(timeout): one beat of the main loop: wait for news, replace dead actors;
    - next_batch(): (batch [T+1, B, ...] on the CPU, core state, the backend's own statistics
      for logs.csv), or None once the run is done (check run.done while waiting);
    - shut_down(): stop producing and end every process it started;
    - progress() (optional): text appended to the progress line;
    - describe() (optional): the backend's lines of the start-up summary (how it acts).
    """

    num_learner_threads = 1

    def __init__(self, cfg, run: TrainingRun, policy: torch.nn.Module):
        self.cfg = cfg
        self.run = run
        self.policy = policy  # the acting copy of the model; self.publisher keeps it current
        self.policy.eval()
        self.weights_lock = threading.Lock()  # held while the acting copy is written
        self._errors = []
        self.publisher = WeightPublisher(
            run.learner.model,
            policy,
            run.lock,
            self.weights_lock,
            cfg.backend.publish_interval,
            updates=lambda: run.learner.updates,
            synchronous=cfg.backend.synchronous,
        )
        self.publisher.publish_now()
        self.bf16_acting = accel.acts_in_bf16(cfg.accel, run.learner.bf16)
        # Observations beyond it would be inf in the model: refused (mono's guard, poly's server).
        self.float_limit = accel.float_limit(run.learner.bf16 or self.bf16_acting)

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

    def describe(self) -> dict:
        return {}

    def local_actor_processes(self) -> int:
        """The processes on this machine that act or step envs, busy beside the learner."""
        return self.cfg.backend.num_actors

    # -- shared ------------------------------------------------------------------------------

    def thread_trial(self) -> ThreadTrial:
        """Intra-op threads for each learner thread: backend.learner_torch_threads, or (0)
        devices.learner_threads' choice, which a CPU learner given fewer than the cores then tries
        against the cores (thread_trial.py)."""
        configured, bf16 = self.cfg.backend.learner_torch_threads, self.run.learner.bf16
        chosen = learner_threads(configured, self.run.device, bf16, self.local_actor_processes())
        on_trial = not configured and self.run.device.type == "cpu"
        return ThreadTrial(chosen, usable_cores() if on_trial else chosen)

    def fail(self, error: BaseException) -> None:
        """Ends the run with this error (raised by train() once the run is wound up)."""
        self._errors.append(error)
        self.run.stop_requested.set()

    def _learn(self, trial: ThreadTrial) -> None:
        threads = None
        try:
            while not self.run.done:
                if trial.threads != threads:  # per thread: intra-op threads are a per-thread setting
                    threads = trial.threads
                    torch.set_num_threads(threads)
                got = self.next_batch()
                if got is None:
                    return
                batch, core_state, observed = got
                figures = self.run.batch_figures(batch)  # from the CPU copy: no wait on the device
                versions = BehaviourVersions.of(batch)
                row = self.run.update(*to_device(batch, core_state, self.run.device), observed, figures, versions)
                if row is not None:
                    trial.observe(row)
                self.publisher.after_update()
        except BaseException as error:  # surfaced by the main thread
            self.fail(error)

    def _log_summary(self, trial: ThreadTrial) -> None:
        """One block that says what started, in the log and in run_info.yaml."""
        run = self.run.describe()
        on_trial = "" if trial.settled else f" ({trial.cores} if it proves the slower side)"
        precision = ", bf16 autocast" if self.run.learner.bf16 else ""
        precision += ", acting in bf16" if self.bf16_acting else ""
        plural = "s" if trial.threads > 1 else ""
        learner = f"{trial.threads} torch thread{plural}{on_trial}{precision}"
        summary = {"device": run.pop("device"), "learner": learner, **self.describe(), **run}
        width = max(map(len, summary))
        log.info("Starting:\n%s", "\n".join(f"  {key:<{width}}  {value}" for key, value in summary.items()))
        self.run.add_to_run_info("startup", summary)

    def _save_final_checkpoint(self) -> None:
        """The learner's last consistent state, whatever stopped us. After a failure that also
        breaks saving (a sticky CUDA error makes every later use of the device fail), the
        failure is what gets reported; the last checkpoint saved stays as it was."""
        try:
            self.run.save_checkpoint()
        except Exception as error:
            if not self._errors:
                raise
            log.error(
                "Could not save a final checkpoint after the failure below (%s: %s); %s is the last one saved.",
                type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
                self.run.checkpoint_path,
            )

    def train(self) -> None:
        run = self.run
        trial = self.thread_trial()
        learners = [
            threading.Thread(target=self._learn, args=(trial,), name=f"learner-{i}", daemon=True)
            for i in range(self.num_learner_threads)
        ]
        with StopOnSignals(run.stop_wanted) as run.stopped_by:
            try:
                self.start()
            except BaseException:  # e.g. the server's port is taken: nothing learned, nothing to save
                run.stop_requested.set()
                self.shut_down()
                raise
            try:
                self._log_summary(trial)
                for thread in learners:
                    thread.start()
                last_log = time.monotonic()
                while not run.done:
                    self.wait(timeout=0.2)
                    run.agree_to_stop()  # with several ranks: a stop signal, without waiting for a batch
                    if time.monotonic() - last_log >= self.cfg.logger.log_interval_s:
                        log.info("%s%s", run.stats.progress_line(), self.progress())
                        last_log = time.monotonic()
                    run.maybe_checkpoint()
                    run.maybe_evaluate()
                    run.run_hooks()
            finally:
                run.stop_requested.set()
                for thread in learners:
                    if thread.is_alive():
                        thread.join()
                self.shut_down()
                self.publisher.close()
                self._save_final_checkpoint()
            if self._errors:
                raise self._errors[0]
        log.info("%s", run.outcome())
        run.final_evaluation()
