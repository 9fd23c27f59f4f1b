"""One member of a population: its hyperparameters, its publishes, its exploits.

A Member attaches to a TrainingRun (join): it sets the run's live hyperparameters, and the run's
main loop calls `tick` between beats. Every pbt.interval_steps the member publishes its score and
a checkpoint to the population's dir; then, when it ranks in the bottom fraction of the scores
published so far, it copies a better member's latest published checkpoint (weights with the
normalisation statistics, optimiser state) and that member's values, mutated (exploit, explore).
Its step count, LR schedule position and RNG stay its own.

Its values and lineage ride in the run's checkpoint (TrainingRun.extra_state), so a member killed or
requeued resumes with them; a checkpoint is saved right after each exploit, so the weights on disk
always match the values.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.launch.jobs import safe_dir_name
from torchbeast_hydra.logs.sweep_record import fixed_overrides, is_fixed, override_key
from torchbeast_hydra.pbt import mutation, population
from torchbeast_hydra.pbt.settings import PbtObjective, PbtStart, mutations

log = logging.getLogger(__name__)

STATE_KEY = "pbt"
RECENT_EPISODES = 100


def population_dir(cfg) -> Path:
    """pbt.dir, else SWEEP_DIR/pbt (SWEEP_DIR/pbt/<the job's other swept overrides>, so that
    `-m pbt=default seed=1,2` runs one population per seed)."""
    if cfg.pbt.dir:
        return Path(cfg.pbt.dir)
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        raise ConfigError(
            "a population's members are the jobs of a multirun: add -m (python -m torchbeast_hydra -m pbt=default "
            "...), or give this run its population's dir with pbt.dir=PATH."
        )
    sweep_dir = Path(hydra_cfg.sweep.dir)
    fixed = fixed_overrides(sweep_dir)
    others = [
        str(o) for o in hydra_cfg.overrides.task if not is_fixed(str(o), fixed) and override_key(str(o)) != "pbt.member"
    ]
    return sweep_dir / "pbt" / safe_dir_name(",".join(sorted(others)), 0) if others else sweep_dir / "pbt"


def join(cfg, run) -> Member | None:
    """The run's Member when pbt.population > 0 (attached to the run), else None."""
    if cfg.pbt.population == 0:
        return None
    return Member(cfg, run, population_dir(cfg))


