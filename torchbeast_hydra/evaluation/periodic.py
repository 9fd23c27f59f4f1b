"""Evaluation during training: the current policy, measured apart from the training envs.

Every `eval.interval_steps` agent steps, a snapshot of the learner's weights (a CPU copy, taken
between updates) goes to an evaluation process, which plays `eval.episodes` whole episodes on an
env of its own (its own seed, run.seeding.eval_seed; test mode's protocol) while training goes on.
A snapshot that comes due while the previous one is still being played is skipped, never queued:
evaluation never holds the learner back. At the end of a run that reaches total_steps, one final
evaluation is played in the learner process (when evaluation is on).

Rows go to RUN_DIR/eval.csv (mode=test's columns, plus `final`) and, as eval/*, to wandb and
TensorBoard. A failing evaluation logs one warning and turns evaluation off; training goes on.

With `eval.stop_at_return`, an evaluation whose mean return reaches it completes the run
(`target_reached`) once `eval.stop_confirmations` more have reached it too, each started as soon as
the one before it ends (a new snapshot); one that falls short starts the count again. It is read
back from eval.csv on resume, so a resumed run that met it stays complete.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from pathlib import Path

import torch

from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.env.engines import evaluation_envs
from torchbeast_hydra.evaluation.evaluate import (
    EVAL_FIGURES,
    Rules,
    figures,
    one_torch_thread,
    play,
    protocol,
    with_test_protocol,
)
from torchbeast_hydra.logs.metrics import CsvLog, read_rows, target_met
from torchbeast_hydra.run.seeding import eval_seed
from torchbeast_hydra.run.settings import to_plain_dict
from torchbeast_hydra.run.supervision import parent_alive, process_context

log = logging.getLogger(__name__)

FILENAME = "eval.csv"
STOP_TIMEOUT_S = 10.0
FINISH_TIMEOUT_S = 120.0  # at the end of a run, for the evaluation still playing
PARENT_CHECK_S = 1.0  # how often the evaluation process, idle, checks that the learner's is alive


class Player:
    """An evaluation env and a CPU copy of the model: plays whole episodes with given weights,
    every evaluation from the same seeded starts."""

    def __init__(self, model_cfg, env_cfg, seed: int):
        self.env_cfg = env_cfg
        self.seed = seed
        self.envs = evaluation_envs(env_cfg, 1, seed)
        self.model = make_model(model_cfg, self.envs.spec, initialise=False).eval()

    def play(self, weights: dict, rules: Rules) -> dict:
        self.model.load_state_dict(weights)
        started = time.monotonic()
        returns, lengths = play(self.model, self.envs, rules, self.seed)
        return dict(
            **figures(returns, lengths, time.monotonic() - started),
            **protocol(self.env_cfg, self.envs, rules),
        )

    def close(self) -> None:
        self.envs.close()


def _worker(model_cfg, env_cfg, seed, rules: Rules, requests, results) -> None:
    """The evaluation process: plays each snapshot it is sent until it is sent None."""
    try:
        torch.set_num_threads(1)  # one env at a batch of one, beside the run's processes
        player = Player(model_cfg, env_cfg, seed)
        while (request := _next_request(requests)) is not None:
            step, weights = request
            results.put((step, player.play(weights, rules)))
        player.close()
    except Exception as error:  # reported by the learner process, which turns evaluation off
        results.put((None, f"{type(error).__name__}: {error}"))


def _next_request(requests):
    """The next snapshot to play, or None: sent to stop, or the learner process is gone (killed,
    say by the OOM killer: nothing would ever come, and the process would outlive its run)."""
    while True:
        try:
            return requests.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if not parent_alive():
                return None


class Evaluations:
    """Periodic and final evaluations of one training run, and their rows."""

    def __init__(self, cfg, run_dir: Path, sinks: list, resume_step: int):
        """sinks: where eval/* figures go besides eval.csv (wandb, TensorBoard): each has log_eval(row)."""
        self.settings = cfg.eval
        # Test mode's rules, with evaluation's own number of games and choice of greedy or sampled.
        self.rules = dataclasses.replace(Rules.of_test(cfg.test), episodes=cfg.eval.episodes, greedy=cfg.eval.greedy)
        self.model_cfg = cfg.model
        self.env_cfg = with_test_protocol(cfg, to_plain_dict(cfg)["env"])
        self.seed = eval_seed(cfg.seed)
        self.path = Path(run_dir) / FILENAME
        self.sinks = sinks
        if self.path.exists():  # rows past the checkpoint measured weights this run no longer has
            CsvLog(self.path, resume_step=resume_step, fields=()).close()
        interval = self.settings.interval_steps
        self.next_step = (resume_step // interval + 1) * interval if interval else None
        # The end of the run is the final evaluation's, when there is one.
        self.last_periodic_step = cfg.total_steps - 1 if self.settings.final else cfg.total_steps
        self._process = None
        self._in_flight: int | None = None
        # With eval.stop_at_return: the periodic evaluations' (step, mean return) up to the checkpoint
        # (eval.csv is read only when there is a target), and the one at which the target counts as met.
        self._periodic: list[tuple[int, float]] = []
        self.target_reached: tuple[int, float] | None = None
        if self.settings.stop_at_return is not None:
            for step, score, final in self.scores():
                if not final and step <= resume_step:
                    self._count(step, score)

    def maybe_start(self, step: int, snapshot) -> None:
        """Called between updates: reports finished evaluations, and sends snapshot() (the step and
        the weights at it, a CPU copy) to be played when an evaluation is due and none is in flight."""
        if self.next_step is not None and self.next_step > self.last_periodic_step:
            self.next_step = None  # none will come due: no process needed
        if self.next_step is not None and self._process is None:
            self._start_process()  # at the first call: spawning and importing take seconds
        self.poll()
        if self.next_step is None:
            return
        if step < self.next_step and (self._in_flight is not None or not self._confirming()):
            return  # not due; a confirmation starts once the evaluation playing now has ended
        interval = self.settings.interval_steps
        self.next_step = (step // interval + 1) * interval
        if self._in_flight is not None:
            log.info("Evaluation at step %d skipped: the one of step %d is still playing.", step, self._in_flight)
            return
        taken_at, weights = snapshot()  # at `step` or an update later: the row says which
        self._requests.put((taken_at, weights))
        self._in_flight = taken_at

    def poll(self, wait_s: float = 0.0) -> None:
        """Writes the rows of evaluations that have finished, waiting up to wait_s for one in flight."""
        while self._process is not None:
            waiting = wait_s if self._in_flight is not None else 0.0
            try:
                step, result = self._results.get(timeout=waiting) if waiting else self._results.get_nowait()
            except queue.Empty:
                return
            self._in_flight = None
            if step is None:
                log.warning("Evaluation failed (%s); training goes on without it.", result)
                self.close()
                self.next_step = None
                return
            self._write(step, result, final=False)

    def final(self, step: int, weights: dict) -> dict | None:
        """The end-of-run evaluation, played here (training is over: the cores are free)."""
        self.poll(wait_s=FINISH_TIMEOUT_S)  # the periodic evaluation still playing, if any
        self.close()
        if not (self.settings.final and self.settings.interval_steps) or self._has_final(step):
            return None
        with one_torch_thread():
            player = Player(self.model_cfg, self.env_cfg, self.seed)
            try:
                result = player.play(weights, self.rules)
            finally:
                player.close()
        return self._write(step, result, final=True)

    def close(self) -> None:
        if self._process is None:
            return
        self._requests.put(None)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.terminate()
        self._process = None
        self._in_flight = None

    def _start_process(self) -> None:
        context = process_context()
        self._requests, self._results = context.Queue(), context.Queue()
        args = (
            self.model_cfg,
            self.env_cfg,
            self.seed,
            self.rules,
            self._requests,
            self._results,
        )
        self._process = context.Process(target=_worker, args=args, name="evaluation", daemon=True)
        self._process.start()

    def _write(self, step: int, result: dict, final: bool) -> dict:
        row = dict(step=step, **result, final=final, seed=self.seed)
        csv = CsvLog(self.path, resume_step=None, fields=list(row))
        csv.write(row)
        csv.close()
        if not final:
            self._count(step, row["mean_return"])
            if self._confirming():
                log.info("Evaluation at step %d met eval.stop_at_return: confirming with the next.", step)
        for sink in self.sinks:
            sink.log_eval({key: row[key] for key in ("step", *EVAL_FIGURES)})
        log.info(
            "Evaluation%s at step %d: mean return %.2f ± %.2f over %d episodes.",
            " (final)" if final else "",
            step,
            row["mean_return"],
            row["std_return"],
            row["episodes"],
        )
        return row

    def _count(self, step: int, score: float) -> None:
        """A periodic evaluation's result towards eval.stop_at_return (live, or read back on resume)."""
        target = self.settings.stop_at_return
        if target is None or self.target_reached is not None:
            return
        self._periodic.append((step, score))
        self.target_reached = target_met(self._periodic, target, self.settings.stop_confirmations)

    def _confirming(self) -> bool:
        """The last evaluation met the target, which is not yet confirmed: the next starts at once."""
        target = self.settings.stop_at_return
        return self.target_reached is None and bool(self._periodic) and self._periodic[-1][1] >= target

    def _has_final(self, step: int) -> bool:
        """A run resumed at its end has had its final evaluation already."""
        return self.path.exists() and any(row["step"] == step and row.get("final") for row in read_rows(self.path))

    def scores(self) -> list[tuple[int, float, bool]]:
        """(step, mean return, final) of every evaluation this run made, from eval.csv (not the rows
        mode=test may have added to it, which have no `final`)."""
        if not self.path.exists():
            return []
        return [
            (row["step"], row["mean_return"], row["final"])
            for row in read_rows(self.path)
            if row.get("final") is not None
        ]