class Member:
    def __init__(self, cfg, run, directory: Path):
        self.settings = cfg.pbt
        self.seed = cfg.seed
        self.me = cfg.pbt.member
        self.run = run
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.specs = mutations(cfg.pbt)
        self.keys = sorted(self.specs)
        self.interval = cfg.pbt.interval_steps
        saved = run.resumed_extras.get(STATE_KEY)
        step = run.stats.step
        if saved:  # resumed: the values and lineage it had, whatever the config says
            self.values = {key: saved["values"][key] for key in self.keys}
            self.lineage = list(saved["lineage"])
            self.last_event = saved["last_event"]
            event = "resume"
        else:
            configured = run.learner.hyperparameters(self.keys)
            resample = PbtStart(cfg.pbt.start) is PbtStart.resample
            self.values = mutation.start_values(self.specs, configured, self.me, resample, self._rng("start"))
            self.lineage, self.last_event = [], step
            event = "start" if step == 0 else "resume"
        self._episodes_at = run.stats.episodes
        self.next_step = (step // self.interval + 1) * self.interval
        with run.lock:
            run.learner.set_hyperparameters(self.values)
        run.extra_state[STATE_KEY] = self.state
        run.main_loop_hooks.append(self.tick)
        self._append(event, step)
        log.info(
            "Population member %d of %d (%s), %s: %s.",
            self.me,
            self.settings.population,
            self.dir,
            event,
            ", ".join(f"{key}={value:.4g}" for key, value in self.values.items()) or "no keys mutate",
        )

    def state(self) -> dict:
        """What the run's checkpoint keeps of this member (and what an exploiting member reads)."""
        return dict(values=dict(self.values), lineage=list(self.lineage), last_event=self.last_event, member=self.me)

    def tick(self, final: bool = False) -> None:
        """Between beats of the main loop: publish (and perhaps exploit) once an interval has passed.
        final: at the end of a run: publish whatever the last interval measured, never exploit."""
        step = self.run.stats.step
        if step < self.next_step and not (final and step > self.last_event):
            return
        score = self._score()
        if score is None:  # pbt.objective=eval: waits for an evaluation of weights taken since the last event
            return
        self.next_step = (step // self.interval + 1) * self.interval
        self._publish(step, score)
        if self.settings.exploit and not final and step < self.run.cfg.total_steps:  # the last weights stay its own
            self._maybe_exploit(step)

    def finish(self) -> None:
        """The run reached its end: its last figures are published for the members still training."""
        if self.run.complete:
            self.tick(final=True)

    # -- the steps of an interval ---------------------------------------------------------------

    def _score(self) -> float | None:
        if PbtObjective(self.settings.objective) is PbtObjective.eval:
            newer = [score for step, score, _ in self.run.evaluations.scores() if step > self.last_event]
            return newer[-1] if newer else None
        with self.run.lock:
            returns = list(self.run.stats.recent_returns)
            ended = self.run.stats.episodes - self._episodes_at
        if ended > 0:  # the episodes of this interval only: after an exploit, not the old weights'
            returns = returns[-min(ended, RECENT_EPISODES) :]
        return sum(returns) / len(returns) if returns else math.nan

    def _publish(self, step: int, score: float) -> None:
        self.run.write_state(population.published_path(self.dir, self.me))
        self._append("publish", step, score=score)
        self.last_event = step
        self._episodes_at = self.run.stats.episodes
        log.info("Member %d published at step %d: score %.2f.", self.me, step, score)

    def _maybe_exploit(self, step: int) -> None:
        rng = self._rng(f"exploit/{step}")
        published = population.latest_scores(population.read_table(self.dir))
        latest = {member: score for member, (_, score) in published.items()}
        source = population.choose_source(
            latest, self.me, self.settings.bottom_fraction, self.settings.top_fraction, rng
        )
        if source is None:
            return
        try:
            state = population.load_published(self.dir, source)
        except Exception as error:  # a member's file that cannot be read never stops another member
            log.warning("Member %d could not copy member %d (%s); training on.", self.me, source, error)
            return
        copied = state.get("extras", {}).get(STATE_KEY, {}).get("values", {})
        base = {key: copied.get(key, self.values[key]) for key in self.keys}
        values = mutation.explore(self.specs, base, self.settings.resample_probability, rng)
        learner = self.run.learner
        with self.run.lock:
            learner.model.load_state_dict(state["learner"]["model"])
            learner.optimizer.load_state_dict(state["learner"]["optimizer"])
            learner.set_hyperparameters(values)  # also puts the member's own LR schedule back on the copied state
        self.values = values
        self.lineage.append(dict(step=step, source=source, source_step=state["step"]))
        self.last_event = self.run.stats.step
        self._episodes_at = self.run.stats.episodes
        self._append("exploit", step, exploited_from=source, from_step=state["step"])
        self.run.save_checkpoint()  # the weights on disk match the values and lineage from here on
        log.info(
            "Member %d (score %.2f) copied member %d at its step %d (score %.2f): %s.",
            self.me,
            latest[self.me],
            source,
            state["step"],
            latest[source],
            ", ".join(f"{key}={value:.4g}" for key, value in values.items()) or "no keys mutate",
        )

    def _append(self, event: str, step: int, **row) -> None:
        run_dir = os.path.relpath(self.run.run_dir.resolve(), self.dir.resolve())
        population.append(
            self.dir,
            dict(time=round(time.time(), 3), member=self.me, step=step, event=event, run_dir=run_dir, **row)
            | self.values,
            self.keys,
        )

    def _rng(self, what: str) -> random.Random:
        """A generator of this member's own (never the run's): the same draws after a resume."""
        return random.Random(f"{self.seed}/{self.me}/{what}")
